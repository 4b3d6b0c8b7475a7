"""The process group, in one place: joining it from torchrun's environment, ranks and barriers.

Outside torchrun (WORLD_SIZE unset or 1) nothing here starts a group: rank 0 of a world of 1.
Inside `local()` every rank works on its own (a sweep shards layers over ranks, not batches).
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist

_LOCAL = {"depth": 0}


def join(device: str) -> str:
    """Under torchrun, join the process group (NCCL on CUDA, Gloo on CPU) and give each rank its own
    GPU; returns the rank's device. A no-op otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


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
