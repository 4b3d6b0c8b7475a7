"""The statistics of `dihal compare` (METHOD §5), on the table of every generated sample
(one line per sample: budget, seed, row, source, temperature, text, its scores under both evaluators).

Rows and sources are their keys here (a registry Row's key, "ar-hybrid", "held-out"; "prior", "oracle",
"null", "data"): stages/compare.py turns them into labels only when it writes. An outcome and a claim
are values of the enums below, made once where they are decided.

    metrics_of   a row's section-5 metrics: Gen.PPL (token-weighted and median) under both evaluators,
                 entropy, diversity and distinct-n (per seed, averaged), length
    headline     a curve row's Gen.PPL interpolated at the held-out text's entropy, a point row's own,
                 each with a bootstrap interval over seeds and samples that contains it
    verdict      claim 3 per baseline: DiHAL's curve at the baseline's entropies against the baseline
    whose_text   a row's prior gain (null-prior Gen.PPL / trained-prior Gen.PPL) and plan agreement under
                 the primary evaluator at the controls' temperature; below LM_WRITTEN it is "LM-written"
    by_class     like with like (METHOD §5.1): each DiHAL readout against the baselines of its cost class
    analyse      all of it for one comparison: the per-row lines, the headlines, the verdicts, the controls
"""

from __future__ import annotations

from enum import Enum

import numpy as np
import pandas as pd

from dihal.stages import evaluate as eval_stage
from dihal.stages.runtime import bootstrap
from dihal.stages.text.text_metrics import text_metrics

EVALUATORS = ("evaluator", "backbone")  # the primary one first: the backbone scores its own choices
DEGENERATE = 0.9  # a row whose entropy is below 0.9 x the held-out text's at every temperature
TRAINED, CONTROLS, DATA = (
    "prior",
    ("oracle", "null"),
    "data",
)  # sources: a recovery reads the trained prior or a control
LM_WRITTEN = 1.5  # a prior gain below it: the row writes from its own language model, not from the diffusion
CLASSES = ("one-pass", "token-by-token")  # refine rows are reported beside both


class Outcome(str, Enum):
    """DiHAL against one baseline at the baseline's entropies (a str: it is written as its value)."""

    DIHAL_BETTER = "DiHAL better"
    BASELINE_BETTER = "baseline better"
    MIXED = "mixed"
    BASELINE_DEGENERATE = "baseline degenerate"
    DIHAL_DEGENERATE = "DiHAL degenerate"
    NOT_COMPARABLE = "not comparable (entropies not reached)"
    BASELINE_LM_WRITTEN = "baseline LM-written"  # its prior gain is below LM_WRITTEN: decides nothing
    DIHAL_LM_WRITTEN = "DiHAL LM-written"

    @property
    def comparable(self) -> bool:
        return self in (Outcome.DIHAL_BETTER, Outcome.BASELINE_BETTER, Outcome.MIXED)


class Claim(str, Enum):
    """Claim 3 at one budget (and cost class)."""

    HOLDS = "holds"
    PARTLY = "partly"
    DOES_NOT_HOLD = "does not hold"
    DIHAL_DEGENERATE = "does not hold (DiHAL degenerate)"
    NOT_DECIDED = "not decided (DiHAL LM-written)"
    NOT_TESTABLE = "not testable (no comparable baseline)"


def gen_ppl(group: pd.DataFrame, ev: str) -> float:
    scored = group[group[f"n_{ev}"] > 0]
    return float(np.exp(scored[f"nll_{ev}"].sum() / scored[f"n_{ev}"].sum())) if len(scored) else float("nan")


def metrics_of(group: pd.DataFrame) -> dict:
    """The section-5 metrics of one row, source, temperature (and seed) from its samples."""
    scored = {ev: group[group[f"n_{ev}"] > 0] for ev in EVALUATORS}
    out = {
        **{f"gen_ppl_token_{ev}": gen_ppl(group, ev) for ev in EVALUATORS},
        **{
            f"gen_ppl_median_{ev}": float(np.median(np.exp(g[f"nll_{ev}"] / g[f"n_{ev}"]))) if len(g) else np.nan
            for ev, g in scored.items()
        },
        "token_entropy": float(group["token_entropy"].mean()),
        **text_means(group),
        "n_samples": len(group),
        "mean_tokens": float(group["n_tokens"].mean()),
    }
    out.pop("unigram_entropy"), out.pop("mean_words")
    if "ms_per_sample" in group and group["ms_per_sample"].notna().any():
        out["ms_per_sample"] = float(group["ms_per_sample"].mean())
    return out


def text_means(group: pd.DataFrame) -> dict:
    """Section 3's text metrics (diversity, distinct-n) of each seed's N samples, averaged over seeds:
    pooling seeds would count more text (distinct-n falls with it), and the held-out text, the same
    for every seed, would count each n-gram once per seed."""
    per_seed = [text_metrics(g["text"].tolist()) for _, g in group.groupby("seed")]
    return {k: float(np.mean([m[k] for m in per_seed])) for k in per_seed[0]}


def diversity(group: pd.DataFrame) -> float:
    return text_means(group)["diversity"]


def curve_at(points: list[tuple[float, float]], h: float) -> float:
    """points (entropy, value), value interpolated linearly in entropy at h; NaN outside their span."""
    points = sorted(p for p in points if np.isfinite(p[0]) and np.isfinite(p[1]))
    if not points or not points[0][0] - 1e-9 <= h <= points[-1][0] + 1e-9:
        return float("nan")
    ent, val = zip(*points)
    return float(np.interp(h, ent, val)) if len(points) > 1 else float(val[0])


def log_ppl_at(samples: pd.DataFrame, ev: str, h: float, kind: str) -> float:
    """A row's log Gen.PPL at entropy h (a curve), or at its own entropy (a point: h is ignored)."""
    by_t = [
        (float(g["token_entropy"].mean()), np.log(gen_ppl(g, ev)))
        for _, g in samples.groupby("temperature", dropna=False)
    ]
    return by_t[0][1] if kind == "point" else curve_at(by_t, h)


def resample(samples: pd.DataFrame, rng) -> pd.DataFrame:
    """Seeds with replacement, then sample indices with replacement within each seed; the same indices
    at every temperature (a sample i of every temperature shares its prior noise)."""
    seeds = samples["seed"].unique()
    parts = []
    for s in rng.choice(seeds, len(seeds)):
        one = samples[samples["seed"] == s]
        n = one["index"].max() + 1
        picks = pd.DataFrame({"index": rng.integers(0, n, n)})
        parts.append(picks.merge(one, on="index", how="left"))
    return pd.concat(parts, ignore_index=True)


def _draw_rows(tables: dict, rng) -> np.ndarray:
    """The rows of `samples` that resample() draws, in the order its frame holds them, from the same calls
    on rng: seeds with replacement, then indices with replacement within each seed, each index's rows of every
    temperature in the frame's order (what picks.merge(one, on="index", how="left") gives). tables[seed]: that
    seed's row positions, one line per index 0..n-1."""
    parts = []
    for s in rng.choice(list(tables), len(tables)):
        n = len(tables[s])
        parts.append(tables[s][rng.integers(0, n, n)].reshape(-1))
    return np.concatenate(parts)


def _log_ppl_of_rows(cols: dict, rows: np.ndarray, ev: str, h: float, kind: str) -> float:
    """log_ppl_at over samples.iloc[rows], from numpy columns: the same sums in the same order, so the same
    bits (pandas' sum and mean are numpy's pairwise sum over the selected values)."""
    temps = cols["temperature"][rows]
    by_t = []
    for t in cols["temperatures"]:
        sel = rows[np.isnan(temps)] if np.isnan(t) else rows[temps == t]
        entropy = cols["token_entropy"][sel].sum() / len(sel)
        scored = sel[cols[f"n_{ev}"][sel] > 0]
        ppl = float(np.exp(cols[f"nll_{ev}"][scored].sum() / cols[f"n_{ev}"][scored].sum())) if len(scored) else np.nan
        by_t.append((float(entropy), np.log(ppl)))
    return by_t[0][1] if kind == "point" else curve_at(by_t, h)


def headline(samples: pd.DataFrame, kind: str, h_ref: float, rng, resamples: int) -> dict:
    """Gen.PPL under each evaluator at the held-out entropy (curve) or at its point, with intervals. The
    resamples are resample()'s, drawn as row positions and summed with numpy: a DataFrame merge per resample
    cost compare most of its host time (39 of 48 s in the paper script's rehearsal) for the same numbers."""
    index, seeds = samples["index"].to_numpy(), samples["seed"].to_numpy()
    counts = samples.groupby(["seed", "index"]).size()
    whole = all(
        counts.loc[s].index.tolist() == list(range(int(counts.loc[s].index.max()) + 1)) and counts.loc[s].nunique() == 1
        for s in pd.unique(seeds)
    )
    if not whole:  # a seed missing an index, or an index with fewer rows: the frame's own merge, as before
        draws = [resample(samples, rng) for _ in range(resamples)]
        drawn = lambda ev: [float(np.exp(log_ppl_at(d, ev, h_ref, kind))) for d in draws]
    else:
        temperature = samples["temperature"].to_numpy(dtype=np.float64)
        cols = {"temperature": temperature, "token_entropy": samples["token_entropy"].to_numpy()}
        cols["temperatures"] = sorted(set(temperature[~np.isnan(temperature)].tolist())) + (
            [np.nan] if np.isnan(temperature).any() else []
        )
        for ev in EVALUATORS:
            cols[f"n_{ev}"], cols[f"nll_{ev}"] = samples[f"n_{ev}"].to_numpy(), samples[f"nll_{ev}"].to_numpy()
        tables = {}
        for s in pd.unique(seeds):
            mine = np.flatnonzero(seeds == s)
            tables[s] = mine[np.argsort(index[mine], kind="stable")].reshape(int(index[mine].max()) + 1, -1)
        rows = [_draw_rows(tables, rng) for _ in range(resamples)]
        drawn = lambda ev: [float(np.exp(_log_ppl_of_rows(cols, r, ev, h_ref, kind))) for r in rows]
    out = {}
    for ev in EVALUATORS:
        point = float(np.exp(log_ppl_at(samples, ev, h_ref, kind)))
        ci = bootstrap.interval(point, drawn(ev))
        out |= {f"headline_{ev}": point, f"headline_{ev}_lo": ci["lo"], f"headline_{ev}_hi": ci["hi"]}
    return out


def status(samples: pd.DataFrame, kind: str, h_ref: float, value: float) -> str:
    entropies = samples.groupby("temperature", dropna=False)["token_entropy"].mean()
    if (entropies < DEGENERATE * h_ref).all():
        return "degenerate"
    return "not reached" if kind == "curve" and not np.isfinite(value) else "ok"


def verdict(samples: pd.DataFrame, ours: str, baseline: str, ev: str, h_ref: float, lm_written=frozenset()) -> dict:
    """DiHAL's Gen.PPL and diversity interpolated at each of the baseline's entropies, against its own.
    lm_written: the rows whose prior gain is below LM_WRITTEN; where either side is one, the outcome says
    so and what was measured is kept apart ("measured")."""
    mine, theirs = samples[samples.row == ours], samples[samples.row == baseline]
    my_curve = [
        (m["token_entropy"], np.log(m[f"gen_ppl_token_{ev}"]), m["diversity"])
        for m in (metrics_of(g) for _, g in mine.groupby("temperature"))
    ]
    points = []
    for t, g in theirs.groupby("temperature", dropna=False):
        m = metrics_of(g)
        at = curve_at([(e, v) for e, v, _ in my_curve], m["token_entropy"])
        div = curve_at([(e, d) for e, _, d in my_curve], m["token_entropy"])
        points.append(
            {
                "temperature": None if pd.isna(t) else float(t),
                "entropy": m["token_entropy"],
                "baseline_gen_ppl": m[f"gen_ppl_token_{ev}"],
                "dihal_gen_ppl": float(np.exp(at)),
                "baseline_diversity": m["diversity"],
                "dihal_diversity": div,
            }
        )
    reached = [p for p in points if np.isfinite(p["dihal_gen_ppl"])]
    wins = [p["dihal_gen_ppl"] < p["baseline_gen_ppl"] for p in reached]
    if status(theirs, "curve", h_ref, 0.0) == "degenerate":
        outcome = Outcome.BASELINE_DEGENERATE
    elif status(mine, "curve", h_ref, 0.0) == "degenerate":
        outcome = Outcome.DIHAL_DEGENERATE
    elif not reached:
        outcome = Outcome.NOT_COMPARABLE
    else:
        outcome = Outcome.DIHAL_BETTER if all(wins) else Outcome.BASELINE_BETTER if not any(wins) else Outcome.MIXED
    out = {"baseline": baseline, "outcome": outcome, "points": points}
    if ours in lm_written or baseline in lm_written:
        out["outcome"] = Outcome.DIHAL_LM_WRITTEN if ours in lm_written else Outcome.BASELINE_LM_WRITTEN
        out["measured"] = outcome
    return out


def claim(verdicts: list[dict]) -> Claim:
    """Claim 3 at one budget: holds if DiHAL beats every comparable baseline at its entropies."""
    outcomes = [Outcome(v["outcome"]) for v in verdicts]
    comparable = [o for o in outcomes if o.comparable]
    if Outcome.DIHAL_DEGENERATE in outcomes:
        return Claim.DIHAL_DEGENERATE
    if Outcome.DIHAL_LM_WRITTEN in outcomes:
        return Claim.NOT_DECIDED
    if not comparable:
        return Claim.NOT_TESTABLE
    won = comparable.count(Outcome.DIHAL_BETTER)
    return Claim.HOLDS if won == len(comparable) else Claim.DOES_NOT_HOLD if won == 0 else Claim.PARTLY


def whose_text(samples: pd.DataFrame, budget: int, row: str) -> dict:
    """METHOD §5.1 for one row and budget, under the primary evaluator at the temperature its controls ran
    (the grid's last; a point row's own): prior gain = Gen.PPL(null prior) / Gen.PPL(trained prior), plan
    agreement = the share of its tokens that are the cosine-nearest token of the prior's sample there.
    NaN where the row has no null-prior control (its gain is not measured) or no plan."""
    mine = samples[(samples.budget == budget) & (samples.row == row)]
    null, trained = mine[mine.source == "null"], mine[mine.source == TRAINED]
    t = null["temperature"].iloc[0] if len(null) else trained["temperature"].max()
    same = trained[trained.temperature.isna()] if pd.isna(t) else trained[trained.temperature == t]
    gain = gen_ppl(null, "evaluator") / gen_ppl(same, "evaluator") if len(null) and len(same) else float("nan")
    agreement = same["plan_agreement"].mean() if "plan_agreement" in same and len(same) else float("nan")
    return {
        "prior_gain": float(gain),
        "plan_agreement": float(agreement),
        "lm_written": bool(gain < LM_WRITTEN) if np.isfinite(gain) else None,
    }


def summarize(samples: pd.DataFrame, h_ref: float, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the per row, source, temperature and seed lines; each row's headline per budget)."""
    keys = ["budget", "row", "kind", "source", "temperature"]
    lines = [
        {**dict(zip(keys + ["seed"], k)), **metrics_of(g)}
        for k, g in samples.groupby(keys + ["seed"], sort=False, dropna=False)
    ]
    rng, heads = np.random.default_rng([seed, 5]), []
    for (budget, row, kind), g in samples[samples.source.isin([TRAINED, DATA])].groupby(
        ["budget", "row", "kind"], sort=False
    ):
        head = headline(g, kind, h_ref, rng, bootstrap_resamples(len(g)))
        t1 = g[g.temperature == g.temperature.max()] if kind == "curve" else g
        heads.append(
            {
                "budget": budget,
                "row": row,
                "kind": kind,
                **head,
                "status": status(g, kind, h_ref, head["headline_evaluator"]),
                "entropy_at_top_t": float(t1["token_entropy"].mean()),
                "diversity_at_top_t": diversity(t1),
                "seeds": int(g["seed"].nunique()),
                "cost": g["cost"].iloc[0] if "cost" in g and g["cost"].notna().any() else None,
                "ms_per_sample": float(g["ms_per_sample"].mean()) if "ms_per_sample" in g else float("nan"),
                **whose_text(samples, budget, row),
            }
        )
    return pd.DataFrame(lines), pd.DataFrame(heads)


def mauve_available() -> str | None:
    """The installed mauve-text's version (`pip install dihal[mauve]`), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        import mauve  # noqa: F401
    except ImportError:
        return None
    try:
        return f"mauve-text {version('mauve-text')}"
    except PackageNotFoundError:
        return "mauve (version unknown)"


def mauve_scores(samples: pd.DataFrame, evaluator, held_out: np.ndarray, top_t: float, seed: int) -> pd.DataFrame:
    """MAUVE of every trained-prior row at the grid's top temperature (and of every point row) against
    the held-out text, on the primary evaluator's features; one line per budget, row and seed. Empty
    without mauve-text."""
    if mauve_available() is None:
        return pd.DataFrame(columns=["budget", "row", "seed", "mauve"])
    import mauve

    picked = samples[(samples.source == TRAINED) & (samples.temperature.isna() | (samples.temperature == top_t))]
    out = []
    for (budget, row, s), g in picked.groupby(["budget", "row", "seed"], sort=False):
        p = eval_stage.last_token_features(evaluator, g["text"].tolist())
        score = mauve.compute_mauve(p_features=p, q_features=held_out, seed=seed, verbose=False).mauve
        out.append({"budget": budget, "row": row, "seed": s, "mauve": float(score)})
    return pd.DataFrame(out)


def by_class(samples: pd.DataFrame, heads: pd.DataFrame, dihal: list[str], baselines: list[str], h_ref, budgets):
    """Like with like (METHOD §5.1): each DiHAL readout against the baselines of its own cost class (a refine
    row against every baseline, beside both classes); an LM-written row's win or loss decides nothing."""
    out = []
    for k in budgets:
        one = samples[(samples.budget == k) & (samples.source == TRAINED)]
        head = heads[heads.budget == k].set_index("row")
        cost, lm = head["cost"].to_dict(), frozenset(r for r, w in head["lm_written"].items() if w is True)
        for mine in dihal:
            theirs = [b for b in baselines if cost.get(mine) == "refine" or cost.get(b) == cost.get(mine)]
            vs = [verdict(one, mine, b, "evaluator", h_ref, lm) for b in theirs]
            klass = cost.get(mine) if cost.get(mine) in CLASSES else f"{cost.get(mine)} (beside both)"
            out.append({"budget": k, "class": klass, "dihal": mine, "claim_3": claim(vs), "baselines": vs})
    return out


def bootstrap_resamples(n: int) -> int:
    return 200 if n > 2000 else 400


def analyse(
    samples: pd.DataFrame, h_ref: float, cfg, ours: str, baselines: list[str], evaluator, texts, dihal=None
) -> dict:
    """The per-row lines (with MAUVE at the top temperature where mauve-text is installed), the headlines,
    claim 3's verdict per budget, like with like per cost class (dihal: DiHAL (l*)'s rows, one per
    readout), and the controls' lines."""
    lines, heads = summarize(samples, h_ref, cfg.seeds[0])
    top_t = max(cfg.temperatures)
    held_features = eval_stage.last_token_features(evaluator, texts) if mauve_available() else None
    scores = mauve_scores(samples, evaluator, held_features, top_t, cfg.seeds[0])
    at_top = lines.source.eq(TRAINED) & (lines.temperature.isna() | lines.temperature.eq(top_t))
    lines = lines.merge(scores, on=["budget", "row", "seed"], how="left")
    lines.loc[~at_top.to_numpy(), "mauve"] = np.nan
    per_row = scores.groupby(["budget", "row"])["mauve"].mean() if len(scores) else {}
    heads["mauve_at_top_t"] = [per_row.get((b, r), np.nan) for b, r in zip(heads.budget, heads.row)]
    verdicts = []
    for k in cfg.budgets:
        one = samples[(samples.budget == k) & (samples.source == TRAINED)]
        vs = [verdict(one, ours, b, "evaluator", h_ref) for b in baselines]
        verdicts.append({"budget": k, "claim_3": claim(vs), "baselines": vs})
    classes = by_class(samples, heads, dihal or [ours], baselines, h_ref, cfg.budgets)
    controlled = lines[lines.source.isin(CONTROLS)]["row"].unique()
    top = lines.temperature.isna() | (lines.temperature == top_t)  # where the controls ran
    controls = lines[lines.row.isin(controlled) & (lines.source.isin(CONTROLS) | top)]
    return {"lines": lines, "heads": heads, "verdicts": verdicts, "by_class": classes, "controls": controls}
