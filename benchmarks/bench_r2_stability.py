"""Does r2_token hold at every sample size? (issue 37)

For a builtin's extract (800 pydoc sequences of 32 tokens, every layer: the sweeps' extract), r2_token
of every candidate layer at `dihal score --tokens` 1024, 2048, 4096 and 8192, 5 draws each (--seed
0..4), three ways:

    gcv at --tokens      the rule before: GCV, fitted at the geometry's --tokens positions
    kfold at --tokens    the new penalty rule alone, at the same positions: what the penalty fixes, and the
                         learning curve it cannot (fewer rows fit a worse map whatever the penalty)
    kfold (default)      the score now: 5-fold CV at max(--tokens, 8192) positions of its own

and against each way's own mean at 8192: the largest gap at --tokens >= 2048 (the goal: 0.05) and the
smallest value at layer 1 (the goal: >= 0). Written to benchmarks/results/r2_stability_<model>.json and
printed as a table.

    python benchmarks/bench_r2_stability.py smollm2-135m     [--root DIR: an extract already there]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save, store  # noqa: E402
from dihal.artifacts import hidden_states as hs  # noqa: E402
from dihal.artifacts.store import ArtifactStore  # noqa: E402
from dihal.stages import extract as ex  # noqa: E402
from dihal.stages import score as sc  # noqa: E402
from dihal.stages.configs import DataConfig, ExtractConfig  # noqa: E402

SIZES, DRAWS = (1024, 2048, 4096, 8192), range(5)
WAYS = ("gcv at --tokens", "kfold at --tokens", "kfold (default)")


def r2_tokens(group, layers, seqs, pos, seed: int, rule: str) -> dict[int, float]:
    """r2_token of every layer at these positions (the score's own fit, r2_token's width only)."""
    (emb,) = sc.Embeddings.for_draws(group, [(seqs, pos)], seed, rule=rule)
    return {
        layer: emb.fit(torch.from_numpy(hs.read_positions(group, layer, seqs, pos)).double(), 1)["r2"]
        for layer in layers
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--root", default=None, help="a store holding the model's 800 x 32 extract")
    a = p.parse_args()
    cfg = ExtractConfig(model=a.model, data=DataConfig(max_sequences=800, seq_len=32))
    st = ArtifactStore(a.root) if a.root else store()
    art = ex.run(cfg, st)
    group = hs.open_group(art.path / "hidden.zarr")
    layers = list(range(1, int(group.attrs["num_blocks"])))
    pool_seq, pool_pos, _ = hs.read_pool(group, layers[0])
    rows = []
    for seed in DRAWS:
        ridge = np.sort(sc.ridge_rng(seed, 0).choice(pool_seq.size, min(sc.Embeddings.ROWS, pool_seq.size), False))
        default = r2_tokens(group, layers, pool_seq[ridge], pool_pos[ridge], seed, "kfold")
        for tokens in SIZES:
            pick = np.sort(sc.draw_rng(seed, 0).choice(pool_seq.size, size=tokens, replace=False))
            at = (pool_seq[pick], pool_pos[pick])
            values = {
                "gcv at --tokens": r2_tokens(group, layers, *at, seed, "gcv"),
                "kfold at --tokens": r2_tokens(group, layers, *at, seed, "kfold"),
                "kfold (default)": default,  # its positions do not depend on --tokens up to 8192
            }
            rows += [
                {"way": w, "tokens": tokens, "seed": seed, "layer": layer, "r2_token": v[layer]}
                for w, v in values.items()
                for layer in layers
            ]
            print(f"seed {seed}, --tokens {tokens}: layer 1 " + ", ".join(f"{w} {v[1]:.3f}" for w, v in values.items()))
    frame = pd.DataFrame(rows)
    at_8192 = frame[frame.tokens == 8192].groupby(["way", "layer"])["r2_token"].mean()
    frame["gap"] = (frame["r2_token"] - at_8192.loc[list(zip(frame.way, frame.layer))].to_numpy()).abs()
    summary = []
    for way in WAYS:
        one = frame[frame.way == way]
        for tokens in SIZES:
            t = one[one.tokens == tokens]
            summary.append(
                {
                    "way": way,
                    "tokens": tokens,
                    "layer1_min": round(t[t.layer == 1]["r2_token"].min(), 3),
                    "layer1_mean": round(t[t.layer == 1]["r2_token"].mean(), 3),
                    "max_gap_to_8192": round(t["gap"].max(), 3),
                    "layers_off_by_more_than_0.05": int((t.groupby("layer")["gap"].max() > 0.05).sum()),
                }
            )
    table = pd.DataFrame(summary)
    print(table.to_string(index=False))
    held = table[(table.tokens >= 2048)].groupby("way")["max_gap_to_8192"].max()
    save(
        f"r2_stability_{a.model}",
        {
            "extract": f"{art.id}: 800 pydoc sequences x 32 tokens, {len(layers)} layers, pool {pool_seq.size}",
            "goal": "every layer within 0.05 of its mean at --tokens 8192 whenever --tokens >= 2048; layer 1 >= 0",
            "goal_met": {w: bool(held[w] <= 0.05 and table[table.way == w]["layer1_min"].min() >= 0) for w in WAYS},
            "table": summary,
            "per_layer_mean_at_8192": {w: at_8192.loc[w].round(4).to_dict() for w in WAYS},
        },
    )


if __name__ == "__main__":
    main()
