"""`dihal compare`: the diagnostic comparison of docs/method.md section 5, as one stage.

For every seed it trains (or finds in the store) each part a row needs under ONE protocol, so
the budget is matched (steps x batch x tokens for the priors, steps x batch for the decoder and
the bridges): the prior over normalized h_0, its self-conditioned twin (SED), the prior over
normalized h_l* (DiHAL-direct), the CoDAR decoder, the bridges at l* and at argmin S trained on
corrupted conditions, and the section-2 bridge at l* for the AR hybrid. Then it generates N
sequences per row (rows that share a prior share its weights and noise) and scores them under
the backbone and a second evaluator.

Rows: Diffusion-LM (prior + clamping + rounding), SED (self-conditioned prior + rounding), CoDAR
(prior + decoder), DiHAL at l* and at argmin S (prior + hidden-state recovery), DiHAL-direct at
l*, optionally DiHAL at an oracle layer; references: the original backbone (AR), the AR hybrid
at l*, and held-out text.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import numpy as np
import pandas as pd

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore
from dihal.stages import bridge as bridge_stage
from dihal.stages import decoder as decoder_stage
from dihal.stages import evaluate as eval_stage
from dihal.stages import generate as gen_stage
from dihal.stages import prior as prior_stage
from dihal.stages import registry
from dihal.stages import score as score_stage
from dihal.stages.configs import BridgeConfig, CompareConfig, DecoderTrainConfig, GenerateConfig, PriorConfig
from dihal.stages.lineage import origin
from dihal.stages.runtime import plotting
from dihal.stages.runtime.progress import NullProgress, Progress
from dihal.stages.text.text_metrics import text_metrics, token_entropy

STAGE = "compare"


def layers_from_score(score_art: Artifact, cfg: CompareConfig) -> tuple[int, int]:
    table = score_stage.load_table(score_art).set_index("layer")["S"]
    l_star = cfg.layer if cfg.layer is not None else int(table.idxmax())
    return l_star, int(table.idxmin())


def part_row(name: str, art: Artifact) -> dict:
    m = art.manifest.get("metrics", {})
    return {
        "part": name,
        "id": art.id,
        "parameters": m.get("parameters"),
        "steps": m.get("steps"),
        "global_batch": m.get("global_batch"),
        "tokens_seen": m.get("tokens_seen"),
        "wall_seconds": art.wall_seconds,
    }


def layer_names(l_star: int, worst: int, oracle: int | None) -> dict[str, int]:
    """What the registry's layer names stand for in this comparison."""
    return {"0": 0, "l_star": l_star, "worst": worst, **({"oracle": oracle} if oracle is not None else {})}


def active_rows(cfg: CompareConfig) -> list[registry.Row]:
    return [row for row in registry.ROWS if cfg.oracle is not None or not row.needs_oracle]


def part_configs(cfg: CompareConfig, seed: int, l_star: int, worst: int) -> dict[str, tuple]:
    """{part label: (stage run, config)} of one seed: each distinct part of the registry's rows (and
    of the AR references) once, every one under the one protocol."""
    layers = layer_names(l_star, worst, cfg.oracle)
    common = dict(seed=seed, device=cfg.device, dtype=cfg.dtype)
    overrides = dict(cfg.overrides)

    def build(spec) -> tuple:
        if isinstance(spec, registry.PriorPart):
            pcfg = PriorConfig.for_run(
                cfg.protocol, overrides, layer=layers[spec.layer], self_condition=spec.self_condition, **common
            )
            return prior_stage.run, pcfg
        if isinstance(spec, registry.DecoderPart):  # the decoder's depth is fixed (DECODER_DEPTH)
            decoder_overrides = {k: v for k, v in overrides.items() if k != "depth"}
            dcfg = DecoderTrainConfig.for_run(
                cfg.protocol, decoder_overrides, condition_noise=cfg.condition_noise, **common
            )
            return decoder_stage.run, dcfg
        noise = cfg.condition_noise if spec.noisy else 0.0
        return bridge_stage.run, BridgeConfig.for_run(
            cfg.protocol, overrides, layer=layers[spec.layer], condition_noise=noise, **common
        )

    specs = [spec for row in active_rows(cfg) for spec in row.parts()] + [registry.AR_REFERENCE_BRIDGE]
    return {spec.label(layers): build(spec) for spec in dict.fromkeys(specs)}


def train_parts(
    cfg: CompareConfig, extract: Artifact, store: ArtifactStore, seed: int, l_star: int, worst: int, progress: Progress
) -> dict[str, Artifact]:
    parts = {}
    for name, (run, part_cfg) in part_configs(cfg, seed, l_star, worst).items():
        progress.log(f"seed {seed}: {name}")
        parts[name] = run(part_cfg, extract, store, progress=progress)
    return parts


def generate_rows(
    cfg: CompareConfig,
    parts: dict,
    store: ArtifactStore,
    loaded,
    seed: int,
    l_star: int,
    worst: int,
    progress: Progress,
) -> dict[str, Artifact]:
    """{row label: generate artifact}: every registry row from its prior's noise, then the AR references."""
    layers = layer_names(l_star, worst, cfg.oracle)
    common = dict(sample_steps=cfg.sample_steps, num_samples=cfg.num_samples, batch_size=cfg.batch_size, seed=seed)
    common |= dict(device=cfg.device, dtype=cfg.dtype)
    rows = {}
    for row in active_rows(cfg):
        gcfg = GenerateConfig(
            mode="parallel", recovery=row.recovery, clamp=row.clamp, prior_steps=cfg.prior_steps, **common
        )
        part = parts[row.part.label(layers)] if row.part is not None else None
        prior = parts[row.prior.label(layers)]
        rows[row.label(layers)] = gen_stage.run_parallel(gcfg, prior, store, loaded, part, progress=progress)
    reference = parts[registry.AR_REFERENCE_BRIDGE.label(layers)]
    ar = GenerateConfig(max_new_tokens=origin(reference).seq_len - 1, baseline="original", **common)
    rows["AR references"] = gen_stage.run(ar, reference, store, loaded, progress=progress)
    return rows


def held_out_texts(extract: Artifact, loaded, n: int) -> tuple[list[str], list[list[int]]]:
    group = hs.open_group(extract.path / "hidden.zarr")
    seqs = hs.split_indices(group, "validation")[:n]
    ids = np.asarray(group["input_ids"].oindex[seqs])[:, 1:]
    eos = loaded.tokenizer.eos_token_id
    kept = [gen_stage.truncate_at_eos(row.tolist(), eos) for row in ids]
    return [loaded.tokenizer.decode(k, skip_special_tokens=True) for k in kept], kept


def score_rows(gen_arts: dict, evaluators: dict, store: ArtifactStore, cfg: CompareConfig) -> list[dict]:
    """One row per generated row and evaluator pair, merged per row."""
    out = {}
    for label, art in gen_arts.items():
        for ev_name, ev in evaluators.items():
            scfg = eval_stage.SamplesConfig(
                evaluator=ev.identity["name"], limit=cfg.num_samples, device=cfg.device, dtype=cfg.dtype
            )
            res = eval_stage.run_samples(scfg, art, store, loaded=ev)
            for r in res.manifest["metrics"]["rows"]:
                name = (
                    label
                    if label != "AR references"
                    else {"hybrid": "AR hybrid (l*)", "original": "original (AR)"}[r["model"]]
                )
                row = out.setdefault(name, {"row": name})
                row[f"gen_ppl_token_{ev_name}"], row[f"gen_ppl_mean_{ev_name}"] = r["gen_ppl_token"], r["gen_ppl_mean"]
                row.update(
                    {
                        k: r[k]
                        for k in (
                            "token_entropy",
                            "diversity",
                            "distinct_1",
                            "distinct_2",
                            "distinct_3",
                            "distinct_4",
                            "n_samples",
                            "mean_tokens",
                        )
                    }
                )
                metrics = art.manifest.get("metrics", {})
                ms = metrics.get("ms_per_sample", metrics.get(r["model"], {}).get("ms_per_sample"))
                if ms is not None:  # an AR artifact records it per model (hybrid, original)
                    row["ms_per_sample"] = ms
    return list(out.values())


def real_text_row(texts: list[str], ids: list[list[int]], evaluators: dict) -> dict:
    row = {"row": "held-out text"}
    for ev_name, ev in evaluators.items():
        ppl = eval_stage.gen_ppl(eval_stage.sample_nlls(ev, [""] * len(texts), texts))
        row[f"gen_ppl_token_{ev_name}"], row[f"gen_ppl_mean_{ev_name}"] = ppl["gen_ppl_token"], ppl["gen_ppl_mean"]
    metrics = text_metrics(texts)
    row.update(
        {
            "token_entropy": token_entropy(ids),
            "diversity": metrics["diversity"],
            **{f"distinct_{n}": metrics[f"distinct_{n}"] for n in (1, 2, 3, 4)},
            "n_samples": len(texts),
            "mean_tokens": float(np.mean([len(i) for i in ids])),
        }
    )
    return row


def summarize(per_seed: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over seeds of every numeric column, one line per row (in first-seen order)."""
    numeric = [c for c in per_seed.columns if c not in ("row", "seed") and pd.api.types.is_numeric_dtype(per_seed[c])]
    grouped = per_seed.groupby("row", sort=False)[numeric]
    mean, std = grouped.mean(), grouped.std(ddof=1).fillna(0.0)
    out = mean.add_suffix("_mean").join(std.add_suffix("_std"))
    out.insert(0, "seeds", per_seed.groupby("row", sort=False)["seed"].count())
    return out.reset_index()


def plot(summary: pd.DataFrame, path, evaluator: str) -> None:
    fig, ax = plotting.figure(8, 5)
    x, xerr = summary[f"gen_ppl_token_{evaluator}_mean"], summary[f"gen_ppl_token_{evaluator}_std"]
    y, yerr = summary["diversity_mean"], summary["diversity_std"]
    ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt="o", capsize=3)
    for xi, yi, label in zip(x, y, summary["row"]):
        ax.annotate(label, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(f"Gen.PPL (token-weighted) under {evaluator}, lower is better")
    ax.set_ylabel("diversity (higher is better)")
    plotting.save(fig, ax, path, "continuous diffusion LMs vs hidden-state recovery (mean +- std over seeds)")


def run(
    cfg: CompareConfig,
    extract: Artifact,
    score_art: Artifact,
    store: ArtifactStore,
    load_model,
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Artifact:
    """load_model(spec) -> LoadedModel, called only when there is work to do."""
    progress = progress or NullProgress()
    if score_art.manifest.get("parents", {}).get("extract") != extract.id:
        raise DihalError(f"score {score_art.id} was not made from extract {extract.id}; pass its own --score")
    l_star, worst = layers_from_score(score_art, cfg)
    needed = {0, l_star, worst} | ({cfg.oracle} if cfg.oracle else set())
    hs.open_with_layers(extract, needed, ": compare needs layers 0, l*, argmin S (and the oracle)")
    backbone = extract.config["model"]
    config = {
        **asdict(cfg),
        "l_star": l_star,
        "worst": worst,
        "evaluator": eval_stage.second_evaluator(cfg.evaluator, backbone),
        "revision": gen_stage.REVISION,  # its AR rows are unprompted hybrid generations
    }
    parents = {"extract": extract.id, "score": score_art.id}
    if cached := store.cached(STAGE, config, parents, force=force):
        return cached
    with store.writing(
        STAGE, config, parents, force=force, device=cfg.device, extra={"model": extract.manifest.get("model")}
    ) as art:
        clock = time.time()
        loaded = load_model(backbone)
        evaluators = {"backbone": loaded, "evaluator": load_model(config["evaluator"])}
        texts, ids = held_out_texts(extract, loaded, cfg.num_samples)
        real = real_text_row(texts, ids, evaluators)  # the same held-out text for every seed: scored once
        per_seed, parts_table = [], []
        for seed in cfg.seeds:
            parts = train_parts(cfg, extract, store, seed, l_star, worst, progress)
            parts_table += [{"seed": seed, **part_row(name, a)} for name, a in parts.items()]
            gens = generate_rows(cfg, parts, store, loaded, seed, l_star, worst, progress)
            rows = score_rows(gens, evaluators, store, cfg) + [real]
            per_seed += [{"seed": seed, **r} for r in rows]
        per_seed_df, parts_df = pd.DataFrame(per_seed), pd.DataFrame(parts_table)
        summary = summarize(per_seed_df)
        per_seed_df.to_csv(art.file("per_seed.csv"), index=False)
        summary.to_csv(art.file("compare.csv"), index=False)
        summary.to_parquet(art.file("compare.parquet"), index=False)
        parts_df.to_csv(art.file("parts.csv"), index=False)
        result = {
            "l_star": l_star,
            "argmin_S": worst,
            "oracle": cfg.oracle,
            "evaluators": {"backbone": backbone, "evaluator": config["evaluator"]},
            "seeds": list(cfg.seeds),
            "rows": summary.to_dict("records"),
            "parts": parts_df.to_dict("records"),
            "wall_seconds": time.time() - clock,
        }
        art.file("compare.json").write_text(json.dumps(result, indent=2, default=float))
        plot(summary, art.file("compare.png"), "backbone")
        art.manifest["metrics"] = {k: v for k, v in result.items() if k not in ("rows", "parts")}
    return art
