"""Pool independent draws of scripts/hybrid_study.py's curves (issue 66): the matched-entropy reading, and both
models at temperature 1, each with its 90% paired bootstrap interval over all their samples, each draw's samples
numbered after the previous draw's. The draws must share a bridge, sample length and temperature grid (different
seeds: independent samples). One directory reads one draw. With --against, the same for a second bridge's draws
(the same seeds, in the same order), and each hybrid's Gen.PPL against the other's at temperature 1.

    python scripts/hybrid_pool.py docs/results/hybrid_study/gemma3_full_own_long_256 \\
        docs/results/hybrid_study/gemma3_full_own_long_256_seed2
    python scripts/hybrid_pool.py docs/results/hybrid_study/smollm2_more_text_256{,_seed2} \\
        --against docs/results/hybrid_study/smollm2_full_own_long_256{,_seed2}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
from hybrid_study import curves_of, paired_ratio, readings_of


def pooled(dirs: list[Path]) -> dict[tuple[str, float], pd.DataFrame]:
    """(model, temperature) -> the samples of every draw, renumbered; refused where the draws differ."""
    studies = [json.loads((d / "study.json").read_text()) for d in dirs]
    for key in ("bridge", "tokens", "top_p"):
        if len({s[key] for s in studies}) > 1:
            raise SystemExit(f"error: the draws differ in {key}: {[s[key] for s in studies]}; pool one protocol")
    units, offset = {}, 0
    for d in dirs:
        frame = pd.read_csv(d / "curve_samples.csv")
        grid = {(m, t) for m, t in zip(frame.model, frame.temperature)}
        if units and grid != set(units):
            raise SystemExit(f"error: {d} draws another temperature grid; pool draws of one grid")
        for (m, t), g in frame.groupby(["model", "temperature"], sort=False):
            g = g.drop(columns=["model", "temperature"]).assign(sample=g["sample"] + offset)
            units[(m, t)] = pd.concat([units[(m, t)], g], ignore_index=True) if (m, t) in units else g
        offset += int(frame["sample"].max()) + 1
    # bootstrap() pairs the points by row: every point's rows in one sample order
    return {k: u.sort_values("sample", ignore_index=True) for k, u in units.items()}


def between(units: dict, other: dict, who: str, draws_: int, seed: int = 0) -> dict:
    """The hybrid's Gen.PPL at temperature 1 over another bridge's at the same seeds (sample i of both drawn from
    the same stream), with its paired 90% interval."""
    a, b = units[(who, 1.0)], other[(who, 1.0)]
    if len(a) != len(b):
        raise SystemExit(f"error: {len(a)} samples against {len(b)}; compare draws of the same seeds")
    return paired_ratio(a, b, draws_, seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--against", nargs="+", type=Path, default=[], help="another bridge's draws, the same seeds")
    a = p.parse_args()
    units = pooled(a.dirs)
    curves = curves_of(units)
    for c in curves:
        print(f"{c['model']} t={c['temperature']}: entropy {c['entropy']:.3f} Gen.PPL {c['gen_ppl']:.1f}")
    n = len(next(iter(units.values())))
    other = pooled(a.against) if a.against else None
    for who in sorted({m for m, _ in units if m != "original"}):
        readings_of(units, curves, who, a.bootstrap, label=f"{n} samples, ")
        if other is not None and (who, 1.0) in units:
            r = between(units, other, who, a.bootstrap)
            band = "[{:.2f}, {:.2f}] (90%)".format(*r["ratio_90"])
            print(f"{who}: Gen.PPL at temperature 1 against --against's: {r['ratio']:.2f}x {band}")


if __name__ == "__main__":
    main()
