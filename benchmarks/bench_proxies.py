"""What dihal's own proxies (r2_token, r2_context) add to `dihal score`, in one run.

All layers of smollm2-135m (an extract of 256 sequences x 64 tokens, with its pool), n = 4096
positions, the paper's proxies and the spectrum statistics. Three configurations, each timed REPEATS
times, alternating, on the same extract: without r2_token and r2_context; with them under the rule
before (--r2-penalty gcv, at the geometry's positions); with them under today's (kfold, 5 folds on
max(--tokens, 8192) positions of their own, issue 37). The median ratios are the figures (issue 22
allowed +50% for the proxies).

    python benchmarks/bench_proxies.py      # writes benchmarks/results/proxies.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save, store  # noqa: E402
from dihal.artifacts import hidden_states as hs  # noqa: E402
from dihal.stages import extract as ex  # noqa: E402
from dihal.stages import registry  # noqa: E402
from dihal.stages import score as sc  # noqa: E402
from dihal.stages.configs import DataConfig, ExtractConfig, ScoreConfig  # noqa: E402
from dihal.stages.runtime.progress import NullProgress  # noqa: E402

REPEATS = 3


def main() -> None:
    art = ex.run(ExtractConfig(model="smollm2-135m", data=DataConfig(max_sequences=256)), store())
    group = hs.open_group(art.path / "hidden.zarr")
    layers = list(range(1, int(group.attrs["num_blocks"])))
    cfg = ScoreConfig()
    every = dict(registry.PROXIES)
    without = {k: p for k, p in every.items() if not p.embeddings}
    ways = {
        "without r2": (without, cfg),
        "gcv (before)": (every, ScoreConfig(r2_penalty="gcv")),
        "kfold (after)": (every, cfg),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    tables = {}
    for _ in range(REPEATS):
        for name, (proxies, way) in ways.items():
            registry.PROXIES.clear()
            registry.PROXIES.update(proxies)
            start = time.perf_counter()
            tables[name], *_ = sc.score_layers(group, way, layers, NullProgress())
            times[name].append(time.perf_counter() - start)
    registry.PROXIES.clear()
    registry.PROXIES.update(every)
    median = {name: statistics.median(t) for name, t in times.items()}
    r2 = {
        name: tables[name].set_index("layer")["r2_token"].round(4).to_dict()
        for name in ("gcv (before)", "kfold (after)")
    }
    save(
        "proxies",
        {
            "extract": art.id,
            "layers": len(layers),
            "tokens": cfg.tokens,
            "seconds": {k: [round(t, 2) for t in v] for k, v in times.items()},
            "median_seconds": {k: round(v, 2) for k, v in median.items()},
            "median_ratio_gcv_to_without": round(median["gcv (before)"] / median["without r2"], 3),
            "median_ratio_kfold_to_without": round(median["kfold (after)"] / median["without r2"], 3),
            "median_ratio_kfold_to_gcv": round(median["kfold (after)"] / median["gcv (before)"], 3),
            "r2_token": r2,
        },
    )


if __name__ == "__main__":
    main()
