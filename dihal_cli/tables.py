"""Every table the CLI prints, in one place: cells at 4 significant digits, never wrapped, so
that they fit 80 columns; the short column names of each table; JSON for --json."""

from __future__ import annotations

import json
import math
import sys

from rich import box
from rich.table import Table

from dihal.stages.registry import SOURCE_LABELS


def table(title: str, columns: list[str], rows: list[list], highlight_row: int | None = None) -> Table:
    """Numbers at 4 significant digits, cells never wrapped, compact enough for 80 columns."""
    out = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), title_justify="left")
    for column in columns:
        out.add_column(column, no_wrap=True, overflow="ellipsis", justify="right")
    for i, row in enumerate(rows):
        out.add_row(*[fmt(v) for v in row], style="bold green" if i == highlight_row else None)
    return out


def fmt(value) -> str:
    """4 significant digits; scientific as 5.359e-3 (no padded exponent) outside [1e-3, 1e5)."""
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        if value != value or value == 0 or value in (float("inf"), float("-inf")):
            return "0" if value == 0 else str(value)
        if 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        mantissa, exponent = f"{value:.3e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return str(value)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def pm(r: dict, key: str) -> str:
    """mean±std of a summary row over seeds (the mean alone for one seed), both to the same
    decimals: about three significant digits of the mean, whole numbers from 100 up."""
    mean, std = r[key + "_mean"], r[key + "_std"]
    if r["seeds"] <= 1 or mean != mean:
        return fmt(mean)
    decimals = 0 if abs(mean) >= 100 or mean == 0 else max(0, 2 - math.floor(math.log10(abs(mean))))
    return f"{mean:.{decimals}f}±{std:.{decimals}f}"


def three(x) -> str:
    return "-" if x != x else f"{x:.3f}"  # NaN: not defined (e.g. depth given depth)


def columns(rows: list[dict], shown: dict[str, str]) -> tuple[list[str], list[list]]:
    """The header and the cells of the columns in `shown` (key -> short name) that the rows have."""
    keys = [k for k in shown if k in rows[0]]
    return [shown[k] for k in keys], [[r[k] for k in keys] for r in rows]


# -- the tables, one per command -------------------------------------------------------------------------
SCORE = {
    "rank": "rank",
    "layer": "layer",
    "S": "S",
    "m_curv": "m_curv",
    "m_mono": "m_mono",
    "k_hat": "k_hat",
    "participation_ratio": "PR",
    "entropy_rank": "erank",
    "mean_token_norm": "|h|",
}
STABILITY = {  # with --bootstrap or --outlier-mads: the stability columns instead, at fixed precision
    "layer": ("layer", "{:.0f}"),
    "S": ("S", "{:.3f}"),
    "S_boot_std": ("S std", "{:.2f}"),
    "l_star_freq": ("l* freq", "{:.0%}"),
    "k_hat": ("k_hat", "{:.2f}"),
    "k_hat_robust": ("k rob", "{:.2f}"),
    "n_outliers": ("out", "{:.0f}"),
    "S_robust": ("S rob", "{:.3f}"),
    "rank_robust": ("rk rob", "{:.0f}"),
}
FIDELITY = {
    "steps": "steps",
    "rel_recon_error": "rel err",
    "cosine": "cos",
    "kl": "KL",
    "top1_agreement": "top-1",
    "ppl_hybrid": "PPL hyb",
    "ppl_original": "PPL orig",
    "ppl_ratio": "ratio",
}
LM_EVAL = {
    "task": "task",
    "metric": "metric",
    "n": "n",
    "hybrid": "hybrid",
    "hybrid_stderr": "± se",
    "original": "original",
    "original_stderr": "± se ",
}
SAMPLES = {
    "model": "model",
    "n_samples": "n",
    "gen_ppl_token": "Gen.PPL",
    "gen_ppl_mean": "per-sample",
    "token_entropy": "entropy",
    "diversity": "diversity",
    "distinct_2": "dist-2",
    "mean_tokens": "tokens",
}
SWEEP = {
    "layer": "layer",
    "S": "S",
    "score_rank": "S rank",
    "val_loss": "val loss",
    "val_loss_std": "± std",
    "top1_agreement": "top-1",
    "kl": "KL",
    "ppl_ratio": "ppl ratio",
}


def score_table(records: list[dict], metrics: dict, bootstrap: int, robust: bool) -> Table:
    by_r2 = metrics.get("l_star_r2_token")
    title = f"layer ranking (l* = {metrics['l_star_S']} by S" + (f", {by_r2} by r2_token" if by_r2 else "")
    title += f"; --select {metrics['select']}" if metrics["select"] != "S" else ""
    if bootstrap:
        title += f"; argmax S in {metrics['l_star_frequency']:.0%} of {bootstrap} draws"
    if robust:
        title += f"; robust l* = {metrics['l_star_robust']}"
    if not (bootstrap or robust):
        return table(title + ")", *columns(records, SCORE), highlight_row=0)
    keep = {"layer", "S"} | ({"S_boot_std", "l_star_freq"} if bootstrap else set())
    keep |= {"k_hat", "k_hat_robust", "n_outliers", "S_robust", "rank_robust"} if robust else set()
    view = {k: v for k, v in STABILITY.items() if k in keep}
    cells = [[f.format(r[k]) for k, (_, f) in view.items()] for r in records]
    return table(title + ")", [name for name, _ in view.values()], cells, highlight_row=0)


def sweep_tables(per_layer: list[dict], variants: list[dict], metrics: dict, protocol: str, seeds: str) -> list:
    m = metrics
    layers = table(
        f"{protocol}, seeds {seeds}: l* = {m['l_star']}, oracle = {m['oracle_layer']} "
        f"({m['oracle_agreement']:.0%} of seeds agree), worst = {m['worst_layer']}",
        *columns(per_layer, SWEEP),
    )
    lo, hi = m["shallow_window"]
    interval = lambda r: "-" if r["rho_lo"] != r["rho_lo"] else f"{r['rho_lo']:.2f}..{r['rho_hi']:.2f}"
    rows = [
        [r["variant"], three(r["rho"]), interval(r)]
        + [three(r[c]) for c in ("rho_shallow", "kendall_tau", "partial_rho_given_depth")]
        for r in variants
    ]
    predictors = table(
        f"which predictor ranks the layers by -loss (rho with its 95% interval; over the shallow "
        f"layers {lo}-{hi}; Kendall tau; partial rho given depth)",
        ["predictor", "rho", "95% CI", "shallow", "tau", "partial"],
        rows,
    )
    return [layers, predictors]


def short(x: float) -> str:
    """3 significant digits, whole numbers from 100 up, k and M beyond 10^4: 41.2, 827, 38.4k."""
    if x != x:
        return "-"
    a = abs(x)
    if a >= 1e6:
        return f"{x / 1e6:.3g}M"
    if a >= 1e4:
        return f"{x / 1e3:.3g}k"
    return f"{x:.0f}" if a >= 100 else f"{x:.3g}"


def ci(r: dict, key: str) -> str:
    """A headline with its interval: 41.2 [38, 45.1]."""
    v, lo, hi = r[key], r[key + "_lo"], r[key + "_hi"]
    return "-" if v != v else f"{short(v)} [{short(lo)}, {short(hi)}]"


def part_note(p: dict) -> str:
    """What a part's validation loss is measured against."""
    if p.get("reconstruction_accuracy") == p.get("reconstruction_accuracy") and p.get("reconstruction_accuracy"):
        return f"recon {p['reconstruction_accuracy']:.3f}"
    if p.get("unigram_entropy") == p.get("unigram_entropy") and p.get("unigram_entropy"):
        return f"unigram H {p['unigram_entropy']:.2f}"
    return ""


def compare_tables(result: dict) -> list[Table]:
    """Per budget: each row's headline under both evaluators, then claim 3's verdict per baseline."""
    from pathlib import Path

    ev = Path(result["evaluators"]["evaluator"]).name[:14]
    out = []
    for v in result["verdicts"]:
        k = v["budget"]
        rows = [r for r in result["summary"] if r["budget"] == k]
        head = f"{k}x, l*={result['l_star']}: Gen.PPL under {ev} [95%] at H {result['held_out_entropy']:.2f}"
        mauve = lambda r: short(r["mauve_at_top_t"]) if r.get("mauve_at_top_t") is not None else "-"
        cells = [
            [
                r["row"][:20],
                ci(r, "headline_evaluator"),
                f"{r['entropy_at_top_t']:.2f}",
                f"{r['diversity_at_top_t']:.2f}",
                mauve(r),
                r["status"],
            ]
            for r in rows
        ]
        out.append(table(head, ["row", "Gen.PPL", "H", "div", "MAUVE", "status"], cells))
        ctrl = {(c["row"], c["source"]): c for c in result.get("controls", []) if c["budget"] == k}
        names = list(dict.fromkeys(row for row, _ in ctrl))
        sources = [SOURCE_LABELS[s] for s in ("prior", "oracle", "null")]  # as compare.json names them
        cell = lambda c: "-" if c is None else f"{short(c['gen_ppl_token_evaluator'])} / {c['token_entropy']:.2f}"
        if names:
            out.append(
                table(
                    f"controls at {k}x, top temperature: Gen.PPL under {ev} / entropy",
                    ["row", "trained prior", "oracle (ceiling)", "null (floor)"],
                    [[n[:22], *(cell(ctrl.get((n, src))) for src in sources)] for n in names],
                )
            )
        parts = [p for p in result.get("parts", []) if p["budget"] == k and p["seed"] == result["seeds"][0]]
        out.append(
            table(
                f"parts at {k}x (seed {result['seeds'][0]})",
                ["part", "trained", "frozen", "steps", "val loss", "note"],
                [
                    [
                        p["part"][:22],
                        short(p["parameters"]),
                        short(p["frozen_parameters"]),
                        p["steps"],
                        f"{p['val_loss']:.3f}",
                        part_note(p),
                    ]
                    for p in parts
                ],
            )
        )
        out.append(
            table(
                f"claim 3 at {k}x under {ev}: {v['claim_3']}",
                ["baseline", "outcome", "points"],
                [[b["baseline"], b["outcome"], len(b["points"])] for b in v["baselines"]],
            )
        )
        out += whose_text_tables(result, k, ev, rows)
    return out


def whose_text_tables(result: dict, k: int, ev: str, rows: list[dict]) -> list[Table]:
    """METHOD §5.1 at budget k: each row's cost class, cost, prior gain and plan agreement, then like with like."""
    if not any("prior_gain" in r for r in rows):  # a comparison made before revision 3
        return []
    number = lambda x, f: "-" if x is None or x != x else format(x, f)
    short_class = {"one-pass": "1 pass", "token-by-token": "by token", "refine": "refine"}
    cells = [
        [
            r["row"][:24],
            short_class[r["cost"]],
            number(r.get("ms_per_sample"), ".0f"),
            number(r.get("prior_gain"), ".2f"),
            number(r.get("plan_agreement"), ".2f"),
            "LM-written" if r.get("lm_written") is True else "",
        ]
        for r in rows
        if r.get("cost") in short_class
    ]
    out = [table(f"whose text at {k}x, under {ev} at the controls' temperature", WHOSE, cells)]
    for v in (v for v in result.get("verdicts_by_class", []) if v["budget"] == k):
        out.append(
            table(
                f"{v['class']} at {k}x: {v['dihal'][:26]}: {v['claim_3']}",
                ["baseline", "outcome", "points"],
                [[b["baseline"], b["outcome"], len(b["points"])] for b in v["baselines"]],
            )
        )
    return out


WHOSE = ["row", "class", "ms/sample", "gain", "plan", "note"]


def confirm_tables(rows: list[dict], evaluator: str, protocol: str, seeds: str) -> list:
    ev = evaluator[:16]
    parts = {  # two tables, so that mean±std cells fit 80 columns whole
        "fidelity, teacher forced": {
            "val_loss": "val loss",
            "top1_agreement": "top-1",
            "kl": "KL",
            "ppl_ratio": "ppl ratio",
        },
        "AR hybrid generations": {
            "gen_ppl_token_backbone": "Gen.PPL bb",
            "gen_ppl_token_evaluator": f"Gen.PPL {ev}"[:14],
            "diversity": "diversity",
            "token_entropy": "entropy",
        },
    }
    out = []
    for title, shown in parts.items():
        cells = [[f"{r['label']} ({r['layer']})"] + [pm(r, k) for k in shown] for r in rows]
        out.append(table(f"claim 4 under {protocol}, seeds {seeds}: {title}", ["layer", *shown.values()], cells))
    return out


def runs_table(root, arts: list) -> Table:
    """stage, id, status and created are never cut; parameters and size give way first at 80 columns."""
    out = Table(
        title=f"artifacts under {root}", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), title_justify="left"
    )
    for name, whole in (("stage", 8), ("id", 12), ("status", 8), ("created", 11)):
        out.add_column(name, no_wrap=True, min_width=whole)
    out.add_column("parameters", overflow="ellipsis", no_wrap=True, max_width=40)
    out.add_column("size", overflow="ellipsis", no_wrap=True, justify="right", max_width=9)
    for art in arts:
        cfg = art.config
        keys = [f"{k}={cfg[k]}" for k in ("model", "layer", "layers", "protocol", "mode") if cfg.get(k) is not None]
        if art.status == "corrupt":  # what is wrong with it, where the parameters would be
            keys = [art.manifest.get("error", "")]
        created = art.manifest.get("created", "")[5:16].replace("T", " ")  # MM-DD HH:MM
        out.add_row(art.stage, art.id, art.status, created, " ".join(keys), human_size(art.manifest.get("size_bytes")))
    return out
