"""`dihal confirm`: METHOD §4, claim 4 -- fully trained, does the geometry-chosen
layer stay competitive with the oracle, and ahead of the worst layer?

From a sweep it takes l*, the oracle and the worst layer (or layers named by number), trains a
bridge at each under a full protocol for every seed, and measures per bridge: fidelity (top-1
agreement, KL, perplexity ratio at one Euler step count) and the AR hybrid's generations (Gen.PPL
under the backbone and under a second evaluator, diversity, token entropy). The table is the mean
and std over seeds per layer. Every part is an ordinary artifact, reused when it is in the store.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict

import pandas as pd

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, Job
from dihal.stages import evaluate as eval_stage
from dihal.stages import generate as gen_stage
from dihal.stages import train_bridge as bridge_stage
from dihal.stages.configs import CONFIRM_NAMED, ConfirmConfig, gpu_key
from dihal.stages.lineage import check_weights, origin
from dihal.stages.lm.models import weights_digests
from dihal.stages.runtime import dist
from dihal.stages.runtime.progress import NullProgress, Progress

STAGE = "confirm"
CACHE_VERSION = 1  # bump whenever this stage's bytes change (tests/test_golden.py says when)


def resolve_layers(cfg: ConfirmConfig, sweep_art: Artifact) -> dict[int, str]:
    """{layer: label}; a layer named twice (l* = oracle) is trained once, under a joined label."""
    summary = sweep_art.manifest["metrics"]
    out: dict[int, list[str]] = {}
    for name in cfg.at:
        layer = int(summary[CONFIRM_NAMED[name]]) if name in CONFIRM_NAMED else int(name)
        out.setdefault(layer, []).append(name if name in CONFIRM_NAMED else f"layer {name}")
    return {layer: "=".join(names) for layer, names in out.items()}


def run(
    cfg: ConfirmConfig,
    sweep_art: Artifact,
    extract: Artifact,
    store: ArtifactStore,
    load_model,
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Artifact:
    """load_model(spec) -> LoadedModel, called only when there is work to do."""
    progress = progress or NullProgress()
    if sweep_art.manifest["parents"]["extract"] != extract.id:
        raise DihalError(f"sweep {sweep_art.id} was not made from extract {extract.id}")
    layers = resolve_layers(cfg, sweep_art)
    backbone = extract.config["model"]
    config = {
        **asdict(cfg),
        "layers": layers,
        "evaluator": eval_stage.second_evaluator(cfg.evaluator, backbone),
        "generate_version": gen_stage.CACHE_VERSION,  # its generations are unprompted hybrid ones
        "bridge_version": bridge_stage.CACHE_VERSION,  # and its bridges' computation
        **gpu_key(cfg.device),
        **gen_stage.noise_key(),  # and their bridge noise, where it is not the 1 of every id before it
    }
    config.update(weights_digests(evaluator=config["evaluator"]))  # a local evaluator by its files
    parents = {"sweep": sweep_art.id, "extract": extract.id}
    seq_len = origin(extract).seq_len

    def work(art: Artifact) -> None:
        check_weights(extract)  # its bridges train on the extract's states and run under this backbone
        model = functools.cache(load_model)
        evaluators = {"backbone": backbone, "evaluator": config["evaluator"]}
        units = [(layer, seed) for layer in layers for seed in cfg.seeds]

        def run_one(unit: tuple[int, int], inner: Progress) -> dict:
            """One unit (dist.share): the bridge of (layer, seed), its fidelity, generations and their scores."""
            layer, seed = unit
            bcfg = bridge_stage.BridgeConfig.for_run(
                cfg.protocol, cfg.overrides, seed=seed, device=cfg.device, dtype=cfg.dtype, layer=layer
            )
            bridge_art = bridge_stage.run(bcfg, extract, store, progress=inner)
            row = {"label": layers[layer], "layer": layer, "seed": seed}
            return row | measure(cfg, bridge_art, seed, seq_len, store, model, evaluators, inner)

        name = lambda u: f"{layers[u[0]]} (layer {u[0]}), seed {u[1]}: bridge under protocol {cfg.protocol}"
        rows = dist.share(units, run_one, name, progress=progress)
        if dist.distributed()[0] != 0:
            return
        per_seed = pd.DataFrame(rows)
        numeric = [c for c in per_seed.columns if c not in ("label", "layer", "seed")]
        grouped = per_seed.groupby(["label", "layer"], sort=False)[numeric]
        summary = grouped.mean().add_suffix("_mean").join(grouped.std(ddof=1).add_suffix("_std")).reset_index()
        summary.insert(2, "seeds", len(cfg.seeds))
        per_seed.to_csv(art.file("confirm_runs.csv"), index=False)
        summary.to_csv(art.file("confirm.csv"), index=False)
        result = {"layers": layers, "evaluator": config["evaluator"], "rows": summary.to_dict("records")}
        art.file("confirm.json").write_text(json.dumps(result, indent=2, default=float))
        art.manifest["metrics"] = {"layers": layers, "evaluator": config["evaluator"], "seeds": list(cfg.seeds)}

    extra = {"model": extract.manifest.get("model")}
    job = Job(STAGE, CACHE_VERSION, config, parents, work, device=cfg.device, extra=extra, every_rank=True)
    return store.run_stage(job, force=force, progress=progress, group=dist.group())  # units dealt (dist.deal)


def measure(
    cfg: ConfirmConfig, bridge_art: Artifact, seed: int, seq_len: int, store: ArtifactStore, model, evaluators, progress
) -> dict:
    """The bridge's fidelity, then its AR generations scored under each evaluator; models load only
    when an artifact is missing from the store."""
    fcfg = eval_stage.FidelityConfig(
        sample_steps=(cfg.sample_steps,), limit=cfg.eval_limit, seed=seed, device=cfg.device, dtype=cfg.dtype
    )
    fresh = not eval_stage.fidelity_cached(fcfg, bridge_art, store)
    fid = eval_stage.run_fidelity(fcfg, bridge_art, store, loaded=model(evaluators["backbone"]) if fresh else None)
    fid = fid.manifest["metrics"]["fidelity"][0]
    gcfg = gen_stage.GenerateConfig(
        num_samples=cfg.num_samples,
        max_new_tokens=seq_len - 1,
        sample_steps=cfg.sample_steps,
        batch_size=cfg.batch_size,
        seed=seed,
        device=cfg.device,
        dtype=cfg.dtype,
    )
    gen = gen_stage.run(gcfg, bridge_art, store, lambda: model(evaluators["backbone"]), progress=progress)
    row = {
        "val_loss": bridge_art.manifest["metrics"]["val_loss"],
        "top1_agreement": fid["top1_agreement"],
        "kl": fid["kl"],
        "ppl_ratio": fid["ppl_ratio"],
    }
    for name, spec in evaluators.items():
        scfg = eval_stage.SamplesConfig(evaluator=spec, limit=cfg.num_samples, device=cfg.device, dtype=cfg.dtype)
        fresh = not eval_stage.samples_cached(scfg, gen, store)
        res = eval_stage.run_samples(scfg, gen, store, loaded=model(spec) if fresh else None)
        metrics = res.manifest["metrics"]["rows"][0]
        row[f"gen_ppl_token_{name}"], row[f"gen_ppl_mean_{name}"] = metrics["gen_ppl_token"], metrics["gen_ppl_mean"]
        row.update({k: metrics[k] for k in ("diversity", "token_entropy", "distinct_2")})
    row["bridge_seconds"] = bridge_art.wall_seconds
    return row
