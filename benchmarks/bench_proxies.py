"""What dihal's own proxies (r2_token, r2_context) add to `dihal score`, in one run.

All layers of smollm2-135m (an extract of 256 sequences x 64 tokens, with its pool), n = 4096
positions, the paper's proxies and the spectrum statistics. Each configuration is timed REPEATS
times, alternating, on the same extract; the median ratio is the figure (issue 22 allows +50%).

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
    times: dict[str, list[float]] = {"without r2": [], "with r2": []}
    for _ in range(REPEATS):
        for name, proxies in (("without r2", without), ("with r2", every)):
            registry.PROXIES.clear()
            registry.PROXIES.update(proxies)
            start = time.perf_counter()
            table, _, _, _ = sc.score_layers(group, cfg, layers, NullProgress())
            times[name].append(time.perf_counter() - start)
    registry.PROXIES.clear()
    registry.PROXIES.update(every)
    base, added = statistics.median(times["without r2"]), statistics.median(times["with r2"])
    save(
        "proxies",
        {
            "extract": art.id,
            "layers": len(layers),
            "tokens": cfg.tokens,
            "seconds": {k: [round(t, 2) for t in v] for k, v in times.items()},
            "median_ratio_with_to_without": round(added / base, 3),
            "r2": table.set_index("layer")[["r2_token", "r2_context"]].round(4).to_dict(),
        },
    )


if __name__ == "__main__":
    main()
