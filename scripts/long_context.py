"""The table of scripts/long_context.sh: fidelity by position bin of the learned and the rotary bridge at 8
Euler steps (KL, top-1 agreement, perplexity ratio; each bin's tokens weighted alike), the rule's in-length
KL ratio, and the Gen.PPL of 192-token samples. Writes long_context.md and .json beside the store.

    python scripts/long_context.py runs/long-context-smollm2-135m
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

import dihal

BINS = ((1, 63), (64, 127), (128, 255))
RULE = 1.02  # METHOD §2: rotary is the default if its in-length KL <= 1.02 x learned's


def binned(per: pd.DataFrame, lo: int, hi: int) -> dict:
    rows = per[(per["position"] >= lo) & (per["position"] <= hi)]
    scored = rows.dropna(subset=["nll_hybrid"])
    w, ws = rows["n"], scored["n"]
    ratio = np.exp(((scored["nll_hybrid"] - scored["nll_original"]) * ws).sum() / ws.sum())
    return {
        "positions": f"{lo}-{hi}",
        "kl": float((rows["kl"] * w).sum() / w.sum()),
        "top1": float((rows["top1_agreement"] * w).sum() / w.sum()),
        "ppl_ratio": float(ratio),
        "tokens": int(w.sum()),
    }


def main(root: str) -> None:
    store = dihal.open_store(root)
    runs = store.runs()
    bridges = {store.load(i).config.get("positions", "learned"): i for i in runs[runs.stage == "bridge"]["id"]}
    table, gen = [], {}
    for art_id in runs[runs.stage == "evaluate"]["id"]:
        art = store.load(art_id)
        if art.config["kind"] == "samples":
            keep = ("gen_ppl_token", "diversity", "mean_tokens", "n_samples")
            gen = {r["model"]: {k: r[k] for k in keep} for r in art.manifest["metrics"]["rows"]}
            continue
        scheme = next(k for k, v in bridges.items() if v == art.manifest["parents"]["bridge"])
        per = pd.read_csv(art.file("fidelity_by_position.csv"))
        per = per[per["steps"] == 8]
        length = int(per["position"].max()) + 1
        for lo, hi in BINS:
            if lo < length:
                table.append({"bridge": scheme, "sequences": length, **binned(per, lo, min(hi, length - 1))})
    frame = pd.DataFrame(table)
    inside = frame[(frame["positions"] == "1-63") & (frame["sequences"] == 64)].set_index("bridge")["kl"]
    rule = float(inside["rotary"] / inside["learned"])
    lines = ["| bridge | sequences | positions | KL | top-1 | ppl ratio | tokens |", "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(
            f"| {r['bridge']} | {r['sequences']} | {r['positions']} | {r['kl']:.4f} | {r['top1']:.3f} | "
            f"{r['ppl_ratio']:.3f} | {r['tokens']} |"
        )
    lines += ["", f"in-length KL, rotary / learned: {rule:.3f} (the rule: at most {RULE})", ""]
    lines += ["| 192-token samples | Gen.PPL (token-weighted) | diversity | mean new tokens | samples |"]
    lines += ["|---|---|---|---|---|"]
    for model, g in gen.items():
        lines.append(
            f"| {model} | {g['gen_ppl_token']:.1f} | {g['diversity']:.3f} | {g['mean_tokens']:.0f} | {g['n_samples']} |"
        )
    out = Path(root)
    (out / "long_context.md").write_text("\n".join(lines) + "\n")
    (out / "long_context.json").write_text(
        json.dumps({"table": table, "rule_ratio": rule, "generation": gen}, indent=1)
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
