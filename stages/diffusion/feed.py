"""How a block of training data reaches the device (issue 64: the store path at disk speed).

The trainer's Loader reads a block of steps' sequences from the store as stored (float16 where the extract
kept float16: half the bytes of float32), and `Staging` moves them to the training device:

    CPU    torch.from_numpy: no copy, nothing to overlap.
    CUDA   the arrays are copied into a pinned host buffer per array name (two of them, used in turn: the
           block being filled and the block being copied; each grows to the largest block and is then
           reused), then to the device with non_blocking on a side stream, on the Loader's thread. The main
           thread's stream waits for that copy's event (no host synchronisation), so the read and copy of the
           next block overlap the current block's steps.

Each step's rows are then gathered on the device, and `as_float` converts a stored layer to float32 there:
the layer's scale applied and position 0 put back exactly where the extract kept it apart (the same float32
operations as artifacts/hidden_states.with_pos0 on the host, so the same bits).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from dihal.artifacts import hidden_states as hs


def stored(group, layer: int, seqs: np.ndarray, name: str, pos0: bool = True, alloc=None) -> dict[str, np.ndarray]:
    """{name: the layer's sequences `seqs` as stored, name.pos0: their exact position 0 (float32), where the
    extract kept one and `pos0`}: what as_float turns into float32 on the device. alloc(name, shape, dtype):
    where to read them (Staging's reused buffers), else new arrays."""
    array = group[f"layers/{layer}"]
    out = None if alloc is None else alloc(name, (len(seqs), *array.shape[1:]), array.dtype)
    arrays = {name: hs.read_stored(group, layer, seqs, out=out)}
    rows = hs.pos0_rows(group, layer, seqs) if pos0 else None
    if rows is not None:
        arrays[f"{name}.pos0"] = rows
    return arrays


def as_float(batch: dict[str, torch.Tensor], name: str, device, scale: float = 1.0) -> torch.Tensor:
    """float32 values of a stored layer in `batch` on `device` (where the Loader's batch already lies; a host
    array is moved): times the layer's scale (a power of two, hidden_states.layer_scales), position 0 exact
    where `name.pos0` is in the batch."""
    x = torch.as_tensor(batch[name], device=device).float()
    if scale != 1.0:
        x = x * scale
    if f"{name}.pos0" in batch:
        x[:, 0] = torch.as_tensor(batch[f"{name}.pos0"], device=device)
    return x


class Staging:
    """Blocks of host arrays onto `device` (see the module's doc), through SLOTS sets of reused host buffers
    used in turn. On the Loader's thread: `slot()` gives the next set's allocator (once its last copy has
    left it), the task reads into it, `put` makes the block's tensors; on the main thread `ready` hands them
    over. A block's buffers are reused two blocks later, when every step of it has gathered its rows."""

    SLOTS = 2

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(self.SLOTS)]
        self.copied: list = [None] * self.SLOTS
        self.turn = 0

    def slot(self):
        """The next slot's allocator: alloc(name, shape, dtype) -> a host array to fill (pinned on CUDA)."""
        slot, self.turn = self.turn, (self.turn + 1) % self.SLOTS
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()  # this thread only: the buffer's last copy has left it
            self.copied[slot] = None
        return functools.partial(self._alloc, slot)

    def put(self, arrays: dict[str, np.ndarray], alloc) -> dict:
        """The block's arrays as tensors on the device (on CUDA the copy may still be under way); on CUDA an
        array that was not read into the slot's pinned buffers is copied into them first (the CPU uses it as
        it is)."""
        slot = alloc.args[0]
        host = {}
        for name, value in arrays.items():
            mine = self.buffers[slot].get(name)
            if self.cuda and (mine is None or not np.may_share_memory(value, mine.numpy())):
                buffer = alloc(name, value.shape, value.dtype)
                buffer[...] = value
                value = buffer
            host[name] = torch.from_numpy(value)
        if not self.cuda:
            return {"arrays": host, "event": None}
        with torch.cuda.stream(self.stream):
            out = {name: tensor.to(self.device, non_blocking=True) for name, tensor in host.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copied[slot] = event
        return {"arrays": out, "event": event}

    def ready(self, block: dict) -> dict[str, torch.Tensor]:
        """The block's tensors, usable on the main thread's current stream."""
        if block["event"] is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(block["event"])
            for tensor in block["arrays"].values():
                tensor.record_stream(current)  # the allocator keeps it until the main stream is done with it
        return block["arrays"]

    def _alloc(self, slot: int, name: str, shape, dtype) -> np.ndarray:
        return self._buffer(slot, name, shape, dtype).numpy()

    def _buffer(self, slot: int, name: str, shape, dtype) -> torch.Tensor:
        """A view of `shape` and `dtype` into the slot's buffer for `name`, grown when too small; pinned on CUDA."""
        dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        size = int(np.prod(shape))
        buffer = self.buffers[slot].get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < size:
            buffer = torch.empty(size, dtype=dtype, pin_memory=self.cuda)
        self.buffers[slot][name] = buffer
        return buffer[:size].view(tuple(shape))
