"""The summary table of a reproduction run: l*, rho, fidelity, hybrid vs original generation.

usage: python3 scripts/summarize.py RUN_ROOT OUT.md   (prints the table and writes it as markdown)
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from artifacts.errors import DihalError
from artifacts.store import ArtifactStore


def latest(store: ArtifactStore, stage: str, kind: str | None = None, parent: tuple[str, str] | None = None):
    arts = [
        a
        for a in store.all(stage)
        if a.complete
        and (kind is None or a.config.get("kind") == kind)
        and (parent is None or a.manifest["parents"].get(parent[0]) == parent[1])
    ]
    return arts[-1] if arts else None


def main_bridge(store: ArtifactStore):
    """The bridge the hybrid generated with (the sweep's per-layer bridges are not it)."""
    generate = latest(store, "generate")
    return store.load("bridge", generate.manifest["parents"]["bridge"]) if generate else latest(store, "bridge")


def rows_for(store: ArtifactStore) -> list[tuple[str, str]]:
    rows = []
    score = latest(store, "score")
    if score:
        rows.append(("l* (argmax S)", str(score.manifest["metrics"]["l_star"])))
    sweep = latest(store, "sweep")
    if sweep:
        m = sweep.manifest["metrics"]
        rows += [
            ("Spearman rho(S, -val loss)", f"{m['spearman_rho']:.3f} (p = {m['p_value']:.2g})"),
            ("oracle / worst layer", f"{m['oracle_layer']} / {m['worst_layer']}"),
            (
                "val loss at l* / oracle / worst",
                f"{m['l_star_val_loss']:.4f} / {m['oracle_val_loss']:.4f} / {m['worst_val_loss']:.4f}",
            ),
        ]
    bridge = main_bridge(store)
    if bridge:
        m = bridge.manifest["metrics"]
        rows.append(
            (f"bridge layer {bridge.config['layer']} ({bridge.config['protocol']}) val loss", f"{m['val_loss']:.4f}")
        )
    fidelity = latest(store, "evaluate", "fidelity", ("bridge", bridge.id)) if bridge else None
    if fidelity:
        for r in fidelity.manifest["metrics"]["fidelity"]:
            rows.append(
                (
                    f"fidelity @ {r['steps']} steps: top-1 / KL / rel.err / cos",
                    f"{r['top1_agreement']:.3f} / {r['kl']:.3f} / {r['rel_recon_error']:.3f} / {r['cosine']:.3f}",
                )
            )
            rows.append(
                (
                    f"perplexity @ {r['steps']} steps: hybrid / original",
                    f"{r['ppl_hybrid']:.2f} / {r['ppl_original']:.2f}",
                )
            )
    samples = latest(store, "evaluate", "samples")
    if samples:
        for r in samples.manifest["metrics"]["rows"]:
            rows.append(
                (
                    f"{r['model']}: Gen.PPL token / mean, diversity",
                    f"{r['gen_ppl_token']:.2f} / {r['gen_ppl_mean']:.2f}, {r['diversity']:.4f}",
                )
            )
    return rows


def main(root: str, out: str) -> None:
    rows = rows_for(ArtifactStore(root))
    if not rows:
        raise DihalError(f"no complete artifacts under {root}")
    table = Table(title=f"DiHAL summary ({root})")
    table.add_column("quantity")
    table.add_column("value")
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
    with open(out, "w") as fh:
        fh.write(f"# DiHAL summary: {root}\n\n| quantity | value |\n|---|---|\n")
        fh.writelines(f"| {k} | {v} |\n" for k, v in rows)
    print(f"written: {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
