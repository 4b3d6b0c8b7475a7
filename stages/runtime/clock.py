"""Stopwatch readings that mean what they say on a GPU.

CUDA kernels run asynchronously: a reading taken while work is still queued stops the clock early,
so ms per token and tokens per second would come out too good. `now(device)` waits for the device
first (a no-op on the CPU).
"""

from __future__ import annotations

import time

import torch


def now(device: torch.device | str) -> float:
    """time.perf_counter() once `device` has finished the work queued on it."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()
