"""Keep freed memory inside the process while a stage churns through large temporaries.

glibc hands big blocks back to the kernel when they are freed (mmap above a threshold, heap
trimming), so a loop that allocates and frees the same 16-130 MB tensors on every iteration
pays for freshly zeroed pages each time: before this, `dihal score` over 31 layers of
smollm2-135m spent 18 of its 39 s in the kernel (benchmarks/bench_score.py). mallopt keeps
up to `limit_bytes` of freed memory for reuse; on other C libraries it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8


def keep_freed_memory(limit_bytes: int = 1 << 30) -> bool:
    """True when glibc accepted the settings (process-wide, for the rest of the process)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    return all(
        (mallopt(M_MMAP_THRESHOLD, limit_bytes), mallopt(M_TRIM_THRESHOLD, limit_bytes), mallopt(M_ARENA_MAX, 1))
    )  # worker threads share one arena, so one pool of kept memory
