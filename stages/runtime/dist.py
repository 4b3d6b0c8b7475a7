"""The process group, in one place: joining it from torchrun's environment, ranks and barriers.

Outside torchrun (WORLD_SIZE unset or 1) nothing here starts a group: rank 0 of a world of 1.
Inside `local()` every rank works on its own (a sweep shards layers over ranks, not batches).

Devices. A config records the device *type* (`cpu`, `cuda`), never an index: every rank of a
torchrun job must compute the same artifact ids, and so must a run on GPU 0 and one on GPU 3.
The index lives in torch's current device instead: `join` makes the rank's GPU (`cuda:<LOCAL_RANK>`)
current, or `cuda:N` for one process, so that `cuda` means that GPU everywhere after it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from dihal.artifacts.errors import DihalError
from dihal.stages.configs import DIST_TIMEOUT_ENV, DIST_TIMEOUT_MINUTES
from dihal.stages.runtime.progress import NullProgress

_LOCAL = {"depth": 0}


def launched() -> bool:
    """Started by torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def device_type(device: str) -> str:
    """'cuda:1' -> 'cuda': what a config records."""
    return device.split(":")[0]


def timeout_minutes() -> float:
    return float(os.environ.get(DIST_TIMEOUT_ENV, DIST_TIMEOUT_MINUTES))


def check(device: str) -> None:
    """An indexed --device under torchrun would put every rank on the same GPU."""
    if launched() and ":" in device:
        raise DihalError(
            f"--device {device} under torchrun would put every rank on one GPU; give --device "
            f"{device_type(device)} (rank r takes the GPU of its LOCAL_RANK)"
        )


def join(device: str) -> str:
    """The device this process computes on, made current: under torchrun, `cuda` becomes
    cuda:<LOCAL_RANK> and the process group is joined (NCCL with the rank's device and
    --dist-timeout, Gloo on CPU); one process with cuda:N makes GPU N current."""
    check(device)
    if launched():
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        if not dist.is_initialized():
            kwargs: dict = {"timeout": datetime.timedelta(minutes=timeout_minutes())}
            if device.startswith("cuda"):
                torch.cuda.set_device(torch.device(device))
                kwargs["device_id"] = torch.device(device)
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", **kwargs)
            if not device.startswith("cuda"):
                atexit.register(leave)
    elif device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))
    return device


def leave() -> None:
    """Destroy a Gloo process group before the interpreter tears down (at exit): left to static destruction,
    its C++ threads may be destroyed while still joinable, which aborts the process ("terminate called
    without an active exception"; pytorch #190489). Measured on torch 2.13 and 2 cores: without it, 2 of 6
    two-rank launches that join and all-gather aborted so (issue 65 item 5's one in four); with it, none of 12
    (tests/test_units.py holds eight in a row). Local to the process, no collective. NCCL's is left to torch: its
    destruction can wait on a peer that died, and a failed rank must exit."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world() -> tuple[int, int]:
    """(rank, world size) of the process group; (0, 1) without one."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def distributed() -> tuple[int, int]:
    """(rank, world size) of data-parallel work; (0, 1) outside torchrun or inside local()."""
    return (0, 1) if _LOCAL["depth"] else world()


def is_rank0() -> bool:
    return world()[0] == 0


def barrier() -> None:
    if distributed()[1] > 1:
        dist.barrier()


def barrier_all(world_size: int) -> None:
    """A barrier over the whole group (also inside local()), when there is one."""
    if world_size > 1:
        dist.barrier()


@contextlib.contextmanager
def local():
    """Inside, every rank trains on its own."""
    _LOCAL["depth"] += 1
    try:
        yield
    finally:
        _LOCAL["depth"] -= 1


def from_rank0(obj, world_size: int):
    """Rank 0's obj on every rank of the whole group (also inside local()); obj itself for one process."""
    if world_size <= 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Group:
    """What the store's runner needs of the process group: this rank, a word from rank 0, a barrier."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def broadcast(self, word):
        box = [word]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def solo(self):
        """Rank 0's work of a stage that does not split itself: one process (local()) while the others wait."""
        return local()


def deal(costs: list[float], size: int) -> list[int]:
    """The rank of each unit, by one rule every rank computes alike: the costliest unit first (ties in listing
    order), each to the rank with the least cost dealt so far (ties to the lowest rank). Equal costs deal
    round-robin: units 0, 1, ... to ranks 0, 1, ...; a 5x unit does not queue behind four 1x ones."""
    load, owner = [0.0] * size, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(size), key=lambda r: (load[r], r))
        owner[i], load[rank] = rank, load[rank] + costs[i]
    return owner


def share(units: list, do, name, cost=None, progress=None) -> list:
    """Every unit done once, by the rank deal() gives it, as one process (local()): the units of a stage that
    splits its work into pieces any rank can do alone (each its own artifact, its randomness seeded from the
    unit, never the rank). do(unit, progress) gets rank 0's progress on rank 0 (one rank's bars on a terminal)
    and a silent one elsewhere; progress.log names each unit once, with its rank, on every rank. Then every
    rank learns whether a unit failed anywhere: a failure raises on every rank, naming the unit and its rank,
    so none waits for a rank that has stopped. One process does every unit in order and lets a failure
    through as it is. Returns what do returned for each unit, in the order of units, on every rank."""
    rank, size = distributed()
    progress = progress or NullProgress()
    inner = progress if rank == 0 else NullProgress()
    owners = deal([float(cost(u)) if cost else 1.0 for u in units], size)
    results, failure, error = {}, None, None
    with local():
        for i, (unit, owner) in enumerate(zip(units, owners)):
            if owner != rank:
                continue
            progress.log(name(unit) + (f" (rank {rank})" if size > 1 else ""))
            if size == 1:
                results[i] = do(unit, inner)
                continue
            try:
                results[i] = do(unit, inner)
            except Exception as exc:  # told to every rank below, then raised here as it is
                reason = str(exc) if isinstance(exc, DihalError) else f"{type(exc).__name__}: {exc}"
                failure, error = f"{name(unit)} failed on rank {rank}: {reason}", exc
                break
    if size > 1:
        words: list = [None] * size
        dist.all_gather_object(words, (failure, results))
        if error is not None and not isinstance(error, DihalError):
            raise error  # a bug: its traceback on its own rank, the line naming it on the others
        first = next((f for f, _ in words if f), None)
        if first is not None:
            raise DihalError(first)
        results = {i: r for _, got in words for i, r in got.items()}
    return [results[i] for i in range(len(units))]


def group() -> Group | None:
    """The process group of data-parallel work for ArtifactStore.run_stage; None for one process
    (outside torchrun, or inside local())."""
    rank, size = distributed()
    return Group(rank, size) if size > 1 else None
