"""The trainer's store path at the paper's shape (issue 64 item 3): how fast each loader hands a training step
its batch of one layer, compute excluded, from a warm page cache.

A float16 layer of N sequences x 128 positions x 4096 (1 MiB a sequence), laid out as `dihal extract` writes
it (artifacts/hidden_states.create: chunks of 8 sequences, uncompressed, a float32 position-0 array beside
it), read for 4 epochs of batches of 64 sequences in the trainer's order (stages/diffusion/trainer.py:
chunks permuted, sequences shuffled within windows of 512):

    today's loader   the read path before issue 64: zarr's `oindex` over a block's sorted sequences,
                     float32 made on the host with position 0 put back (hidden_states.with_pos0), each
                     step's rows gathered on the host, then `.astype(float32)` again and `torch.from_numpy`
                     (the bridge's loss did both), as the host did it
    the new loader   stages/diffusion/trainer.Loader's host work: contiguous reads of the chunk runs that hold
                     a block, as stored (float16), into its reused staging buffers (stages/diffusion/
                     feed.Staging: pinned on a GPU, then a non-blocking copy that the device does). Each
                     step's gather and the float32 conversion are the device's there, so they are not
                     counted; `new_cpu_only_*` count them as a CPU-only run does them on the host
    contiguous read  the same bytes as plain slices of a block's size (512 sequences), into one reused buffer

Each figure is MB/s of the layer's stored bytes delivered (4 epochs x N MiB / seconds), best of 3, one run.
What only a GPU can show: the pinned copy's overlap with compute (benchmarks/results/ holds no GPU figure).

    python benchmarks/bench_loader.py [--sequences 1024]     # writes benchmarks/results/loader.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zarr.core.buffer.cpu import NDBuffer  # noqa: E402

from benchmarks.common import Timer, save  # noqa: E402
from dihal.artifacts import hidden_states as hs  # noqa: E402
from dihal.stages.configs import LoopConfig  # noqa: E402
from dihal.stages.diffusion import feed  # noqa: E402
from dihal.stages.diffusion.feed import Staging  # noqa: E402
from dihal.stages.diffusion.trainer import Loader, Schedule  # noqa: E402

T, D, CHUNK, BATCH, WINDOW, EPOCHS, REPEATS = 128, 4096, 8, 64, 512, 4, 3


def make_layer(path: Path, n: int):
    group = hs.create(path, [3], n, T, D, {3: "float16"}, CHUNK, {})
    rng = np.random.default_rng(0)
    block = rng.standard_normal((64, T, D)).astype(np.float16)  # one random block, written over and over
    for s in range(0, n, 64):
        group["layers/3"][s : s + 64] = block[: min(64, n - s)]
    group["pos0/3"][:] = rng.standard_normal((n, D)).astype(np.float32)
    group["split"][:] = 0
    return group


class Task:
    """One stored layer as a training task reads it (the bridge reads two: h_0 and h_l, issue 64 item 1)."""

    def __init__(self, group, n: int, new: bool):
        self.group, self.new, self.n_train, self.chunk, self.tokens_per_item = group, new, n, CHUNK, T - 1

    def read(self, positions: np.ndarray, alloc=None) -> dict[str, np.ndarray]:
        if self.new:
            return feed.stored(self.group, 3, positions, "y", False, alloc)
        states = np.asarray(self.group["layers/3"].oindex[positions])  # today's: oindex, float32 on the host
        return {"y": hs.with_pos0(self.group, 3, states, positions)}


def old_epochs(group, n: int) -> int:
    """Today's loader, in this thread: a block's read, then per step the host gather and conversion."""
    task, schedule = Task(group, n, new=False), Schedule(n, CHUNK, config(n))
    block, delivered = max(1, WINDOW // BATCH), 0
    for first in range(0, schedule.total, block):
        steps = range(first, min(first + block, schedule.total))
        wanted = np.unique(np.concatenate([schedule.items(s) for s in steps]))
        arrays = task.read(wanted)
        for s in steps:
            rows = np.searchsorted(wanted, schedule.items(s))
            batch = torch.from_numpy(arrays["y"][rows][:, 1:].astype(np.float32))
            delivered += batch.shape[0]
    return delivered


def new_epochs(group, n: int, convert: bool) -> int:
    """The new loader end to end on a CPU-only run: reads, then each step's gather (and conversion) here."""
    schedule = Schedule(n, CHUNK, config(n))
    loader, delivered = Loader(Task(group, n, new=True), schedule, 0, 1, 0, "cpu"), 0
    try:
        for s in range(schedule.total):
            _, batch = loader.batch(s)
            y = feed.as_float(batch, "y", "cpu")[:, 1:] if convert else batch["y"]
            delivered += y.shape[0]
    finally:
        loader.close()
    return delivered


def new_host_work(group, n: int) -> int:
    """What the new loader leaves to the host where the device gathers and converts (a GPU run): each block's
    read into the staging buffers, in this thread, the buffers warm (a run reuses them for all its blocks)."""
    schedule = Schedule(n, CHUNK, config(n))
    loader = Loader(Task(group, n, new=True), schedule, 0, 1, schedule.total, "cpu")  # nothing read ahead
    blocks = range(-(-schedule.total // loader.block))
    try:
        for block in blocks[: Staging.SLOTS]:  # first touch of each slot's buffers
            loader._read_block(block)
        with Timer() as t:
            delivered = sum(len(loader._read_block(block)["positions"]) for block in blocks)
    finally:
        loader.close()
    return delivered, t.seconds


def contiguous_reads(array, n: int, into: np.ndarray) -> int:
    """The same bytes as plain contiguous reads of a block's size each, into one reused buffer."""
    for _ in range(EPOCHS):
        for start in range(0, n, WINDOW):
            stop = min(start + WINDOW, n)
            array.get_basic_selection(slice(start, stop), out=NDBuffer.from_numpy_array(into[: stop - start]))
    return EPOCHS * n


def config(n: int) -> LoopConfig:
    return LoopConfig(
        steps=None,
        epochs=EPOCHS,
        batch_size=BATCH,
        lr=1e-3,
        warmup=0,
        schedule="constant",
        ema=0.9,
        eval_every=10**9,
        checkpoint_every=10**9,
        shuffle_window=WINDOW,
    )


def rate(fn, n: int) -> float:
    """MB/s of stored bytes delivered, best of REPEATS (fn: the sequences delivered, or those and its own
    timing)."""
    best = float("inf")
    for _ in range(REPEATS):
        with Timer() as t:
            got = fn()
        delivered, seconds = got if isinstance(got, tuple) else (got, t.seconds)
        assert delivered == EPOCHS * n
        best = min(best, seconds)
    return round(EPOCHS * n * T * D * 2 / best / 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=1024)
    n = parser.parse_args().sequences
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        group = make_layer(Path(tmp) / "h.zarr", n)
        array = group["layers/3"]
        np.asarray(array[:])  # warm the page cache
        into = np.empty((WINDOW, T, D), np.float16)
        contiguous = rate(lambda: contiguous_reads(array, n, into), n)
        old = rate(lambda: old_epochs(group, n), n)
        new = rate(lambda: new_host_work(group, n), n)
        cpu = rate(lambda: new_epochs(group, n, convert=False), n)
        cpu_float = rate(lambda: new_epochs(group, n, convert=True), n)
    result = {
        "shape": {"sequences": n, "seq_len": T, "width": D, "dtype": "float16", "chunk_sequences": CHUNK},
        "order": {"batch": BATCH, "shuffle_window": WINDOW, "epochs": EPOCHS},
        "mb_s": {
            "contiguous_read": contiguous,
            "today": old,
            "new": new,
            "new_cpu_only_with_gathers": cpu,
            "new_cpu_only_with_gathers_and_float32": cpu_float,
        },
        "new_over_contiguous": round(new / contiguous, 2),
        "new_over_today": round(new / old, 2),
        "targets": {"new_over_contiguous": ">= 0.7", "new_over_today": ">= 5"},
    }
    save("loader", result)


if __name__ == "__main__":
    main()
