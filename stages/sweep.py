"""`dihal sweep`: one bridge per layer and seed under one fixed protocol, then METHOD §4
claims 1 and 2: does the geometry score S_l predict the validation bridge loss, and is l* the oracle?

The loss of a layer is its mean over --seeds. Every predictor (S, each proxy alone, S under each
--normalize mode, S of the robust proxies when the score has them, and plain depth) is one row of
variants.csv with: Spearman rho against -loss over the swept layers and its p-value, rho over the
shallow window 1..ceil(L/3), Kendall tau, the partial Spearman correlation given depth, and a
bootstrap 95% interval for rho that resamples the seeds and the score's position draws.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, fields, replace

import numpy as np
import pandas as pd
from scipy.stats import kendalltau, spearmanr

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, Job
from dihal.stages import evaluate as eval_stage
from dihal.stages import registry
from dihal.stages import score as score_stage
from dihal.stages import train_bridge as bridge_stage
from dihal.stages.configs import NORMALIZATIONS, ScoreConfig, SweepConfig, gpu_key
from dihal.stages.lineage import scored_extract
from dihal.stages.runtime import bootstrap, dist, plotting
from dihal.stages.runtime.progress import NullProgress, Progress

STAGE = "sweep"
CACHE_VERSION = 1  # bump whenever this stage's bytes change (tests/test_golden.py says when)
CI_RESAMPLES = 2000  # bootstrap resamples behind each rho interval


def run(
    cfg: SweepConfig,
    extract: Artifact,
    score_art: Artifact,
    store: ArtifactStore,
    *,
    force: bool = False,
    progress: Progress | None = None,
    trust_remote_code: bool = False,
) -> Artifact:
    progress = progress or NullProgress()
    config = {**asdict(cfg), "overrides": dict(cfg.overrides)}
    config["bridge_version"] = bridge_stage.CACHE_VERSION  # its bridges' computation: a new one is another sweep
    config |= gpu_key(cfg.device)
    parents = {"extract": extract.id, "score": score_art.id}
    scored = scored_extract(score_art, extract, store, computed=dict(cfg.overrides).get("states") == "model")
    scores = score_stage.load_table(score_art).set_index("layer")
    missing = [layer for layer in cfg.layers if layer not in scores.index]
    if missing:
        raise DihalError(f"layer {missing[0]} is not a candidate of score {score_art.id}; sweep its candidates only")
    bridge_cfg = lambda layer, seed: bridge_stage.BridgeConfig.for_run(
        cfg.protocol, cfg.overrides, seed=seed, device=cfg.device, dtype=cfg.dtype, layer=layer
    )
    jobs = [(layer, seed) for layer in cfg.layers for seed in cfg.seeds]
    fidelity_cfg = lambda seed: eval_stage.FidelityConfig(
        sample_steps=(cfg.sample_steps,), limit=cfg.eval_limit, seed=seed, device=cfg.device, dtype=cfg.dtype
    )
    # the backbone, loaded by a rank the first time one of its bridges' fidelity is not in the store
    backbone = functools.cache(lambda: eval_stage.backbone_for(extract, cfg.device, cfg.dtype, trust_remote_code))

    def run_one(job: tuple[int, int], inner: Progress) -> dict:
        """One unit (dist.share): the bridge of (layer, seed) and its fidelity, each an artifact of its own."""
        layer, seed = job
        bridge_art = bridge_stage.run(bridge_cfg(layer, seed), extract, store, progress=inner)
        fresh = not eval_stage.fidelity_cached(fidelity_cfg(seed), bridge_art, store)
        fid = eval_stage.run_fidelity(fidelity_cfg(seed), bridge_art, store, loaded=backbone() if fresh else None)
        fid = fid.manifest["metrics"]["fidelity"][0]
        return {
            "layer": layer,
            "seed": seed,
            "val_loss": bridge_art.manifest["metrics"]["val_loss"],
            "bridge": bridge_art.id,
            **{k: v for k, v in fid.items() if k != "steps"},
        }

    def work(art: Artifact) -> None:  # on every rank: the bridges dealt over them; rank 0 sums up
        name = lambda job: f"layer {job[0]}, seed {job[1]}: bridge under protocol {cfg.protocol} and its fidelity"
        runs = dist.share(jobs, run_one, name, progress=progress)
        if dist.distributed()[0] != 0:
            return
        with dist.local():  # rank 0 alone
            variant_scores = normalize_variants(score_art, scored, store, progress)  # cheap next to the bridges
        runs = pd.DataFrame(runs)
        table = per_layer(runs, scores)
        num_blocks = int(extract.manifest["metrics"]["num_blocks"])
        summary = summarize(table, runs, int(scores["S"].idxmax()), num_blocks)
        main_mode = score_art.manifest["config"]["normalize"]
        variants = variant_table(table, runs, variant_scores, main_mode, num_blocks, seed=min(cfg.seeds))
        summary["variants"] = variants.to_dict("records")
        summary["variant_scores"] = {mode: art.id for mode, art in variant_scores.items()}
        table.to_csv(art.file("sweep.csv"), index=False)
        table.to_parquet(art.file("sweep.parquet"), index=False)
        runs.to_csv(art.file("sweep_runs.csv"), index=False)
        variants.to_csv(art.file("variants.csv"), index=False)
        art.file("summary.json").write_text(json.dumps(summary, indent=2, default=float))
        plot(table, summary, art.file("sweep.png"))
        art.manifest["metrics"] = {k: v for k, v in summary.items() if k != "variants"}

    extra = {"model": extract.manifest.get("model")}
    seed = min(cfg.seeds)  # torchrun: every rank does its units (layer, seed) of dist.deal; rank 0 sums up
    job = Job(STAGE, CACHE_VERSION, config, parents, work, seed=seed, device=cfg.device, extra=extra, every_rank=True)
    return store.run_stage(job, force=force, progress=progress, group=dist.group())


def per_layer(runs: pd.DataFrame, scores: pd.DataFrame) -> pd.DataFrame:
    """One row per layer: S, its rank, and the mean (and std over seeds) of every run metric."""
    metrics = [c for c in runs.columns if c not in ("layer", "seed", "bridge")]
    grouped = runs.groupby("layer", sort=True)
    table = grouped[metrics].mean()
    table["val_loss_std"] = grouped["val_loss"].std(ddof=1) if runs["seed"].nunique() > 1 else 0.0
    table["n_seeds"] = grouped["seed"].count()
    table.insert(0, "score_rank", scores.loc[table.index, "rank"].astype(int))
    table.insert(0, "S", scores.loc[table.index, "S"].astype(float))
    return table.reset_index()


def summarize(table: pd.DataFrame, runs: pd.DataFrame, l_star: int, num_blocks: int) -> dict:
    rho, p_value = spearmanr(table["S"], -table["val_loss"]) if len(table) > 1 else (float("nan"), float("nan"))
    oracle = int(table.loc[table["val_loss"].idxmin(), "layer"])
    worst = int(table.loc[table["val_loss"].idxmax(), "layer"])
    loss = table.set_index("layer")["val_loss"]
    per_seed = {int(s): int(g.loc[g["val_loss"].idxmin(), "layer"]) for s, g in runs.groupby("seed")}
    return {
        "spearman_rho": float(rho),
        "p_value": float(p_value),
        "oracle_layer": oracle,
        "worst_layer": worst,
        "l_star": l_star,
        "l_star_val_loss": float(loss.get(l_star, float("nan"))),
        "l_star_loss_rank": int(loss.rank(method="min")[l_star]) if l_star in loss else None,
        "oracle_val_loss": float(loss[oracle]),
        "worst_val_loss": float(loss[worst]),
        "oracle_per_seed": per_seed,
        "oracle_agreement": float(np.mean([o == oracle for o in per_seed.values()])),
        "l_star_is_oracle_per_seed": float(np.mean([o == l_star for o in per_seed.values()])),
        "shallow_window": [1, shallow_top(num_blocks)],
        "layers": table["layer"].tolist(),
        "seeds": sorted(per_seed),
    }


# -- the variants: which predictor of the loss, and how sure ------------------------------------
def shallow_top(num_blocks: int) -> int:
    """The shallow window is 1..ceil(L/3), L the number of blocks."""
    return math.ceil(num_blocks / 3)


def normalize_variants(score_art: Artifact, extract: Artifact, store: ArtifactStore, progress) -> dict[str, Artifact]:
    """The same score under every --normalize mode (the given score's own mode included). The other
    modes are scored once, without draws or robust proxies: their rows' intervals resample seeds."""
    base = score_art.manifest["config"]
    known = {f.name for f in fields(ScoreConfig)}
    values = {k: v for k, v in base.items() if k in known and k != "device"}
    values.setdefault("r2_penalty", "gcv")  # a score made before the choice existed used GCV
    if isinstance(values.get("candidates"), list):
        values["candidates"] = ",".join(map(str, values["candidates"]))
    if isinstance(values.get("proxies"), list):  # the id lists the proxies computed: --proxies paper's or all
        values["proxies"] = "paper" if values["proxies"] == list(registry.proxy_set("paper")) else "all"
    cfg = ScoreConfig(**values)
    out = {}
    for mode in NORMALIZATIONS:
        out[mode] = (
            score_art
            if mode == cfg.normalize
            else score_stage.run(
                replace(cfg, normalize=mode, bootstrap=0, outlier_mads=None), extract, store, progress=progress
            )
        )
    return out


def draws_of(score_art: Artifact) -> pd.DataFrame | None:
    path = score_art.file("bootstrap.csv")
    return pd.read_csv(path) if path.exists() else None


def partial_spearman(x, y, z) -> float:
    """Spearman correlation of x and y with z partialled out: the correlation of the ranks' residuals
    after each is regressed on the ranks of z."""
    rx, ry, rz = (pd.Series(v).rank().to_numpy() for v in (x, y, z))
    r = np.corrcoef(np.vstack([rx, ry, rz]))
    denom = math.sqrt(max(0.0, (1 - r[0, 2] ** 2) * (1 - r[1, 2] ** 2)))
    return float((r[0, 1] - r[0, 2] * r[1, 2]) / denom) if denom > 0 else float("nan")


def predictors(scores: pd.DataFrame, mode: str, main: bool) -> dict[str, pd.Series]:
    """name -> a per-layer predictor where larger should mean a lower bridge loss."""
    out = {}
    if main:
        out["S"] = scores["S"]
        for p in registry.predictors():  # each proxy alone, signed by the registry (where the score has it)
            if p.name in scores and scores[p.name].notna().any():
                out[p.predictor] = p.sign * scores[p.name]
        if "S_robust" in scores:
            out["S (robust proxies)"] = scores["S_robust"]
    else:
        out[f"S, normalize={mode}"] = scores["S"]
    return out


def variant_table(
    table: pd.DataFrame,
    runs: pd.DataFrame,
    variant_scores: dict[str, Artifact],
    main_mode: str,
    num_blocks: int,
    seed: int,
) -> pd.DataFrame:
    layers = table["layer"].to_numpy()
    neg_loss = -table.set_index("layer").loc[layers, "val_loss"].to_numpy()
    shallow = layers <= shallow_top(num_blocks)
    loss_by_seed = runs.pivot(index="layer", columns="seed", values="val_loss").loc[layers].to_numpy()
    rng = np.random.default_rng([seed, 7])
    n_seeds = loss_by_seed.shape[1]
    losses = [neg_loss] + [  # the point's own losses first, then the seeds' resamples
        -loss_by_seed[:, rng.integers(0, n_seeds, n_seeds)].mean(axis=1) for _ in range(CI_RESAMPLES)
    ]
    rows = []
    for mode, art in variant_scores.items():
        scores = score_stage.load_table(art).set_index("layer")
        boot = draws_of(art)
        draw_tables = [] if boot is None else [g.set_index("layer") for _, g in boot.groupby("draw")]
        for name, pred in predictors(scores, mode, main=mode == main_mode).items():
            x = pred.loc[layers].to_numpy()
            resampled = [predictors(t, mode, main=mode == main_mode)[name].loc[layers].to_numpy() for t in draw_tables]
            rows.append({"variant": name, **correlations(x, neg_loss, layers, shallow)})
            rows[-1].update(interval(x, resampled, losses, rng, n_seeds))
    depth = -layers.astype(float)  # plain depth: shallower predicted better
    rows.append({"variant": "-depth (baseline)", **correlations(depth, neg_loss, layers, shallow)})
    rows[-1].update(interval(depth, [], losses, rng, n_seeds))
    return pd.DataFrame(rows)


def correlations(x: np.ndarray, neg_loss: np.ndarray, layers: np.ndarray, shallow: np.ndarray) -> dict:
    nan = float("nan")
    rho, p = spearmanr(x, neg_loss) if len(x) > 2 else (nan, nan)
    tau, _ = kendalltau(x, neg_loss) if len(x) > 2 else (nan, nan)
    rho_shallow = spearmanr(x[shallow], neg_loss[shallow])[0] if shallow.sum() > 2 else nan
    return {
        "rho": float(rho),
        "p_value": float(p),
        "kendall_tau": float(tau),
        "rho_shallow": float(rho_shallow),
        "n_shallow": int(shallow.sum()),
        "partial_rho_given_depth": partial_spearman(x, neg_loss, layers) if len(x) > 3 else nan,
    }


def interval(x: np.ndarray, resampled: list[np.ndarray], losses: list[np.ndarray], rng, n_seeds: int) -> dict:
    """95% interval of rho over resamples of the seeds (with replacement) and of the score's position
    draws (one of them, the score's own draw 0 included, at random per resample), containing the
    point rho (stages/runtime/bootstrap.py); NaN when there is nothing to resample."""
    sources = (["seeds"] if n_seeds > 1 else []) + (["positions"] if resampled else [])
    if not sources or len(x) < 3:
        return {"rho_lo": float("nan"), "rho_hi": float("nan"), "resampled": "nothing"}
    draws = [x, *resampled]
    rhos = [spearmanr(draws[rng.integers(len(draws))], loss)[0] for loss in losses[1:]]
    ci = bootstrap.interval(float(spearmanr(x, losses[0])[0]), rhos)
    return {"rho_lo": ci["lo"], "rho_hi": ci["hi"], "resampled": "+".join(sources)}


def plot(table: pd.DataFrame, summary: dict, path) -> None:
    """Left: S and the loss per layer (l* dashed, oracle dotted). Right: each predictor's rho with its
    95% interval, its rho over the shallow window and its partial rho given depth."""
    fig, (ax, right) = plotting.figure(13, 5, ncols=2, width_ratios=(3, 2))
    ax.plot(table["layer"], table["S"], marker="o", color="black", label="geometry score S")
    ax.set_xlabel("layer")
    ax.set_ylabel("S")
    ax2 = ax.twinx()
    ax2.errorbar(
        table["layer"],
        table["val_loss"],
        yerr=table["val_loss_std"],
        marker="s",
        color="tab:red",
        capsize=2,
        label=f"bridge loss (mean +- std, {int(table['n_seeds'].max())} seeds)",
    )
    ax2.set_ylabel("validation bridge loss", color="tab:red")
    ax.axvline(summary["l_star"], color="black", linestyle="--", alpha=0.6)
    ax.axvline(summary["oracle_layer"], color="tab:red", linestyle=":", alpha=0.6)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="lower center", fontsize=8)
    ax.set_title(
        f"rho(S, -loss) = {summary['spearman_rho']:.2f}; l* = {summary['l_star']}, "
        f"oracle = {summary['oracle_layer']}, worst = {summary['worst_layer']}"
    )
    ax.grid(alpha=0.3)

    variants = pd.DataFrame(summary["variants"])[::-1].reset_index(drop=True)  # the first row on top
    y = np.arange(len(variants))
    lo, hi, rho = (variants[c].to_numpy() for c in ("rho_lo", "rho_hi", "rho"))
    # a percentile interval need not contain the point estimate (k_hat's draws vary widely): drawn apart
    right.hlines(y, lo, hi, color="black", linewidth=1.5, label="95% interval (seeds, score draws)")
    right.plot(rho, y, "o", color="black", label="rho, all swept layers")
    lo_w, hi_w = summary["shallow_window"]
    right.plot(variants["rho_shallow"], y, "^", color="tab:blue", label=f"rho, layers {lo_w}-{hi_w}")
    right.plot(variants["partial_rho_given_depth"], y, "x", color="tab:red", label="partial rho given depth")
    right.axvline(0, color="grey", linewidth=0.8)
    right.set_yticks(y, variants["variant"], fontsize=8)
    right.set_xlim(-1.05, 1.05)
    right.set_xlabel("Spearman rho with -loss")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=7)
    plotting.save(fig, right, path, "which predictor ranks the layers")


# -- what the CLI asks of a sweep -----------------------------------------------------------------------------
def num_blocks(source: Artifact | str, trust_remote_code: bool = False) -> int:
    """L of an extract artifact, or of a model spec (from its config alone, no weights)."""
    if isinstance(source, Artifact):
        return int(hs.open_group(source).attrs["num_blocks"])
    from dihal.stages.extract import model_config

    return int(model_config(source, trust_remote_code)[0].num_hidden_layers)


def score_once(cfg: ScoreConfig, extract: Artifact, store: ArtifactStore, progress: Progress) -> Artifact:
    """The sweep's score; under torchrun rank 0 computes it while the others wait for it (store.run_stage)."""
    return score_stage.run(cfg, extract, store, progress=progress)


def tables(art: Artifact) -> tuple[list[dict], list[dict]]:
    """(per-layer rows, predictor rows) of a sweep artifact."""
    return tuple(pd.read_csv(art.file(name)).to_dict("records") for name in ("sweep.csv", "variants.csv"))
