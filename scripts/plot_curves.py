"""Gen.PPL against entropy of the hybrid and the original, one panel per study (scripts/hybrid_study.py's
folders), with the matched reading marked: the figure issue 66 item 3 asks for.

    python scripts/plot_curves.py docs/results/hybrid_study/smollm2_full_own_hot \
        docs/results/hybrid_study/smollm2_full_own_learned \
        docs/results/hybrid_study/gemma3_full_own --labels rotary,learned,rotary \
        --out docs/results/hybrid_study/matched_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("studies", nargs="+", help="hybrid_study.py --out folders (curves.csv, study.json)")
    p.add_argument("--labels", default="", help="a word per study for its title, comma list (e.g. rotary,learned)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    labels = a.labels.split(",") if a.labels else [""] * len(a.studies)
    fig, axes = plt.subplots(1, len(a.studies), figsize=(5.5 * len(a.studies), 4.2), squeeze=False)
    for ax, folder, label in zip(axes[0], map(Path, a.studies), labels, strict=True):
        study = json.loads((folder / "study.json").read_text())
        curves = pd.read_csv(folder / "curves.csv")
        for who, g in curves.groupby("model"):
            g = g.sort_values("entropy")
            ax.plot(g.entropy, g.gen_ppl, "o-", label=who)
            for _, r in g.iterrows():
                ax.annotate(
                    f"{r.temperature:g}", (r.entropy, r.gen_ppl), fontsize=7, xytext=(3, -9), textcoords="offset points"
                )
        for m in study["matched"].values():
            if m.get("ratio") is not None:
                ax.axvline(m["entropy"], color="grey", lw=0.8, ls=":")
                ax.set_title(
                    f"{study['model']} {study['bridge']} {label}: {m['ratio']:.2f}x at entropy {m['entropy']:.3f}",
                    fontsize=9,
                )
        ax.set(xlabel="mean per-sample unigram entropy (nats)", ylabel="Gen.PPL under the original", yscale="log")
        ax.legend(fontsize=8)
    fig.suptitle(
        "hybrid and original, temperatures marked; dotted: the original's entropy at temperature 1", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
