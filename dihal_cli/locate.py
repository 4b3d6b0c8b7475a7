"""Locate: `dihal extract`, `dihal score`, `dihal sweep` (METHOD §0, §1 and claim 1).

Each command: parse, build the config (which checks itself), print it under --dry-run, or run the
stage and print its table. The stage (and torch) is imported inside the command.
"""

from __future__ import annotations

import typer

from dihal.artifacts.store import ArtifactStore
from dihal.cli import options as o
from dihal.cli.options import default
from dihal.cli.tables import human_size, print_json, score_table, sweep_tables
from dihal.cli.ui import console, dry, make_progress, report
from dihal.stages.configs import BridgeConfig, DataConfig, ExtractConfig, ScoreConfig, SweepConfig


def extract_config(values: dict, device: str, dtype: str, layers: str) -> ExtractConfig:
    """The extract another command runs first when no --extract is given: its model and data options
    (the rest at their defaults)."""
    sources = o.data_sources(values["dataset"], values["mix"])
    data = DataConfig(**{k: values[k] for k in ("seq_len", "max_sequences", "seed")}, **sources)
    picked = {k: values[k] for k in ("model", "store_dtype", "trust_remote_code")}
    return ExtractConfig(**picked, layers=layers, device=device, dtype=dtype, data=data)


def extract_parent(store, ref: str | None, cfg: ExtractConfig):
    """The named extract, or run the extract stage now so the lineage stays explicit."""
    from dihal.stages import extract as stage

    return store.resolve(ref, "extract") if ref else stage.run(cfg, store, progress=make_progress())


@o.command()
def extract(
    ctx: typer.Context,
    model: str = o.Model,
    dataset: list[str] = o.Dataset,
    mix: str | None = o.Mix,
    dataset_config: str | None = o.opt(DataConfig, "dataset_config"),
    split: str = o.opt(DataConfig, "split", help="Hub split to stream."),
    text_field: str = o.opt(DataConfig, "text_field"),
    dolma_shards: int = o.opt(DataConfig, "dolma_shards", help="dolma: sources: shards chosen of each Dolma source."),
    shuffle_buffer: int = o.opt(DataConfig, "shuffle_buffer", help="dolma: sources: documents in the shuffle buffer."),
    seq_len: int = o.SeqLen,
    val_fraction: float = o.opt(DataConfig, "val_fraction"),
    max_sequences: int | None = o.MaxSeq,
    layers: str = o.opt(
        ExtractConfig, "layers", help="all, a range 0-4, a list 0,3,7, or none (token ids alone, for --states model)."
    ),
    store_dtype: str = o.StoreDtype,
    batch_size: int = o.opt(ExtractConfig, "batch_size", help="Sequences per forward pass and per Zarr chunk."),
    revision: str | None = o.opt(ExtractConfig, "revision"),
    score_pool: int = o.opt(ExtractConfig, "score_pool", help="Train positions kept apart for a fast score (0: none)."),
    keep: str = o.opt(
        ExtractConfig, "keep", help="layers, or pool: layers above 0 at the score's pool alone (for --states model)."
    ),
    device: str = o.Device,
    dtype: str = o.Dtype,
    seed: int = o.Seed,
    force: bool = o.Force,
    skip_disk_check: bool = typer.Option(
        False, "--skip-disk-check", help="Start even when the free space is less than the estimate."
    ),
    dry_run: bool = o.DryRun,
    trust_remote_code: bool = o.Trust,
    root: str = o.Root,
) -> None:
    """Per-layer hidden states -> chunked Zarr (METHOD §0)."""
    from dihal.stages import extract as stage

    device, dtype = o.device_and_dtype(device, dtype, dry_run)
    data = o.build(DataConfig, o.given(ctx), **o.data_sources(dataset, mix))
    cfg = o.build(ExtractConfig, o.given(ctx), data=data, device=device, dtype=dtype)
    if dry_run:
        plan = stage.plan(cfg, dry_run=True)
        stage.check_generated(stage.resolve_sources(cfg, ArtifactStore(root)).data, ArtifactStore(root))
        span = f"{plan.layers[0]}..{plan.layers[-1]} ({len(plan.layers)})" if plan.layers else f"'{layers}' (unchecked)"
        return console.print(
            f"model {plan.identity['name']}: {plan.num_blocks} blocks, width {plan.width}; layers {span}; "
            f"sequences {plan.n_sequences or 'all'}; estimated size {human_size(plan.bytes_estimate)}; "
            f"artifact {stage.STAGE}/{stage.artifact_id_for(cfg)}",
            highlight=False,
            soft_wrap=True,
        )
    art = stage.run(cfg, ArtifactStore(root), force=force, check_disk=not skip_disk_check, progress=make_progress())
    if o.rank0():
        report(art)


@o.command()
def score(
    ctx: typer.Context,
    extract: str = typer.Option("latest", "--extract", help="Extract artifact: id, unique prefix or 'latest'."),
    tokens: int = o.opt(ScoreConfig, "tokens", help="n sampled token positions (same for every layer)."),
    k: int = o.opt(ScoreConfig, "k", help="Neighbours per point for m_curv (self included)."),
    eps_rel: float = o.opt(ScoreConfig, "eps_rel"),
    pairs: int = o.opt(ScoreConfig, "pairs", help="Pairs for m_mono."),
    normalize: str = o.opt(ScoreConfig, "normalize", help="none, rms or standardize."),
    exclude_positions: str = o.opt(ScoreConfig, "exclude_positions", help="Comma list; '' keeps all."),
    candidates: str | None = o.opt(ScoreConfig, "candidates", help="Layers to rank (default 1..L-1)."),
    split: str = o.opt(ScoreConfig, "split"),
    bootstrap: int = o.opt(ScoreConfig, "bootstrap", help="B more draws of positions: spread of S, how often l*."),
    outlier_mads: float | None = o.opt(ScoreConfig, "outlier_mads", help="Also robust proxies without outliers (5)."),
    r2_penalty: str = o.opt(
        ScoreConfig, "r2_penalty", help="r2_token's ridge penalty: kfold (5-fold CV) or gcv (before)."
    ),
    select: str = o.opt(ScoreConfig, "select", help="Which pick is l*: S (the paper's) or r2_token (dihal's)."),
    proxies: str = o.opt(ScoreConfig, "proxies", help="all, or paper: the paper's alone (S in seconds, no r2_*)."),
    seed: int = o.Seed,
    device: str = o.opt(ScoreConfig, "device"),
    force: bool = o.Force,
    dry_run: bool = o.DryRun,
    as_json: bool = o.AsJson,
    root: str = o.Root,
) -> None:
    """Geometry proxies per layer -> ranked table, scores.json and a plot (METHOD §1)."""
    device, _ = o.device_and_dtype(device, "float32", dry_run)
    cfg = o.build(ScoreConfig, o.given(ctx), device=device)
    if dry_run:
        return dry("score", cfg)
    from dihal.stages import score as stage

    store = ArtifactStore(root)
    art = stage.run(
        cfg, store.resolve(extract, "extract"), store, force=force, progress=None if as_json else make_progress()
    )
    records = stage.load_table(art).sort_values("rank").to_dict("records")
    if as_json:
        return print_json({"id": art.id, "path": str(art.path), **art.manifest["metrics"], "table": records})
    console.print(score_table(records, art.manifest["metrics"], bootstrap, outlier_mads is not None))
    report(art)


@o.command()
@o.recipe_options()
def sweep(
    ctx: typer.Context,
    layers: str | None = typer.Option(None, "--layers", help="Layers to bridge, e.g. 1-29 or 1,3,5 (default 1..L-1)."),
    protocol: str = o.opt(SweepConfig, "protocol"),
    extract: str | None = typer.Option(None, "--extract", help="Extract holding layer 0 and the swept layers."),
    score: str | None = typer.Option(None, "--score", help="Score artifact (default: score the extract now)."),
    tokens: int = o.opt(ScoreConfig, "tokens", help="Score sample size when scoring now."),
    bootstrap: int = o.opt(ScoreConfig, "bootstrap", help="Score draws behind each rho interval (scoring now)."),
    outlier_mads: float | None = o.opt(ScoreConfig, "outlier_mads", help="Also the robust proxies (scoring now)."),
    model: str = o.Model,
    dataset: list[str] = o.Dataset,
    mix: str | None = o.Mix,
    max_sequences: int | None = o.MaxSeq,
    seq_len: int = o.SeqLen,
    store_dtype: str = o.StoreDtype,
    sample_steps: int = o.opt(SweepConfig, "sample_steps", help="Bridge Euler steps for each layer's fidelity."),
    eval_limit: int = o.opt(SweepConfig, "eval_limit"),
    seeds: str = o.opt(SweepConfig, "seeds", help="A bridge per layer and seed, e.g. 0,1,2."),
    skip_init: str = o.opt(BridgeConfig, "skip_init", help="Every bridge's skip A: ridge or zero."),
    states: str = o.opt(BridgeConfig, "states", help="Every bridge's h_l: store (read) or model (computed)."),
    device: str = o.Device,
    dtype: str = o.Dtype,
    seed: int = typer.Option(0, "--seed", help="Seed of the data split and the score's positions."),
    force: bool = o.Force,
    dry_run: bool = o.DryRun,
    trust_remote_code: bool = o.Trust,
    root: str = o.Root,
    recipe: tuple = (),
) -> None:
    """A bridge per layer under one protocol; Spearman rho between S and -validation loss."""
    from dihal.stages import extract as ex
    from dihal.stages import sweep as stage

    device, dtype = o.device_and_dtype(device, dtype, dry_run)
    store = ArtifactStore(root)
    if layers is None:  # every candidate of this model: 1..L-1
        layers = f"1-{stage.num_blocks(store.resolve(extract, 'extract') if extract else model, trust_remote_code) - 1}"
    layer_list = tuple(ex.parse_layers(layers, None))
    changed = {"skip_init": skip_init, "states": states}
    overrides = recipe + tuple((k, v) for k, v in changed.items() if v != default(BridgeConfig, k))
    resolved = dict(device=device, dtype=dtype)
    cfg = o.build(SweepConfig, o.given(ctx), layers=layer_list, overrides=overrides, seeds=o.seeds(seeds), **resolved)
    # S z-scores over every candidate, whichever are swept; bridges that compute h_l from a given score's extract
    # of the same backbone need only the token ids of their own (--layers none)
    ecfg = extract_config(o.given(ctx), device, dtype, "none" if states == "model" and score else "all")
    scfg = o.build(ScoreConfig, o.given(ctx), device=device)
    if extract is None:
        ex.check_planned(ecfg.data, tokens=None if score else scfg.tokens, why="every bridge's validation loss")
    if dry_run:
        if extract is None:
            ex.plan(ecfg, dry_run=True)
        return dry("sweep", cfg, *([] if extract else [ecfg]), *([] if score else [scfg]))
    parent = extract_parent(store, extract, ecfg)
    score_art = store.resolve(score, "score") if score else stage.score_once(scfg, parent, store, make_progress())
    art = stage.run(
        cfg, parent, score_art, store, force=force, progress=make_progress(), trust_remote_code=trust_remote_code
    )
    if not o.rank0():  # a rank other than 0 of a layer-sharded sweep: its bridges are in the store
        return
    per_layer, variants = stage.tables(art)
    for out in sweep_tables(per_layer, variants, art.manifest["metrics"], protocol, seeds):
        console.print(out)
    report(art)
