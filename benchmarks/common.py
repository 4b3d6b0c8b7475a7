"""Helpers shared by the benchmark scripts: a store under benchmarks/.runs and result files."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def store():
    from dihal.artifacts.store import ArtifactStore

    return ArtifactStore(HERE / ".runs")


def save(name: str, result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    result = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M"),
        **result,
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def peak_rss_mib() -> float:
    """This process's peak resident memory. /proc's VmHWM starts afresh at exec, unlike
    getrusage's ru_maxrss, which a child inherits from the parent that forked it (so a small
    child of a big benchmark would report the parent's peak)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
