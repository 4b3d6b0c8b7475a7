"""The summary table of a reproduction run, and the paper's claims checked on one or more runs.

usage: python3 scripts/summarize.py RUN_ROOT OUT.md            one run: l*, rho, fidelity, generation
       python3 scripts/summarize.py --claims OUT.md ROOT...     each claim, the paper's number, ours
                                                                 per backbone (one ROOT each), verdict
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import ArtifactStore
from dihal.stages.compare_stats import LM_WRITTEN
from dihal.stages.registry import ROWS
from dihal.stages.runtime import bootstrap

CLAIM_3_ROWS = {row.key for row in ROWS if row.baseline or row.ours}  # a comparison without one judges nothing


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


def fidelity_row(r: dict) -> str:
    return f"top-1 {r['top1_agreement']:.3f}, KL {r['kl']:.3f}, ppl {r['ppl_hybrid']:.1f} vs {r['ppl_original']:.1f}"


def text_name(source: str) -> str:
    """What a fidelity evaluation was measured on, in words."""
    if source == "extract validation split":
        return "held-out text (validation split)"
    if source.startswith("dataset "):
        return f"other text: {source[len('dataset ') :]}"
    return f"the backbone's own samples ({source})"


def rows_for(store: ArtifactStore) -> list[tuple[str, str]]:
    rows = []
    score = latest(store, "score")
    if score:
        m = score.manifest["metrics"]
        rows.append(("l* by S, the paper's (argmax S)", str(m.get("l_star_S", m["l_star"]))))
        if "l_star_r2_token" in m:  # dihal's proxy, which ranks layers better than depth (docs/results/locate.md)
            rows.append(("l* by r2_token (argmax)", str(m["l_star_r2_token"])))
        if m.get("select", "S") != "S":
            rows.append(("the bridge's layer (--select)", f"{m['l_star']} ({m['select']})"))
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
        rows.append((f"bridge layer {bridge.config['layer']} ({m['steps']} steps) val loss", f"{m['val_loss']:.4f}"))
        evaluations = [
            a
            for a in store.all("evaluate")
            if a.complete and a.config.get("kind") == "fidelity" and a.manifest["parents"].get("bridge") == bridge.id
        ]
        for art in evaluations:  # one row per text the bridge was measured on, at 8 Euler steps (or the most)
            m = art.manifest["metrics"]
            r = next((r for r in m["fidelity"] if r["steps"] == 8), m["fidelity"][-1])
            rows.append((f"fidelity on {text_name(m.get('source', ''))}, {r['steps']} steps", fidelity_row(r)))
    samples = latest(store, "evaluate", "samples")
    if samples:
        got = samples.manifest["metrics"]["rows"]
        for r in got:
            shown = f"{r['gen_ppl_token']:.1f}, {r['diversity']:.3f}, {r['token_entropy']:.3f}"
            rows.append((f"{r['model']}: Gen.PPL, diversity, entropy", shown))
        by_model = {r["model"]: r for r in got}
        if {"hybrid", "original"} <= set(by_model):
            kept = samples.file("per_sample.csv")  # absent from evaluations made before it was written
            per_sample = pd.read_csv(kept) if kept.exists() else None
            rows.append(
                ("hybrid / original Gen.PPL at matched entropy", matched_ratio(**by_model, per_sample=per_sample))
            )
    return rows


MATCHED = 0.02  # entropies within 2% of the original's are matched (issue 66, after arXiv 2604.02718)


def matched_ratio(hybrid: dict, original: dict, per_sample: pd.DataFrame | None = None) -> str:
    """The hybrid's Gen.PPL over the original's where their samples' token entropies (same decoding, same
    temperature) agree within MATCHED of the original's; otherwise a ratio would compare a hotter text with a
    colder one, and the row says so and where the reading at matched entropy is made. With the evaluation's
    per-sample rows, a 90% bootstrap interval over samples (a few dozen samples can be off by 2-3x:
    docs/results/hybrid_generation.md)."""
    gap = abs(hybrid["token_entropy"] - original["token_entropy"]) / original["token_entropy"]
    if gap > MATCHED:
        return (
            f"not matched: entropies {gap:.1%} apart (over {MATCHED:.0%}); scripts/hybrid_study.py reads the "
            "curves at one entropy"
        )
    band = "" if per_sample is None else "; 90% over samples {:.2f}-{:.2f}x".format(*ratio_interval(per_sample))
    return f"{hybrid['gen_ppl_token'] / original['gen_ppl_token']:.2f}x (entropies {gap:.1%} apart{band})"


def ratio_interval(per_sample: pd.DataFrame, resamples: int = 1000) -> tuple[float, float]:
    """90% percentile interval of the hybrid's Gen.PPL per token over the original's, resampling sample indices
    with replacement, the same indices for both models (sample i of each is drawn from the same seed stream),
    samples with no scored token left out as evaluate's Gen.PPL leaves them."""
    both = per_sample.pivot(index="index", columns="model", values=["nll", "n_scored"]).dropna()  # paired only
    n = both["n_scored"][["hybrid", "original"]].to_numpy()
    nll = np.where(n > 0, both["nll"][["hybrid", "original"]].to_numpy(), 0.0)
    idx = np.random.default_rng(0).integers(0, len(n), (resamples, len(n)))
    log_ppl = nll[idx].sum(1) / n[idx].sum(1)  # (resamples, 2): hybrid, original
    point = np.exp(nll[:, 0].sum() / n[:, 0].sum() - nll[:, 1].sum() / n[:, 1].sum())
    ci = bootstrap.interval(float(point), np.exp(log_ppl[:, 0] - log_ppl[:, 1]), 0.90)  # contains its point
    return ci["lo"], ci["hi"]


def plots_for(store: ArtifactStore) -> list[str]:
    arts = ((latest(store, "score"), "scores.png"), (main_bridge(store), "loss_curve.png"))
    arts += ((latest(store, "sweep"), "sweep.png"),)
    return [str(a.file(name)) for a, name in arts if a is not None and a.file(name).exists()]


def main(root: str, out: str) -> None:
    rows = rows_for(ArtifactStore(root))
    if not rows:
        raise DihalError(f"no complete artifacts under {root}")
    table = Table(title=f"DiHAL summary ({root})")
    table.add_column("quantity", overflow="fold")
    table.add_column("value", overflow="fold")
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
    plots = plots_for(ArtifactStore(root))
    for path in plots:
        print(f"plot: {path}")
    with open(out, "w") as fh:
        fh.write(f"# DiHAL summary: {root}\n\n| quantity | value |\n|---|---|\n")
        fh.writelines(f"| {k} | {v} |\n" for k, v in rows)
        fh.writelines(f"\nplot: `{path}`\n" for path in plots)
    print(f"written: {out}")


# -- the claims table (METHOD §4) ------------------------------------------------
PAPER = {
    1: "rho 0.91 (Llama-3.1-8B), 0.93 (Qwen3-8B)",
    2: "l* = 3 (Llama), 2 (Qwen3); competitive with the oracle",
    3: "Gen.PPL 136.02 vs CoDAR 144.83; diversity 0.5913 vs 0.4777 (Qwen3-8B)",
    4: "fully trained l* competitive with the oracle, ahead of the worst layer",
}
CLAIMS = {
    1: "S predicts bridgeability",
    2: "l* is shallow and near the oracle",
    3: "hidden-state recovery beats continuous diffusion",
    4: "fully trained, l* stays competitive",
}


def claim_rho(store: ArtifactStore) -> tuple[str, str]:
    sweep = latest(store, "sweep")
    if not sweep:
        return "not run", "-"
    variants = {v["variant"]: v for v in json.loads(sweep.file("summary.json").read_text())["variants"]}
    s, depth = variants["S"], variants["-depth (baseline)"]
    ours = (
        f"rho {s['rho']:.2f} [{s['rho_lo']:.2f}, {s['rho_hi']:.2f}]; shallow {s['rho_shallow']:.2f}; "
        f"given depth {s['partial_rho_given_depth']:.2f}; depth alone {depth['rho']:.2f}"
    )
    if not s["rho_lo"] > 0:  # NaN (nothing resampled) counts as not shown
        return ours, "not shown (interval reaches 0 or was not computed)"
    if s["partial_rho_given_depth"] > 0 and s["rho"] >= depth["rho"]:
        return ours, "holds"
    return ours, "partly: rho > 0, but no better than depth"


def claim_layer(store: ArtifactStore) -> tuple[str, str]:
    sweep = latest(store, "sweep")
    if not sweep:
        return "not run", "-"
    m = sweep.manifest["metrics"]
    lo, hi = m["shallow_window"]
    ours = (
        f"l* = {m['l_star']}, oracle = {m['oracle_layer']} (seeds agree {m['oracle_agreement']:.0%}), "
        f"loss rank of l* {m['l_star_loss_rank']} of {len(m['layers'])}"
    )
    shallow = lo <= m["l_star"] <= hi
    near = m["l_star_loss_rank"] is not None and m["l_star_loss_rank"] <= 3
    return ours, "holds" if shallow and near else ("partly" if shallow or near else "does not hold")


def newest_comparisons(store: ArtifactStore) -> dict:
    """{budget: (compare.json, its verdict)} of the newest complete comparison of each budget that has DiHAL (l*)
    and every baseline (a script may run its budgets as separate comparisons, the larger one without the
    diagnostic rows); comparisons that leave a baseline out (an ablation) do not count."""
    newest = {}
    for art in sorted(store.all("compare"), key=lambda a: a.manifest.get("finished", "")):
        rows = set(art.config.get("rows") or CLAIM_3_ROWS)
        if art.status != "complete" or not CLAIM_3_ROWS <= rows or not art.file("compare.json").exists():
            continue
        result = json.loads(art.file("compare.json").read_text())
        for v in result.get("verdicts", []):
            newest[v["budget"]] = (result, v)
    return dict(sorted(newest.items()))


def claim_compare(store: ArtifactStore) -> tuple[str, str]:
    """Claim 3 at a glance, per budget as `dihal compare` judged it (METHOD §5): DiHAL's Gen.PPL
    under the primary evaluator at the held-out entropy, and the budget's verdict. The baselines' outcomes,
    the LM-written rows and the verdict per cost class are claim_compare_details'."""
    newest = newest_comparisons(store)
    if not newest:  # (a comparison made before METHOD §5, method revision 2 has no verdicts: rerun it)
        return "not run", "-"
    ours = []
    for budget, (result, _) in newest.items():
        value = next(r for r in result["summary"] if r["budget"] == budget and r["row"] == result["ours"])
        shown = "not reached" if value["headline_evaluator"] != value["headline_evaluator"] else None
        shown = shown or f"{value['headline_evaluator']:.4g}"
        seeds = ",".join(map(str, result["seeds"]))
        ours.append(f"{budget}x (seeds {seeds}): DiHAL Gen.PPL {shown} at H {result['held_out_entropy']:.2f}")
    return " / ".join(ours), "; ".join(f"{budget}x: {v['claim_3']}" for budget, (_, v) in newest.items())


def claim_compare_details(store: ArtifactStore) -> list[str]:
    """Claim 3 in full, one line per budget: each baseline's outcome, the LM-written rows (prior gain below
    LM_WRITTEN: their win or loss decides nothing) and each DiHAL readout's verdict within its cost class."""
    lines = []
    for budget, (result, v) in newest_comparisons(store).items():
        outcomes = ", ".join(f"{b['baseline']}: {b['outcome']}" for b in v["baselines"])
        lm, classes = lm_written(result, budget), by_class(result, budget)
        lines.append(
            f"- {budget}x: {v['claim_3']}. {outcomes or 'no baseline judged'}"
            + (f"; LM-written (prior gain < {LM_WRITTEN:g}, decides nothing): {lm}" if lm else "")
            + (f"; by cost class: {classes}" if classes else "")
        )
    return lines


def lm_written(result: dict, budget: int) -> str:
    """The rows of one budget whose prior gain is below LM_WRITTEN (METHOD §5.1), with their gains."""
    rows = [r for r in result["summary"] if r["budget"] == budget and r.get("lm_written") is True]
    return ", ".join(f"{r['row']} (gain {r['prior_gain']:.2f})" for r in rows)


def by_class(result: dict, budget: int) -> str:
    """Like with like (METHOD §5.1): each DiHAL readout's verdict against the baselines of its cost class."""
    lines = [v for v in result.get("verdicts_by_class", []) if v["budget"] == budget]
    return ", ".join(f"{v['class']} {v['dihal'].partition(', ')[2] or 'independent'}: {v['claim_3']}" for v in lines)


def claim_confirm(store: ArtifactStore) -> tuple[str, str]:
    confirm = latest(store, "confirm")
    if not confirm:
        return "not run", "-"
    rows = json.loads(confirm.file("confirm.json").read_text())["rows"]
    by = {r["label"]: r for r in rows}
    ours = "; ".join(
        f"{r['label']} (L{r['layer']}) ppl ratio {r['ppl_ratio_mean']:.3f}±{r['ppl_ratio_std']:.2g}" for r in rows
    )
    star = next(r for label, r in by.items() if "l_star" in label)
    worst = next((r for label, r in by.items() if "worst" in label), None)
    oracle = next((r for label, r in by.items() if "oracle" in label), None)
    ahead = worst is None or star["ppl_ratio_mean"] < worst["ppl_ratio_mean"]
    near = oracle is None or star["ppl_ratio_mean"] <= oracle["ppl_ratio_mean"] + 2 * (oracle["ppl_ratio_std"] or 0)
    return ours, "holds" if ahead and near else ("partly" if ahead or near else "does not hold")


def backbone(store: ArtifactStore) -> str:
    """The model a root's runs were made from (its newest extract's --model)."""
    extract = latest(store, "extract")
    return extract.config["model"] if extract else "no extract"


def claims(out: str, roots: list[str]) -> None:
    checks = {1: claim_rho, 2: claim_layer, 3: claim_compare, 4: claim_confirm}
    stores = {root: ArtifactStore(root) for root in roots}
    heads = [f"ours: {backbone(store)} ({root})" for root, store in stores.items()]
    table = Table(title="the paper's claims, checked")
    for column in ("claim", "paper", *heads):
        table.add_column(column)
    lines = ["| claim | paper | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(roots)]
    ran = 0
    for number, check in checks.items():
        results = [check(store) for store in stores.values()]
        if all(ours == "not run" for ours, _ in results):
            continue  # only the claims that were run
        ran += 1
        cells = [f"{ours} -> **{verdict}**" for ours, verdict in results]
        table.add_row(f"{number}. {CLAIMS[number]}", PAPER[number], *cells)
        lines.append(f"| {number}. {CLAIMS[number]} | {PAPER[number]} | " + " | ".join(cells) + " |")
    if not ran:
        print("no claim was run here (claims 1, 2: dihal sweep; 3: dihal compare; 4: dihal confirm)")
        return
    detail = []
    for root, store in stores.items():
        if rows := claim_compare_details(store):
            detail += ["", f"{backbone(store)} ({root}):", "", *rows]
    if detail:  # the cell holds the verdict; the baselines, LM-written rows and cost classes go beside it
        beside = Path(out).with_name(Path(out).stem + "_claim3.md")
        beside.write_text("## Claim 3 in detail\n" + "\n".join(detail) + "\n")
        lines += [
            "",
            f"Claim 3 in detail (each budget's baselines, LM-written rows, cost classes): [{beside.name}]"
            f"({beside.name})",
        ]
        print(f"written: {beside}")
    Console().print(table)
    with open(out, "w") as fh:
        fh.write("# The paper's claims, checked\n\n" + "\n".join(lines) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    if sys.argv[1] == "--claims":
        claims(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1], sys.argv[2])
