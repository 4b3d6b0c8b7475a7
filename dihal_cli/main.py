"""The `dihal` command: thin Typer wrappers, one per stage; all computation lives in stages/."""
from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import typer

from artifacts.store import ArtifactStore
from dihal_cli.ui import RichProgress, console, human_size, print_json, table, user_errors

app = typer.Typer(help="dihal: locate where diffusion should enter a language model, then put it there.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
runs_app = typer.Typer(help="Inspect the artifact store.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")

Root = typer.Option(None, "--root", envvar="DIHAL_ROOT", help="Artifact root (default ./runs).")
Model = typer.Option("smollm2-135m", "--model", help="Builtin name, local directory, .gguf file, or hub id.")
Device = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")
Dtype = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16.")
Seed = typer.Option(0, "--seed")
Force = typer.Option(False, "--force", help="Recompute even when a complete artifact exists.")


def _version(value: bool) -> None:
    if value:
        try:
            console.print(f"dihal {version('dihal')}")
        except PackageNotFoundError:
            console.print("dihal 0+unknown")
        raise typer.Exit()


@app.callback()
def main(_: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version.")) -> None:
    """Stages: extract -> score -> train-bridge -> evaluate / generate; sweep trains one bridge per layer."""


def _dry_run(command: str, cfg) -> bool:
    """DIHAL_DRY_RUN=1: validate arguments, print the resolved config, touch no weights or data."""
    if os.environ.get("DIHAL_DRY_RUN") != "1":
        return False
    console.print(f"[yellow]dry run[/yellow] {command}: {cfg}", highlight=False)
    return True


def _report(art, cached: bool) -> None:
    state = "cache hit" if cached else "done"
    console.print(f"[green]{state}[/green]: {art.stage} {art.id} -> {art.path}")


@app.command()
@user_errors
def extract(
    model: str = Model,
    dataset: str = typer.Option("pydoc", "--dataset", help="Builtin 'pydoc', local .txt/.jsonl/.json/.parquet files or glob, or hub id."),
    dataset_config: Optional[str] = typer.Option(None, "--dataset-config"),
    split: str = typer.Option("train", "--split", help="Hub split to stream."),
    text_field: str = typer.Option("text", "--text-field"),
    seq_len: int = typer.Option(64, "--seq-len"),
    val_fraction: float = typer.Option(0.1, "--val-fraction"),
    max_sequences: Optional[int] = typer.Option(None, "--max-sequences"),
    layers: str = typer.Option("all", "--layers", help="all, a range 0-4, or a list 0,3,7."),
    store_dtype: str = typer.Option("float16", "--store-dtype"),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward pass and per Zarr chunk."),
    revision: Optional[str] = typer.Option(None, "--revision"),
    device: str = Device, dtype: str = Dtype, seed: int = Seed, force: bool = Force,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and validate arguments; load no weights."),
    root: Optional[str] = Root,
) -> None:
    """Per-layer hidden states -> chunked Zarr (METHOD.md section 0)."""
    from stages import extract as stage
    from stages.lm.models import dtype_name, resolve_device

    device = resolve_device(device)
    cfg = stage.ExtractConfig(model, revision, dataset, dataset_config, split, text_field, seq_len, val_fraction,
                              max_sequences, layers, store_dtype, batch_size, device, dtype_name(dtype, device), seed)
    store = ArtifactStore(root)
    if dry_run or os.environ.get("DIHAL_DRY_RUN") == "1":
        plan = stage.plan(cfg)
        span = f"{plan.layers[0]}..{plan.layers[-1]} ({len(plan.layers)})" if plan.layers else f"'{layers}' (unchecked)"
        console.print(f"model {plan.identity['name']}: {plan.num_blocks} blocks, width {plan.width}; layers {span}; "
                      f"sequences {plan.n_sequences or 'all'}; estimated size {human_size(plan.bytes_estimate)}; "
                      f"artifact {stage.STAGE}/{stage.artifact_id_for(cfg)}")
        return
    cached = store.cached(stage.STAGE, stage.resolved_config(cfg), {})
    art = stage.run(cfg, store, force=force, progress=RichProgress())
    if int(os.environ.get("RANK", 0)) == 0:
        _report(art, cached is not None and not force)


@runs_app.command("list")
@user_errors
def runs_list(stage: Optional[str] = typer.Option(None, "--stage"), root: Optional[str] = Root) -> None:
    """Every artifact: stage, id, status, key parameters, created, size."""
    store = ArtifactStore(root)
    rows = []
    for art in store.all(stage):
        cfg = art.config
        keys = [f"{k}={cfg[k]}" for k in ("model", "layer", "layers", "protocol", "mode") if cfg.get(k) is not None]
        rows.append([art.stage, art.id, art.status, " ".join(keys), art.manifest.get("created", "")[:19].replace("T", " "),
                     human_size(art.manifest.get("size_bytes"))])
    console.print(table(f"artifacts under {store.root}", ["stage", "id", "status", "parameters", "created", "size"], rows))


@runs_app.command("show")
@user_errors
def runs_show(ref: str, root: Optional[str] = Root) -> None:
    """One artifact's manifest and its lineage."""
    import json

    store = ArtifactStore(root)
    art = store.resolve(ref)
    console.print_json(json.dumps(art.manifest, default=str))
    for parent in store.lineage(art):
        console.print(f"  <- {parent.stage} {parent.id} ({parent.status})")


@app.command()
@user_errors
def score(
    extract: str = typer.Option("latest", "--extract", help="Extract artifact: id, unique prefix or 'latest'."),
    tokens: int = typer.Option(4096, "--tokens", help="n sampled token positions (same for every layer)."),
    k: int = typer.Option(64, "--k", help="Neighbours per point for m_curv (self included)."),
    eps_rel: float = typer.Option(1e-3, "--eps-rel"),
    pairs: int = typer.Option(8192, "--pairs", help="Random pairs for m_mono."),
    normalize: str = typer.Option("none", "--normalize", help="none, rms or standardize."),
    exclude_positions: str = typer.Option("0", "--exclude-positions", help="Comma list; '' keeps all."),
    candidates: Optional[str] = typer.Option(None, "--candidates", help="Layers to rank (default 1..L-1)."),
    split: str = typer.Option("train", "--split"),
    seed: int = Seed, device: str = typer.Option("cpu", "--device"), force: bool = Force,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a table."),
    root: Optional[str] = Root,
) -> None:
    """Geometry proxies per layer -> ranked table, scores.json and a plot (METHOD.md section 1)."""
    from stages import score as stage
    from stages.lm.models import resolve_device

    cfg = stage.ScoreConfig(tokens, k, eps_rel, pairs, normalize, exclude_positions, candidates, split, seed,
                            resolve_device(device))
    stage.validate(cfg)
    if _dry_run("score", cfg):
        return
    store = ArtifactStore(root)
    parent = store.resolve(extract, "extract")
    art = stage.run(cfg, parent, store, force=force, progress=None if as_json else RichProgress())
    result = stage.load_table(art).sort_values("rank")
    if as_json:
        print_json({"id": art.id, "path": str(art.path), **art.manifest["metrics"], "table": result.to_dict("records")})
        return
    cols = ["rank", "layer", "S", "m_curv", "m_mono", "k_hat", "participation_ratio", "entropy_rank", "mean_token_norm"]
    names = ["rank", "layer", "S", "m_curv", "m_mono", "k_hat", "PR", "erank", "|h|"]
    l_star = art.manifest["metrics"]["l_star"]
    rows = [[r[c] for c in cols] for r in result.to_dict("records")]
    console.print(table(f"layer ranking (l* = {l_star})", names, rows, highlight_row=0))
    _report(art, False)


def _extract_parent(store, extract_ref, layers, model, dataset, max_sequences, seq_len, device, dtype, seed,
                    store_dtype="float16"):
    """The named extract, or run the extract stage now so the lineage stays explicit."""
    from stages import extract as ex
    from stages.lm.models import dtype_name, resolve_device

    if extract_ref:
        return store.resolve(extract_ref, "extract")
    device = resolve_device(device)
    cfg = ex.ExtractConfig(model=model, dataset=dataset, seq_len=seq_len, max_sequences=max_sequences, layers=layers,
                           store_dtype=store_dtype, device=device, dtype=dtype_name(dtype, device), seed=seed)
    return ex.run(cfg, store, progress=RichProgress())


@app.command("train-bridge")
@user_errors
def train_bridge(
    layer: int = typer.Option(..., "--layer", help="Replace embeddings + blocks 1..layer."),
    protocol: str = typer.Option("cpu-small", "--protocol", help="cpu-small, sweep-tiny or paper."),
    extract: Optional[str] = typer.Option(None, "--extract", help="Extract id/prefix/latest holding layers 0 and L; "
                                                                    "omitted: run the extract stage now."),
    model: str = Model, dataset: str = typer.Option("pydoc", "--dataset"),
    max_sequences: Optional[int] = typer.Option(None, "--max-sequences"), seq_len: int = typer.Option(64, "--seq-len"),
    store_dtype: str = typer.Option("float16", "--store-dtype", help="Of the extract run now (float32 for Gemma 3)."),
    steps: Optional[int] = typer.Option(None, "--steps"), epochs: Optional[int] = typer.Option(None, "--epochs"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"), lr: Optional[float] = typer.Option(None, "--lr"),
    warmup: Optional[int] = typer.Option(None, "--warmup"), ema: Optional[float] = typer.Option(None, "--ema"),
    width: Optional[int] = typer.Option(None, "--width"), depth: Optional[int] = typer.Option(None, "--depth"),
    heads: Optional[int] = typer.Option(None, "--heads"), eval_every: Optional[int] = typer.Option(None, "--eval-every"),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every"),
    prediction: Optional[str] = typer.Option(None, "--prediction", help="x0 (default) or velocity."),
    skip_init: Optional[str] = typer.Option(None, "--skip-init", help="ridge (default) or zero."),
    device: str = Device, dtype: str = Dtype, seed: int = Seed, force: bool = Force, root: Optional[str] = Root,
) -> None:
    """Train the conditional flow-matching bridge h_0 -> h_layer (METHOD.md section 2)."""
    from stages import bridge as stage
    from stages.lm.models import resolve_device

    store = ArtifactStore(root)
    device = resolve_device(device)
    overrides = dict(steps=steps, epochs=epochs, batch_size=batch_size, lr=lr, warmup=warmup, ema=ema, width=width,
                     depth=depth, heads=heads, eval_every=eval_every, checkpoint_every=checkpoint_every, prediction=prediction, skip_init=skip_init,
                     seed=seed, device=device)
    if epochs is not None and steps is None:
        overrides["steps"] = None
    cfg = stage.resolve_config(layer, protocol, overrides)
    if _dry_run("train-bridge", cfg):
        return
    parent = _extract_parent(store, extract, f"0,{layer}", model, dataset, max_sequences, seq_len, device, dtype, seed,
                             store_dtype)
    cached = store.cached(stage.STAGE, stage.config_dict(cfg), {"extract": parent.id})
    art = stage.run(cfg, parent, store, force=force, progress=RichProgress())
    metrics = art.manifest["metrics"]
    console.print(f"layer {layer}: validation bridge loss {metrics['val_loss']:.4f} after {metrics['steps']} steps "
                  f"({metrics['train_tokens_per_s']:,.0f} tokens/s)")
    _report(art, cached is not None and not force)


@app.command()
@user_errors
def evaluate(
    bridge: Optional[str] = typer.Option(None, "--bridge", help="Bridge artifact: fidelity, teacher forced."),
    samples: Optional[str] = typer.Option(None, "--samples", help="Generate artifact: Gen.PPL and diversity."),
    steps: str = typer.Option("1,4,8,16", "--steps", help="Sampling steps to compare (fidelity)."),
    limit: int = typer.Option(64, "--limit", help="Held-out sequences (fidelity) or samples to score."),
    evaluator: Optional[str] = typer.Option(None, "--evaluator", help="Model spec for Gen.PPL (default: the backbone)."),
    batch_size: int = typer.Option(16, "--batch-size"),
    device: str = Device, dtype: str = Dtype, seed: int = Seed, force: bool = Force,
    as_json: bool = typer.Option(False, "--json"), root: Optional[str] = Root,
) -> None:
    """Bridge fidelity (--bridge) or generation quality (--samples); results JSON + table."""
    from artifacts.errors import DihalError
    from stages import evaluate as stage
    from stages.lm.models import dtype_name, resolve_device

    if (bridge is None) == (samples is None):
        raise DihalError("give exactly one of --bridge ID (fidelity) or --samples ID (generation quality)")
    store = ArtifactStore(root)
    device = resolve_device(device)
    if bridge is not None:
        cfg = stage.FidelityConfig(stage.parse_steps(steps), limit, batch_size, seed, device, dtype_name(dtype, device))
        if _dry_run("evaluate", cfg):
            return
        art = stage.run_fidelity(cfg, store.resolve(bridge, "bridge"), store, force=force)
        rows = art.manifest["metrics"]["fidelity"]
        title = f"bridge fidelity, layer {art.manifest['metrics']['layer']}"
    else:
        cfg = stage.SamplesConfig(evaluator, limit, batch_size, device, dtype_name(dtype, device))
        if _dry_run("evaluate", cfg):
            return
        art = stage.run_samples(cfg, store.resolve(samples, "generate"), store, force=force)
        rows = art.manifest["metrics"]["rows"]
        title = "generation quality"
    if as_json:
        print_json({"id": art.id, "path": str(art.path), "results": rows})
        return
    cols = list(rows[0])
    console.print(table(title, cols, [[r[c] for c in cols] for r in rows]))
    _report(art, False)


@app.command()
@user_errors
def sweep(
    layers: str = typer.Option("1-29", "--layers", help="Layers to bridge, e.g. 1-29 or 1,3,5."),
    protocol: str = typer.Option("sweep-tiny", "--protocol"),
    steps: Optional[int] = typer.Option(None, "--steps", help="Override the protocol's steps for every layer."),
    width: Optional[int] = typer.Option(None, "--width"), depth: Optional[int] = typer.Option(None, "--depth"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    extract: Optional[str] = typer.Option(None, "--extract", help="Extract holding layer 0 and the swept layers."),
    score: Optional[str] = typer.Option(None, "--score", help="Score artifact (default: score the extract now)."),
    tokens: int = typer.Option(4096, "--tokens", help="Score sample size when scoring now."),
    model: str = Model, dataset: str = typer.Option("pydoc", "--dataset"),
    max_sequences: Optional[int] = typer.Option(None, "--max-sequences"), seq_len: int = typer.Option(64, "--seq-len"),
    eval_steps: int = typer.Option(8, "--eval-steps"), eval_limit: int = typer.Option(32, "--eval-limit"),
    device: str = Device, dtype: str = Dtype, seed: int = Seed, force: bool = Force, root: Optional[str] = Root,
) -> None:
    """A bridge per layer under one protocol; Spearman rho between S and -validation loss."""
    from stages import score as score_stage
    from stages import sweep as stage
    from stages.extract import parse_layers
    from stages.lm.models import dtype_name, resolve_device

    store = ArtifactStore(root)
    device = resolve_device(device)
    layer_list = parse_layers(layers, 10**6)
    from stages.bridge import resolve_config

    overrides = tuple((k, v) for k, v in (("steps", steps), ("width", width), ("depth", depth),
                                          ("batch_size", batch_size)) if v is not None)
    resolve_config(max(layer_list), protocol, dict(overrides))
    if _dry_run("sweep", (layer_list, protocol, overrides)):
        return
    parent = _extract_parent(store, extract, "0," + ",".join(map(str, layer_list)), model, dataset, max_sequences,
                             seq_len, device, dtype, seed)
    if score:
        score_art = store.resolve(score, "score")
    else:
        scfg = score_stage.ScoreConfig(tokens=tokens, candidates=",".join(map(str, layer_list)), seed=seed, device=device)
        score_art = score_stage.run(scfg, parent, store, progress=RichProgress())
    cfg = stage.SweepConfig(tuple(layer_list), protocol, overrides, eval_steps, eval_limit, seed, device,
                            dtype_name(dtype, device))
    art = stage.run(cfg, parent, score_art, store, force=force, progress=RichProgress())
    result = stage.pd.read_csv(art.file("sweep.csv"))
    cols = ["layer", "S", "score_rank", "val_loss", "top1_agreement", "kl", "ppl_ratio", "rel_recon_error"]
    m = art.manifest["metrics"]
    console.print(table(f"sweep ({protocol}): rho = {m['spearman_rho']:.3f} (p = {m['p_value']:.2g}), "
                        f"l* = {m['l_star']}, oracle = {m['oracle_layer']}, worst = {m['worst_layer']}",
                        cols, [[r[c] for c in cols] for r in result.to_dict("records")]))
    _report(art, False)


@app.command()
@user_errors
def generate(
    bridge: str = typer.Option("latest", "--bridge", help="Bridge artifact: id, prefix or latest."),
    mode: str = typer.Option("ar", "--mode", help="ar: autoregressive hybrid generation."),
    prompt: list[str] = typer.Option([], "--prompt", help="A prompt (repeatable); none: start from BOS."),
    prompts_file: Optional[str] = typer.Option(None, "--prompts-file", help="One prompt per line."),
    num_samples: int = typer.Option(8, "--num-samples", help="Samples per prompt."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens"),
    temperature: float = typer.Option(1.0, "--temperature"), top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"), steps: int = typer.Option(8, "--steps", help="Bridge Euler steps."),
    batch_size: int = typer.Option(8, "--batch-size"),
    baseline: str = typer.Option("none", "--baseline", help="original: also sample the unmodified backbone."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Recompute every position each step (reference path)."),
    device: str = Device, dtype: str = Dtype, seed: int = Seed, force: bool = Force, root: Optional[str] = Root,
) -> None:
    """Hybrid generation: bridge -> upper blocks -> LM head (METHOD.md section 3)."""
    from pathlib import Path

    from artifacts.errors import DihalError
    from stages import generate as stage
    from stages.evaluate import backbone_for
    from stages.lm.models import dtype_name, resolve_device

    prompts = list(prompt)
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise DihalError(f"prompts file '{prompts_file}' does not exist")
        lines = [l for l in path.read_text().splitlines() if l.strip()]
        if not lines:
            raise DihalError(f"prompts file '{prompts_file}' is empty; put one prompt per line")
        prompts += lines
    store = ArtifactStore(root)
    device = resolve_device(device)
    cfg = stage.GenerateConfig(tuple(prompts), num_samples, max_new_tokens, temperature, top_k, top_p, steps,
                               batch_size, mode, baseline, not no_cache, seed, device, dtype_name(dtype, device))
    stage.validate(cfg)
    if _dry_run("generate", cfg):
        return
    bridge_art = store.resolve(bridge, "bridge")
    art = stage.run(cfg, bridge_art, store, backbone_for(bridge_art, device, cfg.dtype), force=force,
                    progress=RichProgress())
    import json

    for line in art.file("samples.jsonl").read_text().splitlines()[:3]:
        row = json.loads(line)
        console.print(f"[bold]hybrid[/bold] {row['prompt']!r} -> {row['text'][:200]!r}", highlight=False)
    for model_name, m in art.manifest["metrics"].items():
        console.print(f"{model_name}: {m['ms_per_token']:.1f} ms per token (batch step), {m['mean_tokens']:.1f} tokens")
    _report(art, False)


@runs_app.command("latest")
@user_errors
def runs_latest(stage: str, root: Optional[str] = Root) -> None:
    """Print the id of the newest complete artifact of STAGE (for scripts)."""
    print(ArtifactStore(root).resolve("latest", stage).id)
