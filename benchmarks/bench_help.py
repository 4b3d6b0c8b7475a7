"""How long `dihal --help` and `dihal CMD --help` take, against a bare `python -c pass`, in one run.

Each command runs REPEATS times in a fresh interpreter, alternating, and the median wall time is
kept; the ratio to `python -c pass` is what to compare across machines (they differ up to 2x).
`--before PATH` also times a checkout of the old layout (`python -m dihal_cli`, PYTHONPATH=PATH),
for a before/after figure. Results: benchmarks/results/help.json.

    python benchmarks/bench_help.py [--repeats 7] [--before /path/to/old/checkout]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save  # noqa: E402


def wall(argv: list[str], env: dict | None = None) -> float:
    cwd = (env or {}).get("PYTHONPATH")  # the old checkout runs from its own root, not this one's
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env={**os.environ, **(env or {})}, cwd=cwd)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before", help="A checkout of the old layout, timed as `python -m dihal_cli`.")
    args = parser.parse_args()
    py = sys.executable
    cases = {
        "python -c pass": ([py, "-c", "pass"], None),
        "dihal --help": ([py, "-m", "dihal.cli", "--help"], None),
        "dihal extract --help": ([py, "-m", "dihal.cli", "extract", "--help"], None),
        "dihal compare --help": ([py, "-m", "dihal.cli", "compare", "--help"], None),
    }
    if args.before:
        cases["before: dihal --help"] = ([py, "-m", "dihal_cli", "--help"], {"PYTHONPATH": args.before})
        cases["before: dihal extract --help"] = (
            [py, "-m", "dihal_cli", "extract", "--help"],
            {"PYTHONPATH": args.before},
        )
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # alternating, so that a busy moment hits every case alike
        for name, (argv, env) in cases.items():
            times[name].append(wall(argv, env))
    base = statistics.median(times["python -c pass"])
    result = {
        name: {"median_s": round(statistics.median(t), 3), "ratio_to_python": round(statistics.median(t) / base, 1)}
        for name, t in times.items()
    }
    save("help", {"repeats": args.repeats, "cases": result})


if __name__ == "__main__":
    main()
