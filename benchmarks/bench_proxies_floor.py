"""Whether issue 49's target, the score at most 1.25x what it costs without the ridge proxies, can be met
under the same k-fold rule: the time of the rule's least work against the budget the target leaves it.

bench_proxies.py measures the score without the ridge proxies (`without`) and with them. The target
leaves the ridge proxies 0.25 x `without`. This script times, in one run and each in a fresh process,
alternating REPEATS times:

    without  the score of every candidate layer of smollm2-135m without the ridge proxies (as
             bench_proxies.py's `without`, on its extract)
    floor    the least work any implementation of the rule does, at the rule's shapes for that extract
             (ROWS = 8192 positions, 6,554 held-in, 5 folds; features of width 1 and 4 windows of
             D = 576, p = 577 and 2,305; 29 layers), on random matrices of those shapes:
               eigh     the 12 eigendecompositions one draw needs (each width: the held-in rows' Gram and
                        its 5 folds', one eigenbasis per fit, as the issue prescribes), float64 as the
                        score computes them, and float32 (`eigh32`) as the cheapest that could be tried
               cross    one F'Y per layer and width (float32): reading the targets against the features
                        at all, which every fit of the layer needs
               rotate   per layer, width and fold, V'(F_A'Y_A) (float32): the fold's targets in its own
                        eigenbasis, the least the penalty grid needs there
             The grid's error terms, the folds' held-out products and the held-out prediction come on top
             and are not counted: the floor is below any implementation's cost.

The target is out of reach under the rule when the floor (with eigh32) exceeds 0.25 x without; the
result also gives eigh32 + cross alone, the floor of a rule that needed no per-fold rotation.

    python benchmarks/bench_proxies_floor.py     # writes benchmarks/results/proxies_floor.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save  # noqa: E402

REPEATS = 3
LAYERS, ROWS, D, FOLDS, HELD_OUT, WINDOW = 29, 8192, 576, 5, 0.2, 4


def floor() -> dict[str, float]:
    import numpy as np
    import torch

    n = ROWS - round(HELD_OUT * ROWS)
    fold = np.random.default_rng(0).permutation(n) % FOLDS
    generator = torch.Generator().manual_seed(0)
    seconds = {"eigh": 0.0, "eigh32": 0.0, "cross": 0.0, "rotate": 0.0}
    features, bases = {}, {}
    for width in (1, WINDOW):
        f = torch.randn(n, width * D + 1, dtype=torch.float64, generator=generator)
        gram = f.T @ f
        grams = [gram] + [gram - f[fold == k].T @ f[fold == k] for k in range(FOLDS)]
        for key, dtype in (("eigh", torch.float64), ("eigh32", torch.float32)):
            cast = [g.to(dtype) for g in grams]
            start = time.perf_counter()
            for g in cast:
                torch.linalg.eigh(g)
            seconds[key] += time.perf_counter() - start
        features[width] = f.float()
        bases[width] = torch.linalg.qr(torch.randn(f.shape[1], f.shape[1], generator=generator))[0]
    targets = torch.randn(n, D, generator=generator)
    for _ in range(LAYERS):
        for width, f in features.items():
            start = time.perf_counter()
            cross = f.T @ targets
            middle = time.perf_counter()
            for _ in range(FOLDS):
                bases[width].T @ cross
            seconds["cross"] += middle - start
            seconds["rotate"] += time.perf_counter() - middle
    return seconds


def run(way: str, extract: str) -> dict:
    if way == "floor":
        args = [sys.executable, __file__, "--floor"]
    else:
        bench = str(Path(__file__).with_name("bench_proxies.py"))
        args = [sys.executable, bench, "--worker", "without", extract, "/dev/null"]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from benchmarks.bench_proxies import smollm2_extract

    extract = str(smollm2_extract())
    times = {"without": [], "floor": []}
    for _ in range(REPEATS):
        times["without"].append(run("without", extract)["seconds"])
        times["floor"].append(run("floor", extract))
        print(times["without"][-1], times["floor"][-1], flush=True)
    without = statistics.median(times["without"])
    part = {key: statistics.median(t[key] for t in times["floor"]) for key in ("eigh", "eigh32", "cross", "rotate")}
    budget = 0.25 * without
    least = part["eigh32"] + part["cross"] + part["rotate"]
    save(
        "proxies_floor",
        {
            "shapes": {"layers": LAYERS, "rows": ROWS, "width": D, "folds": FOLDS, "features": [D + 1, WINDOW * D + 1]},
            "seconds": {"without": [round(t, 1) for t in times["without"]], "floor": times["floor"]},
            "median_seconds": {"without": round(without, 2), **{k: round(v, 2) for k, v in part.items()}},
            "budget_seconds": round(budget, 2),
            "floor_seconds": {
                "float64 eigh": round(least - part["eigh32"] + part["eigh"], 2),
                "float32 eigh": round(least, 2),
                "float32 eigh, no rotation": round(part["eigh32"] + part["cross"], 2),
            },
            "floor_over_budget": round(least / budget, 2),
            "least_ratio_to_without": round((without + least) / without, 3),
        },
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--floor"]:
        print(json.dumps(floor()))
    else:
        main()
