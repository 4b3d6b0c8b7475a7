"""The ablations of METHOD §5 as markdown tables, for every comparison in a store run at 1x:
the headline of CoDAR and DiHAL (l*) per --condition-noise, and (METHOD §5.1) the headline of DiHAL (l*)'s
guided and causal readouts per --guidance (gamma), beside independent.

    python scripts/ablation.py runs/compare-smollm2 [out.md]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dihal.artifacts.store import ArtifactStore


def cell(r: dict) -> str:
    v, lo, hi = r["headline_evaluator"], r["headline_evaluator_lo"], r["headline_evaluator_hi"]
    return "not reached" if v != v else f"{v:.4g} [{lo:.4g}, {hi:.4g}]"


def rows(root: str) -> list[str]:
    out = []
    for art in ArtifactStore(root).all("compare"):
        if art.status != "complete" or not art.file("compare.json").exists():
            continue
        result, cfg = json.loads(art.file("compare.json").read_text()), art.config
        if "verdicts" not in result or 1 not in result["budgets"] or len(cfg.get("readouts", ["independent"])) > 1:
            continue  # (a comparison of several readouts belongs to the gamma ablation)
        noise = f"{cfg.get('condition_from', 'sigma')}:{cfg['condition_noise']:g}"
        seeds = ",".join(str(s) for s in cfg["seeds"])
        for r in result["summary"]:
            if r["budget"] == 1 and (r["row"] == "CoDAR" or r["row"] == result["ours"]):
                value = cell(r)
                out.append(
                    f"| {noise} | {seeds} | {r['row']} | {value} | {r['entropy_at_top_t']:.3f} | "
                    f"{r['diversity_at_top_t']:.3f} | {r['status']} | {art.id} |"
                )
    return sorted(set(out))


def gamma_rows(root: str) -> list[str]:
    """DiHAL (l*)'s readouts per gamma: comparisons of seed 0 at 1x that ran more than one readout."""
    out = []
    for art in ArtifactStore(root).all("compare"):
        if art.status != "complete" or not art.file("compare.json").exists():
            continue
        result, cfg = json.loads(art.file("compare.json").read_text()), art.config
        if len(cfg.get("readouts", ["independent"])) < 2 or 1 not in result["budgets"]:
            continue
        for r in result["summary"]:
            if r["budget"] == 1 and r["row"].startswith(result["ours"]):
                gain = r.get("prior_gain")
                out.append(
                    f"| {cfg['guidance']:g} | {r['row']} | {cell(r)} | {r['entropy_at_top_t']:.3f} | "
                    f"{'-' if gain is None or gain != gain else f'{gain:.2f}'} | "
                    f"{r.get('plan_agreement', float('nan')):.2f} | {r.get('ms_per_sample', float('nan')):.0f} | "
                    f"{r['status']} | {art.id} |"
                )
    return sorted(set(out))


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/ablation.py ROOT [out.md]")
    head = [
        "| condition | seeds | row | Gen.PPL at held-out H [95%] | H, top t | diversity | status | compare |",
        "|---|---|---|---|---|---|---|---|",
    ]
    gamma = [
        "",
        "| gamma | row | Gen.PPL at held-out H [95%] | H, top t | prior gain | plan | ms/sample | status | compare |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    text = "\n".join(head + rows(sys.argv[1]) + gamma + gamma_rows(sys.argv[1])) + "\n"
    print(text)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(text)


if __name__ == "__main__":
    main()
