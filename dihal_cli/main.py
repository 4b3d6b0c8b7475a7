"""The `dihal` command: thin Typer wrappers, one per stage; all computation lives in stages/.

Every command builds its stage's config with keyword arguments (the config validates itself),
prints it and stops under --dry-run, or calls the stage's run() and reports what it made or
reused. Defaults come from the config classes, so each is written once.
"""

from __future__ import annotations

import json
import math
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import typer

from artifacts.errors import DihalError
from artifacts.store import ArtifactStore
from dihal_cli.ui import LOG_EVERY, console, fmt, human_size, make_progress, print_json, table, user_errors
from stages.compare import CompareConfig
from stages.confirm import ConfirmConfig
from stages.diffusion.trainer import precision_for
from stages.evaluate import FidelityConfig, SamplesConfig
from stages.extract import ExtractConfig
from stages.generate import GenerateConfig
from stages.score import ScoreConfig
from stages.sweep import SweepConfig
from stages.text.data import DataConfig

app = typer.Typer(
    help="dihal: locate where diffusion should enter a language model, then put it there. The method: docs/method.md.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
runs_app = typer.Typer(help="Inspect, verify and clean the artifact store.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")


def default(cls, name: str):
    """The one default of a config field."""
    return cls.__dataclass_fields__[name].default


def opt(cls, name: str, *flags: str, **kw):
    return typer.Option(default(cls, name), *(flags or ("--" + name.replace("_", "-"),)), **kw)


Root = typer.Option("runs", "--root", envvar="DIHAL_ROOT", help="Artifact root.")
Model = opt(ExtractConfig, "model", help="Builtin name, local directory, .gguf file, or hub id.")
Dataset = opt(DataConfig, "dataset", help="Builtin 'pydoc', local .txt/.jsonl/.json/.parquet files or glob, or hub id.")
SeqLen = opt(DataConfig, "seq_len")
MaxSeq = opt(DataConfig, "max_sequences")
StoreDtype = opt(ExtractConfig, "store_dtype", help="auto (float16 per layer where it fits), float16 or float32.")
Device = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")
Dtype = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16.")
Seed = typer.Option(0, "--seed")
Force = typer.Option(False, "--force", help="Recompute even when a complete artifact exists.")
DryRun = typer.Option(False, "--dry-run", help="Validate every argument, print the plan; load no weights or data.")
Trust = typer.Option(False, "--trust-remote-code", help="Allow code shipped with a model to run (read it first).")


def _version(value: bool) -> None:
    if value:
        try:
            console.print(f"dihal {version('dihal')}")
        except PackageNotFoundError:
            console.print("dihal 0+unknown")
        raise typer.Exit()


@app.callback()
def main(
    _: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
    cache_dir: str | None = typer.Option(
        None, "--cache-dir", envvar="DIHAL_CACHE", help="Converted models (default ~/.cache/dihal)."
    ),
    log_every: float = typer.Option(10.0, "--log-every", help="Seconds between progress lines in a piped log."),
) -> None:
    """Stages: extract -> score -> train-bridge -> evaluate / generate; sweep trains one bridge per layer."""
    from stages.lm.models import set_cache_dir

    if cache_dir:
        set_cache_dir(cache_dir)
    LOG_EVERY["seconds"] = log_every


# -- shared plumbing --------------------------------------------------------------------------------
def _device(device: str, dry_run: bool = False) -> str:
    """--device resolved; under torchrun each rank joins the process group and takes its own GPU."""
    import torch.distributed as dist

    from stages.lm.models import resolve_device

    device = resolve_device(device, check=not dry_run)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dry_run and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def _dtype(dtype: str, device: str) -> str:
    from stages.lm.models import dtype_name

    return dtype_name(dtype, device)


def _rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _dry(command: str, *configs) -> None:
    for cfg in configs:
        console.print(f"[yellow]dry run[/yellow] {command}: {cfg}", highlight=False, soft_wrap=True)


def _report(art) -> None:
    state = "cache hit" if art.reused else "done"
    console.print(f"[green]{state}[/green]: {art.stage} {art.id} -> {art.path}", highlight=False, soft_wrap=True)


def _extract_config(
    model, dataset, seq_len, max_sequences, layers, store_dtype, device, dtype, seed, trust_remote_code, **data
) -> ExtractConfig:
    return ExtractConfig(
        model=model,
        layers=layers,
        store_dtype=store_dtype,
        device=device,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        data=DataConfig(dataset=dataset, seq_len=seq_len, max_sequences=max_sequences, seed=seed, **data),
    )


def _extract_parent(store, ref: str | None, cfg: ExtractConfig):
    """The named extract, or run the extract stage now so the lineage stays explicit."""
    from stages import extract as ex

    return store.resolve(ref, "extract") if ref else ex.run(cfg, store, progress=make_progress())


# -- commands -------------------------------------------------------------------------------------------
@app.command()
@user_errors
def extract(
    model: str = Model,
    dataset: str = Dataset,
    dataset_config: str | None = opt(DataConfig, "dataset_config"),
    split: str = opt(DataConfig, "split", help="Hub split to stream."),
    text_field: str = opt(DataConfig, "text_field"),
    seq_len: int = SeqLen,
    val_fraction: float = opt(DataConfig, "val_fraction"),
    max_sequences: int | None = MaxSeq,
    layers: str = opt(ExtractConfig, "layers", help="all, a range 0-4, or a list 0,3,7."),
    store_dtype: str = StoreDtype,
    batch_size: int = opt(ExtractConfig, "batch_size", help="Sequences per forward pass and per Zarr chunk."),
    revision: str | None = opt(ExtractConfig, "revision"),
    score_pool: int = opt(ExtractConfig, "score_pool", help="Train positions kept apart for a fast score (0: none)."),
    device: str = Device,
    dtype: str = Dtype,
    seed: int = Seed,
    force: bool = Force,
    dry_run: bool = DryRun,
    trust_remote_code: bool = Trust,
    root: str = Root,
) -> None:
    """Per-layer hidden states -> chunked Zarr (docs/method.md, layer convention)."""
    from stages import extract as stage

    device = _device(device, dry_run)
    cfg = ExtractConfig(
        model=model,
        revision=revision,
        layers=layers,
        store_dtype=store_dtype,
        batch_size=batch_size,
        score_pool=score_pool,
        device=device,
        dtype=_dtype(dtype, device),
        trust_remote_code=trust_remote_code,
        data=DataConfig(
            dataset=dataset,
            dataset_config=dataset_config,
            split=split,
            text_field=text_field,
            seq_len=seq_len,
            val_fraction=val_fraction,
            max_sequences=max_sequences,
            seed=seed,
        ),
    )
    if dry_run:
        plan = stage.plan(cfg)
        span = f"{plan.layers[0]}..{plan.layers[-1]} ({len(plan.layers)})" if plan.layers else f"'{layers}' (unchecked)"
        console.print(
            f"model {plan.identity['name']}: {plan.num_blocks} blocks, width {plan.width}; layers {span}; "
            f"sequences {plan.n_sequences or 'all'}; estimated size {human_size(plan.bytes_estimate)}; "
            f"artifact {stage.STAGE}/{stage.artifact_id_for(cfg)}",
            highlight=False,
            soft_wrap=True,
        )
        return
    art = stage.run(cfg, ArtifactStore(root), force=force, progress=make_progress())
    if _rank0():
        _report(art)


@app.command()
@user_errors
def score(
    extract: str = typer.Option("latest", "--extract", help="Extract artifact: id, unique prefix or 'latest'."),
    tokens: int = opt(ScoreConfig, "tokens", help="n sampled token positions (same for every layer)."),
    k: int = opt(ScoreConfig, "k", help="Neighbours per point for m_curv (self included)."),
    eps_rel: float = opt(ScoreConfig, "eps_rel"),
    pairs: int = opt(ScoreConfig, "pairs", help="Random pairs for m_mono."),
    normalize: str = opt(ScoreConfig, "normalize", help="none, rms or standardize."),
    exclude_positions: str = opt(ScoreConfig, "exclude_positions", help="Comma list; '' keeps all."),
    candidates: str | None = opt(ScoreConfig, "candidates", help="Layers to rank (default 1..L-1)."),
    split: str = opt(ScoreConfig, "split"),
    bootstrap: int = opt(ScoreConfig, "bootstrap", help="B more draws of positions: spread of S, how often l*."),
    outlier_mads: float | None = opt(
        ScoreConfig, "outlier_mads", help="Also robust proxies without positions of outlier norm (e.g. 5)."
    ),
    seed: int = Seed,
    device: str = typer.Option("cpu", "--device"),
    force: bool = Force,
    dry_run: bool = DryRun,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    root: str = Root,
) -> None:
    """Geometry proxies per layer -> ranked table, scores.json and a plot (docs/method.md, locate)."""
    from stages import score as stage

    device = _device(device, dry_run)
    cfg = ScoreConfig(
        tokens=tokens,
        k=k,
        eps_rel=eps_rel,
        pairs=pairs,
        normalize=normalize,
        exclude_positions=exclude_positions,
        candidates=candidates,
        split=split,
        bootstrap=bootstrap,
        outlier_mads=outlier_mads,
        seed=seed,
        device=device,
    )
    if dry_run:
        return _dry("score", cfg)
    store = ArtifactStore(root)
    art = stage.run(
        cfg, store.resolve(extract, "extract"), store, force=force, progress=None if as_json else make_progress()
    )
    result = stage.load_table(art).sort_values("rank")
    if as_json:
        return print_json(
            {"id": art.id, "path": str(art.path), **art.manifest["metrics"], "table": result.to_dict("records")}
        )
    m = art.manifest["metrics"]
    cols = ["rank", "layer", "S", "m_curv", "m_mono", "k_hat", "participation_ratio", "entropy_rank", "mean_token_norm"]
    names = ["rank", "layer", "S", "m_curv", "m_mono", "k_hat", "PR", "erank", "|h|"]
    rows = [[r[c] for c in cols] for r in result.to_dict("records")]
    if bootstrap or outlier_mads is not None:  # the stability columns instead of the proxies, short
        view = {"layer": "{:.0f}", "S": "{:.3f}"}
        if bootstrap:
            view |= {"S_boot_std": "{:.2f}", "l_star_freq": "{:.0%}"}
        if outlier_mads is not None:
            view |= {"k_hat": "{:.2f}", "k_hat_robust": "{:.2f}", "n_outliers": "{:.0f}", "S_robust": "{:.3f}"}
            view |= {"rank_robust": "{:.0f}"}
        names = [STABILITY_NAMES[c] for c in view]
        rows = [[f.format(r[c]) for c, f in view.items()] for r in result.to_dict("records")]
    title = f"layer ranking (l* = {m['l_star']}"
    if bootstrap:
        title += f", l* in {m['l_star_frequency']:.0%} of {bootstrap} draws"
    if outlier_mads is not None:
        title += f"; robust l* = {m['l_star_robust']}"
    console.print(table(title + ")", names, rows, highlight_row=0))
    _report(art)


STABILITY_NAMES = {
    "layer": "layer",
    "S": "S",
    "S_boot_std": "S std",
    "l_star_freq": "l* freq",
    "k_hat": "k_hat",
    "k_hat_robust": "k rob",
    "n_outliers": "out",
    "S_robust": "S rob",
    "rank_robust": "rk rob",
}


@app.command("train-bridge")
@user_errors
def train_bridge(
    layer: int = typer.Option(..., "--layer", help="Replace embeddings + blocks 1..layer."),
    protocol: str = typer.Option(
        "cpu-small", "--protocol", help="cpu-small, sweep-tiny, compare-cpu or paper (every field overridable)."
    ),
    extract: str | None = typer.Option(
        None, "--extract", help="Extract holding layers 0 and --layer; omitted: run the extract stage now."
    ),
    model: str = Model,
    dataset: str = Dataset,
    max_sequences: int | None = MaxSeq,
    seq_len: int = SeqLen,
    store_dtype: str = StoreDtype,
    train_steps: int | None = typer.Option(None, "--train-steps", help="Optimizer steps (protocol's if omitted)."),
    epochs: int | None = typer.Option(None, "--epochs"),
    batch_size: int | None = typer.Option(None, "--batch-size"),
    lr: float | None = typer.Option(None, "--lr"),
    warmup: int | None = typer.Option(None, "--warmup"),
    ema: float | None = typer.Option(None, "--ema"),
    width: int | None = typer.Option(None, "--width"),
    depth: int | None = typer.Option(None, "--depth"),
    heads: int | None = typer.Option(None, "--heads"),
    eval_every: int | None = typer.Option(None, "--eval-every"),
    checkpoint_every: int | None = typer.Option(None, "--checkpoint-every"),
    prediction: str | None = typer.Option(None, "--prediction", help="x0 (default) or velocity."),
    skip_init: str | None = typer.Option(None, "--skip-init", help="ridge (default) or zero."),
    condition_noise: float | None = typer.Option(
        None, "--condition-noise", help="Train on c + sigma z, sigma ~ U(0, this) (default 0; 0.5 for the comparison)."
    ),
    device: str = Device,
    dtype: str = Dtype,
    seed: int = Seed,
    force: bool = Force,
    dry_run: bool = DryRun,
    trust_remote_code: bool = Trust,
    root: str = Root,
) -> None:
    """Train the conditional flow-matching bridge h_0 -> h_layer (docs/method.md, replace)."""
    from stages import bridge as stage
    from stages import extract as ex

    device = _device(device, dry_run)
    cfg = stage.BridgeConfig.from_protocol(
        layer,
        protocol,
        steps=train_steps,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        warmup=warmup,
        ema=ema,
        width=width,
        depth=depth,
        heads=heads,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        prediction=prediction,
        skip_init=skip_init,
        condition_noise=condition_noise,
        seed=seed,
        device=device,
        precision=precision_for(_dtype(dtype, device)),
    )
    ecfg = _extract_config(
        model,
        dataset,
        seq_len,
        max_sequences,
        f"0,{layer}",
        store_dtype,
        device,
        _dtype(dtype, device),
        seed,
        trust_remote_code,
    )
    if dry_run:
        if extract is None:
            ex.plan(ecfg)
        return _dry("train-bridge", cfg, *([] if extract else [ecfg]))
    store = ArtifactStore(root)
    art = stage.run(cfg, _extract_parent(store, extract, ecfg), store, force=force, progress=make_progress())
    m = art.manifest["metrics"]
    console.print(
        f"layer {layer}: validation bridge loss {m['val_loss']:.4f} after {m['steps']} steps "
        f"({m['train_tokens_per_s']:,.0f} tokens/s)"
    )
    _report(art)


@app.command()
@user_errors
def evaluate(
    bridge: str | None = typer.Option(None, "--bridge", help="Bridge artifact: fidelity, teacher forced."),
    samples: str | None = typer.Option(
        None, "--samples", help="Generate artifact: Gen.PPL, diversity (with --bridge: fidelity on it)."
    ),
    sample_steps: str = typer.Option(
        ",".join(map(str, default(FidelityConfig, "sample_steps"))),
        "--sample-steps",
        help="Bridge Euler steps to compare (fidelity).",
    ),
    limit: int = opt(FidelityConfig, "limit", help="Held-out sequences (fidelity) or samples to score."),
    dataset: str | None = opt(FidelityConfig, "dataset", help="Fidelity on this dataset spec instead (--bridge)."),
    evaluator: str | None = opt(SamplesConfig, "evaluator", help="Model for Gen.PPL (default: the backbone)."),
    batch_size: int = opt(FidelityConfig, "batch_size"),
    device: str = Device,
    dtype: str = Dtype,
    seed: int = Seed,
    force: bool = Force,
    dry_run: bool = DryRun,
    trust_remote_code: bool = Trust,
    as_json: bool = typer.Option(False, "--json"),
    root: str = Root,
) -> None:
    """Bridge fidelity (--bridge [--dataset | --samples]) or generation quality (--samples)."""
    from stages import evaluate as stage

    if dataset is not None and bridge is None:
        raise DihalError("--dataset measures a bridge's fidelity; give --bridge ID with it")
    if bridge is None and samples is None:
        raise DihalError("give --bridge ID (fidelity) or --samples ID (generation quality), or both")
    device = _device(device, dry_run)
    if bridge is not None:
        cfg = FidelityConfig(
            sample_steps=stage.parse_steps(sample_steps),
            limit=limit,
            batch_size=batch_size,
            seed=seed,
            dataset=dataset,
            device=device,
            dtype=_dtype(dtype, device),
        )
    else:
        cfg = SamplesConfig(
            evaluator=evaluator, limit=limit, batch_size=batch_size, device=device, dtype=_dtype(dtype, device)
        )
    if dry_run:
        return _dry("evaluate", cfg)
    store = ArtifactStore(root)
    if bridge is not None:
        on = store.resolve(samples, "generate") if samples else None
        art = stage.run_fidelity(
            cfg, store.resolve(bridge, "bridge"), store, force=force, trust_remote_code=trust_remote_code, samples=on
        )
        m = art.manifest["metrics"]
        rows, title = m["fidelity"], f"bridge fidelity, layer {m['layer']}, on {m.get('source', 'validation')}"
    else:
        art = stage.run_samples(
            cfg, store.resolve(samples, "generate"), store, force=force, trust_remote_code=trust_remote_code
        )
        rows, title = art.manifest["metrics"]["rows"], "generation quality"
    if as_json:
        return print_json({"id": art.id, "path": str(art.path), "results": rows})
    shown = FIDELITY_COLUMNS if bridge is not None else SAMPLES_COLUMNS  # short names: 80 columns hold them
    cols = [c for c in shown if c in rows[0]]
    console.print(table(title, [shown[c] for c in cols], [[r[c] for c in cols] for r in rows]))
    _report(art)


FIDELITY_COLUMNS = {
    "steps": "steps",
    "rel_recon_error": "rel err",
    "cosine": "cos",
    "kl": "KL",
    "top1_agreement": "top-1",
    "ppl_hybrid": "PPL hyb",
    "ppl_original": "PPL orig",
    "ppl_ratio": "ratio",
}
SAMPLES_COLUMNS = {
    "model": "model",
    "n_samples": "n",
    "gen_ppl_token": "Gen.PPL",
    "gen_ppl_mean": "per-sample",
    "token_entropy": "entropy",
    "diversity": "diversity",
    "distinct_2": "dist-2",
    "mean_tokens": "tokens",
}


@app.command()
@user_errors
def sweep(
    layers: str | None = typer.Option(None, "--layers", help="Layers to bridge, e.g. 1-29 or 1,3,5 (default 1..L-1)."),
    protocol: str = opt(SweepConfig, "protocol"),
    train_steps: int | None = typer.Option(
        None, "--train-steps", help="Override the protocol's steps for every layer."
    ),
    width: int | None = typer.Option(None, "--width"),
    depth: int | None = typer.Option(None, "--depth"),
    batch_size: int | None = typer.Option(None, "--batch-size"),
    extract: str | None = typer.Option(None, "--extract", help="Extract holding layer 0 and the swept layers."),
    score: str | None = typer.Option(None, "--score", help="Score artifact (default: score the extract now)."),
    tokens: int = opt(ScoreConfig, "tokens", help="Score sample size when scoring now."),
    bootstrap: int = opt(ScoreConfig, "bootstrap", help="Score draws behind each rho interval (scoring now)."),
    outlier_mads: float | None = opt(ScoreConfig, "outlier_mads", help="Also the robust proxies (scoring now)."),
    model: str = Model,
    dataset: str = Dataset,
    max_sequences: int | None = MaxSeq,
    seq_len: int = SeqLen,
    store_dtype: str = StoreDtype,
    sample_steps: int = opt(SweepConfig, "sample_steps", help="Bridge Euler steps for each layer's fidelity."),
    eval_limit: int = opt(SweepConfig, "eval_limit"),
    seeds: str = typer.Option(
        ",".join(map(str, default(SweepConfig, "seeds"))), "--seeds", help="A bridge per layer and seed, e.g. 0,1,2."
    ),
    device: str = Device,
    dtype: str = Dtype,
    seed: int = typer.Option(0, "--seed", help="Seed of the data split and the score's positions."),
    force: bool = Force,
    dry_run: bool = DryRun,
    trust_remote_code: bool = Trust,
    root: str = Root,
) -> None:
    """A bridge per layer under one protocol; Spearman rho between S and -validation loss."""
    from stages import extract as ex
    from stages import score as score_stage
    from stages import sweep as stage

    device = _device(device, dry_run)
    store = ArtifactStore(root)
    if layers is None:  # every candidate of this model: 1..L-1
        num_blocks = (
            int(stage.hs.open_group(store.resolve(extract, "extract").path / "hidden.zarr").attrs["num_blocks"])
            if extract
            else ex.model_config(model, trust_remote_code)[0].num_hidden_layers
        )
        layers = f"1-{num_blocks - 1}"
    layer_list = ex.parse_layers(layers, None)
    overrides = _overrides(steps=train_steps, width=width, depth=depth, batch_size=batch_size)
    cfg = SweepConfig(
        layers=tuple(layer_list),
        protocol=protocol,
        overrides=overrides,
        sample_steps=sample_steps,
        eval_limit=eval_limit,
        seeds=_seeds(seeds),
        device=device,
        dtype=_dtype(dtype, device),
    )
    ecfg = _extract_config(
        model,
        dataset,
        seq_len,
        max_sequences,
        "all",  # the score z-scores over every candidate 1..L-1, whichever layers are swept
        store_dtype,
        device,
        cfg.dtype,
        seed,
        trust_remote_code,
    )
    scfg = ScoreConfig(tokens=tokens, bootstrap=bootstrap, outlier_mads=outlier_mads, seed=seed, device=device)
    if dry_run:
        if extract is None:
            ex.plan(ecfg)
        return _dry("sweep", cfg, *([] if extract else [ecfg]), *([] if score else [scfg]))
    parent = _extract_parent(store, extract, ecfg)
    if score:
        score_art = store.resolve(score, "score")
    else:  # under torchrun rank 0 scores; the others then find it in the store
        if _rank0():
            score_art = score_stage.run(scfg, parent, store, progress=make_progress())
        _barrier()
        score_art = score_stage.run(scfg, parent, store)
    art = stage.run(
        cfg, parent, score_art, store, force=force, progress=make_progress(), trust_remote_code=trust_remote_code
    )
    if art is None:  # a rank other than 0 of a layer-sharded sweep: its bridges are in the store
        return
    result = stage.pd.read_csv(art.file("sweep.csv"))
    cols = ["layer", "S", "score_rank", "val_loss", "val_loss_std", "top1_agreement", "kl", "ppl_ratio"]
    names = ["layer", "S", "S rank", "val loss", "± std", "top-1", "KL", "ppl ratio"]
    m = art.manifest["metrics"]
    console.print(
        table(
            f"{protocol}, seeds {seeds}: l* = {m['l_star']}, oracle = {m['oracle_layer']} "
            f"({m['oracle_agreement']:.0%} of seeds agree), worst = {m['worst_layer']}",
            names,
            [[r[c] for c in cols] for r in result.to_dict("records")],
        )
    )
    lo, hi = m["shallow_window"]
    three = lambda x: "-" if x != x else f"{x:.3f}"  # noqa: E731  (NaN: not defined, e.g. depth given depth)
    interval = lambda r: "-" if r["rho_lo"] != r["rho_lo"] else f"{r['rho_lo']:.2f}..{r['rho_hi']:.2f}"  # noqa: E731
    rows = [
        [r["variant"], three(r["rho"]), interval(r)]
        + [three(r[c]) for c in ("rho_shallow", "kendall_tau", "partial_rho_given_depth")]
        for r in stage.pd.read_csv(art.file("variants.csv")).to_dict("records")
    ]
    console.print(
        table(
            f"which predictor ranks the layers by -loss (rho with its 95% interval; over the shallow "
            f"layers {lo}-{hi}; Kendall tau; partial rho given depth)",
            ["predictor", "rho", "95% CI", "shallow", "tau", "partial"],
            rows,
        )
    )
    _report(art)


def _overrides(**fields) -> tuple[tuple[str, object], ...]:
    """The protocol fields given on the command line, for every trained part alike."""
    return tuple((k, v) for k, v in fields.items() if v is not None)


def _seeds(spec: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise DihalError(f"cannot read --seeds '{spec}'; use a comma list like 0,1,2") from None


@app.command()
@user_errors
def generate(
    bridge: str | None = typer.Option(None, "--bridge", help="Bridge artifact: id, prefix or latest (ar: latest)."),
    mode: str = opt(GenerateConfig, "mode", help="ar: the hybrid, token by token; parallel: a prior's samples."),
    prior: str | None = typer.Option(None, "--prior", help="parallel: the prior artifact (dihal train-prior)."),
    recovery: str = opt(GenerateConfig, "recovery", help="parallel: rounding, decoder or hidden."),
    decoder: str | None = typer.Option(None, "--decoder", help="parallel, --recovery decoder: the decoder artifact."),
    prior_steps: int = opt(GenerateConfig, "prior_steps", help="parallel: Euler steps of the prior."),
    clamp: bool = typer.Option(False, "--clamp", help="parallel: Diffusion-LM clamping to token embeddings."),
    prompt: list[str] = typer.Option([], "--prompt", help="A prompt (repeatable); none: start from the start token."),
    prompts_file: str | None = typer.Option(None, "--prompts-file", help="One prompt per line."),
    num_samples: int = opt(GenerateConfig, "num_samples", help="Samples per prompt."),
    max_new_tokens: int = opt(GenerateConfig, "max_new_tokens"),
    temperature: float = opt(GenerateConfig, "temperature"),
    top_k: int = opt(GenerateConfig, "top_k"),
    top_p: float = opt(GenerateConfig, "top_p"),
    sample_steps: int = opt(GenerateConfig, "sample_steps", help="Bridge Euler steps per position."),
    batch_size: int = opt(GenerateConfig, "batch_size"),
    baseline: str = opt(GenerateConfig, "baseline", help="original: also sample the unmodified backbone."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Recompute every position each step (reference path)."),
    device: str = Device,
    dtype: str = Dtype,
    seed: int = Seed,
    force: bool = Force,
    dry_run: bool = DryRun,
    trust_remote_code: bool = Trust,
    root: str = Root,
) -> None:
    """Hybrid generation: bridge -> upper blocks -> LM head (docs/method.md, use)."""
    from stages import generate as stage
    from stages.evaluate import backbone_for

    prompts = list(prompt)
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise DihalError(f"prompts file '{prompts_file}' does not exist")
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if not lines:
            raise DihalError(f"prompts file '{prompts_file}' is empty; put one prompt per line")
        prompts += lines
    device = _device(device, dry_run)
    cfg = GenerateConfig(
        prompts=tuple(prompts),
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        sample_steps=sample_steps,
        batch_size=batch_size,
        mode=mode,
        baseline=baseline,
        cache=not no_cache,
        prior_steps=prior_steps,
        recovery=recovery,
        clamp=clamp,
        seed=seed,
        device=device,
        dtype=_dtype(dtype, device),
    )
    if dry_run:
        return _dry("generate", cfg)
    store = ArtifactStore(root)
    if mode == "parallel":
        if prior is None:
            raise DihalError("--mode parallel needs --prior ID (a `dihal train-prior` artifact)")
        if bridge is not None and decoder is not None:
            raise DihalError("give --bridge (recovery hidden) or --decoder (recovery decoder), not both")
        prior_art = store.resolve(prior, "prior")
        part = store.resolve(bridge, "bridge") if bridge else store.resolve(decoder, "decoder") if decoder else None
        load = lambda: backbone_for(prior_art, device, cfg.dtype, trust_remote_code)  # noqa: E731
        art = stage.run_parallel(cfg, prior_art, store, load, part, force=force, progress=make_progress())
        m = art.manifest["metrics"]
        console.print(
            f"{m['label']}: {m['ms_per_sample']:.1f} ms per sample ({m['prior_ms_per_sample']:.1f} prior, "
            f"{m['recovery_ms_per_sample']:.1f} recovery), {m['mean_tokens']:.1f} tokens",
            highlight=False,
        )
    else:
        bridge_art = store.resolve(bridge or "latest", "bridge")
        load = lambda: backbone_for(bridge_art, device, cfg.dtype, trust_remote_code)  # noqa: E731
        art = stage.run(cfg, bridge_art, store, load, force=force, progress=make_progress())
        for model_name, m in art.manifest["metrics"].items():
            console.print(
                f"{model_name}: {m['ms_per_token']:.1f} ms per token (batch step), {m['mean_tokens']:.1f} tokens"
            )
    for line in art.file("samples.jsonl").read_text().splitlines()[:3]:
        row = json.loads(line)
        console.print(f"[bold]{row['model']}[/bold] {row['prompt']!r} -> {row['text'][:200]!r}", highlight=False)
    _report(art)


# -- the store --------------------------------------------------------------------------------------------
@runs_app.command("list")
@user_errors
def runs_list(stage: str | None = typer.Option(None, "--stage"), root: str = Root) -> None:
    """Every artifact: stage, id, status, key parameters, created, size."""
    store = ArtifactStore(root)
    rows = []
    for art in store.all(stage):
        cfg = art.config
        keys = [f"{k}={cfg[k]}" for k in ("model", "layer", "layers", "protocol", "mode") if cfg.get(k) is not None]
        rows.append(
            [
                art.stage,
                art.id,
                art.status,
                " ".join(keys),
                art.manifest.get("created", "")[:16].replace("T", " "),
                human_size(art.manifest.get("size_bytes")),
            ]
        )
    console.print(
        table(f"artifacts under {store.root}", ["stage", "id", "status", "parameters", "created", "size"], rows)
    )


@runs_app.command("show")
@user_errors
def runs_show(ref: str, root: str = Root) -> None:
    """One artifact's manifest and its lineage."""
    store = ArtifactStore(root)
    art = store.resolve(ref)
    console.print_json(json.dumps(art.manifest, default=str))
    for parent in store.lineage(art):
        console.print(f"  <- {parent.stage} {parent.id} ({parent.status})")


@runs_app.command("latest")
@user_errors
def runs_latest(stage: str, root: str = Root) -> None:
    """Print the id of the newest complete artifact of STAGE (for scripts)."""
    print(ArtifactStore(root).resolve("latest", stage).id)


@runs_app.command("verify")
@user_errors
def runs_verify(
    ref: str | None = typer.Argument(None), all_: bool = typer.Option(False, "--all"), root: str = Root
) -> None:
    """Recompute every file's checksum against the manifest; exit 1 when anything is missing or altered."""
    store = ArtifactStore(root)
    if (ref is None) == (not all_):
        raise DihalError("give an artifact ID or --all")
    arts = [a for a in store.all() if a.complete] if all_ else [store.resolve(ref)]
    bad = 0
    for art in arts:
        problems = art.verify()
        bad += bool(problems)
        status = "ok" if not problems else f"{len(problems)} problem(s): " + "; ".join(problems[:5])
        console.print(f"{art.stage}/{art.id}: {status}", highlight=False, soft_wrap=True)
    console.print(f"{len(arts) - bad} of {len(arts)} artifacts verified")
    if bad:
        raise typer.Exit(1)


@runs_app.command("rm")
@user_errors
def runs_rm(
    ref: str, recursive: bool = typer.Option(False, "--recursive", help="Also remove its children."), root: str = Root
) -> None:
    """Remove one artifact (refused while others were made from it, unless --recursive)."""
    store = ArtifactStore(root)
    for art in store.remove(store.resolve(ref), recursive=recursive):
        console.print(f"removed {art.stage}/{art.id}")


@runs_app.command("gc")
@user_errors
def runs_gc(
    older_than: str = typer.Option("24h", "--older-than", help="Age such as 30m, 24h or 7d."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be removed."),
    root: str = Root,
) -> None:
    """Remove failed and incomplete artifacts older than --older-than (never one being written)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        seconds = float(older_than[:-1]) * units[older_than[-1]]
    except (KeyError, ValueError, IndexError):
        raise DihalError(f"cannot read --older-than '{older_than}'; use a number and s, m, h or d, like 24h") from None
    gone = ArtifactStore(root).collect_garbage(seconds, dry_run=dry_run)
    for art in gone:
        console.print(f"{'would remove' if dry_run else 'removed'} {art.stage}/{art.id} ({art.status})")
    console.print(f"{len(gone)} artifact(s) {'to remove' if dry_run else 'removed'}")


# -- the comparison (docs/method.md section 5) ----------------------------------------------------------------
def _parts_overrides(train_steps, epochs, batch_size, lr, width, heads) -> dict:
    return dict(steps=train_steps, epochs=epochs, batch_size=batch_size, lr=lr, width=width, heads=heads)


TrainSteps = typer.Option(None, "--train-steps", help="Optimizer steps (the protocol's if omitted).")
Protocol = typer.Option("compare-cpu", "--protocol", help="compare-cpu, cpu-small, sweep-tiny or paper.")
ExtractRef = typer.Option("latest", "--extract", help="Extract artifact holding layer 0 (and --layer).")


@app.command("train-prior")
@user_errors
def train_prior(
    layer: int = typer.Option(0, "--layer", help="0: normalized h_0 (the comparison's prior); l: h_l (DiHAL-direct)."),
    self_condition: bool = typer.Option(False, "--self-condition", help="SED's self-conditioning."),
    protocol: str = Protocol, extract: str = ExtractRef, train_steps: int | None = TrainSteps,
    epochs: int | None = typer.Option(None, "--epochs"), batch_size: int | None = typer.Option(None, "--batch-size"),
    lr: float | None = typer.Option(None, "--lr"), width: int | None = typer.Option(None, "--width"),
    depth: int | None = typer.Option(None, "--depth"), heads: int | None = typer.Option(None, "--heads"),
    device: str = Device, dtype: str = Dtype, seed: int = Seed, force: bool = Force, dry_run: bool = DryRun,
    root: str = Root,
) -> None:  # fmt: skip
    """Sequence diffusion prior over normalized states, positions 1..T-1 (docs/method.md section 5)."""
    from stages import prior as stage

    device = _device(device, dry_run)
    precision = precision_for(_dtype(dtype, device))
    cfg = stage.PriorConfig.from_protocol(
        layer,
        protocol,
        self_condition=self_condition,
        depth=depth,
        seed=seed,
        device=device,
        precision=precision,
        **_parts_overrides(train_steps, epochs, batch_size, lr, width, heads),
    )
    if dry_run:
        return _dry("train-prior", cfg)
    store = ArtifactStore(root)
    art = stage.run(cfg, store.resolve(extract, "extract"), store, force=force, progress=make_progress())
    m = art.manifest["metrics"]
    console.print(
        f"prior over layer {layer}: validation x0 loss {m['val_loss']:.4f} after {m['steps']} steps, "
        f"{m['parameters']:,} parameters"
    )
    _report(art)


@app.command("train-decoder")
@user_errors
def train_decoder(
    condition_noise: float = typer.Option(0.5, "--condition-noise", help="sigma_max of the corrupted conditions."),
    protocol: str = Protocol, extract: str = ExtractRef, train_steps: int | None = TrainSteps,
    epochs: int | None = typer.Option(None, "--epochs"), batch_size: int | None = typer.Option(None, "--batch-size"),
    lr: float | None = typer.Option(None, "--lr"), width: int | None = typer.Option(None, "--width"),
    heads: int | None = typer.Option(None, "--heads"),
    device: str = Device, dtype: str = Dtype, seed: int = Seed, force: bool = Force, dry_run: bool = DryRun,
    root: str = Root,
) -> None:  # fmt: skip
    """CoDAR's recovery: a causal decoder cross-attending to normalized h_0 (docs/method.md section 5)."""
    from stages import decoder as stage

    device = _device(device, dry_run)
    precision = precision_for(_dtype(dtype, device))
    cfg = stage.DecoderTrainConfig.from_protocol(
        protocol,
        condition_noise=condition_noise,
        seed=seed,
        device=device,
        precision=precision,
        **_parts_overrides(train_steps, epochs, batch_size, lr, width, heads),
    )
    if dry_run:
        return _dry("train-decoder", cfg)
    store = ArtifactStore(root)
    art = stage.run(cfg, store.resolve(extract, "extract"), store, force=force, progress=make_progress())
    m = art.manifest["metrics"]
    console.print(f"decoder: validation cross-entropy {m['val_loss']:.4f} after {m['steps']} steps")
    _report(art)


@app.command()
@user_errors
def compare(
    layer: int | None = typer.Option(None, "--layer", help="l* (default: the score's argmax S)."),
    oracle: int | None = typer.Option(None, "--oracle", help="A sweep's oracle layer: one more DiHAL row."),
    protocol: str = Protocol,
    seeds: str = typer.Option(
        ",".join(map(str, CompareConfig().seeds)), "--seeds", help="Comma list; each part is trained per seed."
    ),
    num_samples: int = opt(CompareConfig, "num_samples", help="Samples per row and seed."),
    prior_steps: int = opt(CompareConfig, "prior_steps"), sample_steps: int = opt(CompareConfig, "sample_steps"),
    condition_noise: float = opt(CompareConfig, "condition_noise"),
    train_steps: int | None = TrainSteps, width: int | None = typer.Option(None, "--width"),
    depth: int | None = typer.Option(None, "--depth", help="Of the priors and bridges (the decoder has depth 2)."),
    evaluator: str | None = typer.Option(None, "--evaluator", help="Second evaluator (default: the other builtin)."),
    extract: str | None = typer.Option(None, "--extract", help="Extract of every layer (omitted: extract now)."),
    score: str | None = typer.Option(None, "--score", help="Score of that extract (omitted: score now)."),
    tokens: int = opt(ScoreConfig, "tokens", help="Score sample size when scoring now."),
    model: str = Model, dataset: str = Dataset, max_sequences: int | None = MaxSeq, seq_len: int = SeqLen,
    store_dtype: str = StoreDtype, batch_size: int = opt(CompareConfig, "batch_size", help="Samples per batch."),
    device: str = Device, dtype: str = Dtype, force: bool = Force, dry_run: bool = DryRun,
    trust_remote_code: bool = Trust, root: str = Root,
) -> None:  # fmt: skip
    """Diffusion-LM, SED, CoDAR and DiHAL from one prior at a matched budget, with references (section 5)."""
    from stages import compare as stage
    from stages import score as score_stage
    from stages.lm.models import load_model

    device = _device(device, dry_run)
    seed_list = _seeds(seeds)
    cfg = stage.CompareConfig(
        layer=layer,
        oracle=oracle,
        protocol=protocol,
        seeds=seed_list,
        num_samples=num_samples,
        prior_steps=prior_steps,
        sample_steps=sample_steps,
        condition_noise=condition_noise,
        evaluator=evaluator,
        batch_size=batch_size,
        device=device,
        dtype=_dtype(dtype, device),
        overrides=_overrides(steps=train_steps, width=width, depth=depth),
    )
    stage.part_configs(cfg, seed_list[0], 1, 1)  # every part's recipe is valid before anything runs
    ecfg = _extract_config(
        model, dataset, seq_len, max_sequences, "all", store_dtype, device, cfg.dtype, 0, trust_remote_code
    )
    scfg = ScoreConfig(tokens=tokens, device=device)
    if dry_run:
        if extract is None:
            from stages.extract import plan

            plan(ecfg)
        return _dry("compare", cfg, *([] if extract else [ecfg]), *([] if score else [scfg]))
    store = ArtifactStore(root)
    parent = _extract_parent(store, extract, ecfg)
    score_art = (
        store.resolve(score, "score") if score else score_stage.run(scfg, parent, store, progress=make_progress())
    )
    load = lambda spec: load_model(spec, device, cfg.dtype, trust_remote_code=trust_remote_code)  # noqa: E731
    art = stage.run(cfg, parent, score_art, store, load, force=force, progress=make_progress())
    rows = json.loads(art.file("compare.json").read_text())["rows"]

    pm, m = _pm, art.manifest["metrics"]
    evaluators = [Path(m["evaluators"][k]).name[:12] for k in ("backbone", "evaluator")]
    names = ["row", *evaluators, "entropy", "diversity"]
    cells = [
        [
            r["row"],
            pm(r, "gen_ppl_token_backbone"),
            pm(r, "gen_ppl_token_evaluator"),
            pm(r, "token_entropy"),
            pm(r, "diversity"),
        ]
        for r in rows
    ]
    console.print(
        table(
            f"comparison, l* = {m['l_star']}, argmin S = {m['argmin_S']}, seeds {seeds}; "
            "Gen.PPL (token-weighted) under each evaluator",
            names,
            cells,
        )
    )
    _report(art)


def _pm(r: dict, key: str) -> str:
    """mean±std of a summary row over seeds (the mean alone for one seed), both to the same
    decimals: about three significant digits of the mean, whole numbers from 100 up."""
    mean, std = r[key + "_mean"], r[key + "_std"]
    if r["seeds"] <= 1 or mean != mean:
        return fmt(mean)
    decimals = 0 if abs(mean) >= 100 or mean == 0 else max(0, 2 - math.floor(math.log10(abs(mean))))
    return f"{mean:.{decimals}f}±{std:.{decimals}f}"


@app.command()
@user_errors
def confirm(
    sweep: str = typer.Option("latest", "--sweep", help="Sweep whose l*, oracle and worst layer to train fully."),
    protocol: str = opt(ConfirmConfig, "protocol", help="cpu-small, paper, ... (every field overridable)."),
    at: str = typer.Option(
        ",".join(default(ConfirmConfig, "at")), "--at", help="Comma list: l_star, oracle, worst or layer numbers."
    ),
    seeds: str = typer.Option(",".join(map(str, default(ConfirmConfig, "seeds"))), "--seeds"),
    train_steps: int | None = TrainSteps,
    width: int | None = typer.Option(None, "--width"),
    depth: int | None = typer.Option(None, "--depth"),
    train_batch: int | None = typer.Option(None, "--train-batch", help="Override the protocol's batch size."),
    sample_steps: int = opt(ConfirmConfig, "sample_steps", help="Bridge Euler steps (fidelity and generation)."),
    eval_limit: int = opt(ConfirmConfig, "eval_limit", help="Held-out sequences for fidelity."),
    num_samples: int = opt(ConfirmConfig, "num_samples", help="AR hybrid samples per layer and seed."),
    evaluator: str | None = opt(ConfirmConfig, "evaluator", help="Second evaluator (default: the other builtin)."),
    batch_size: int = opt(ConfirmConfig, "batch_size", help="Samples per generation batch."),
    device: str = Device, dtype: str = Dtype, force: bool = Force, dry_run: bool = DryRun,
    trust_remote_code: bool = Trust, root: str = Root,
) -> None:  # fmt: skip
    """Claim 4: l*, the oracle and the worst layer fully trained per seed; fidelity and generations."""
    from stages import confirm as stage
    from stages.lm.models import load_model

    device = _device(device, dry_run)
    cfg = ConfirmConfig(
        protocol=protocol,
        at=tuple(a.strip() for a in at.split(",") if a.strip()),
        seeds=_seeds(seeds),
        overrides=_overrides(steps=train_steps, width=width, depth=depth, batch_size=train_batch),
        sample_steps=sample_steps,
        eval_limit=eval_limit,
        num_samples=num_samples,
        evaluator=evaluator,
        batch_size=batch_size,
        device=device,
        dtype=_dtype(dtype, device),
    )
    if dry_run:
        return _dry("confirm", cfg)
    store = ArtifactStore(root)
    sweep_art = store.resolve(sweep, "sweep")
    extract = store.resolve(sweep_art.manifest["parents"]["extract"], "extract")
    load = lambda spec: load_model(spec, device, cfg.dtype, trust_remote_code=trust_remote_code)  # noqa: E731
    art = stage.run(cfg, sweep_art, extract, store, load, force=force, progress=make_progress())
    rows = json.loads(art.file("confirm.json").read_text())["rows"]
    ev = Path(art.manifest["metrics"]["evaluator"]).name[:16]
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
    for title, columns in parts.items():
        cells = [[f"{r['label']} ({r['layer']})"] + [_pm(r, k) for k in columns] for r in rows]
        console.print(table(f"claim 4 under {protocol}, seeds {seeds}: {title}", ["layer", *columns.values()], cells))
    _report(art)
