"""Use: `dihal generate` and `dihal evaluate` (METHOD §3 and §5).

Each command: parse, build the config (which checks itself), print it under --dry-run, or run the
stage and print what it made. The stage (and torch) is imported inside the command.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import ArtifactStore
from dihal.cli import options as o
from dihal.cli.tables import FIDELITY, LM_EVAL, SAMPLES, columns, print_json, table
from dihal.cli.ui import console, dry, make_progress, report
from dihal.stages.configs import FidelityConfig, GenerateConfig, HarnessConfig, SamplesConfig, parse_steps
from dihal.stages.lineage import backbone_for
from dihal.stages.registry import RECOVERIES


def read_prompts(prompt: list[str], prompts_file: str | None) -> tuple[str, ...]:
    if prompts_file is None:
        return tuple(prompt)
    path = Path(prompts_file)
    if not path.is_file():
        raise DihalError(f"prompts file '{prompts_file}' does not exist")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise DihalError(f"prompts file '{prompts_file}' is empty; put one prompt per line")
    return (*prompt, *lines)


@o.command()
def generate(
    ctx: typer.Context,
    bridge: str | None = typer.Option(None, "--bridge", help="Bridge artifact: id, prefix or latest (ar: latest)."),
    mode: str = o.opt(GenerateConfig, "mode", help="ar: the hybrid, token by token; parallel: a prior's samples."),
    prior: str | None = typer.Option(None, "--prior", help="parallel: the prior artifact (dihal train-prior)."),
    recovery: str = o.opt(GenerateConfig, "recovery", help=f"parallel: {', '.join(RECOVERIES)}."),
    decoder: str | None = typer.Option(None, "--decoder", help="parallel, --recovery decoder: the decoder artifact."),
    autoencoder: str | None = typer.Option(None, "--autoencoder", help="parallel, --recovery latent: its autoencoder."),
    prior_steps: int = o.opt(GenerateConfig, "prior_steps", help="parallel: Euler steps of the prior."),
    clamp: bool = o.opt(GenerateConfig, "clamp", help="parallel: Diffusion-LM clamping to token embeddings."),
    source: str = o.opt(GenerateConfig, "source", help="parallel: prior, null (its noise) or oracle (real states)."),
    readout: str = o.opt(
        GenerateConfig, "readout", help="parallel, --recovery hidden: independent, guided, refine:K or causal."
    ),
    guidance: float = o.opt(GenerateConfig, "guidance", help="gamma of guided, refine:K and causal (0: independent)."),
    prompt: list[str] = typer.Option([], "--prompt", help="A prompt (repeatable); none: start from the start token."),
    prompts_file: str | None = typer.Option(None, "--prompts-file", help="One prompt per line."),
    prompts_from: str | None = o.opt(
        GenerateConfig,
        "prompts_from",
        help="A dataset: prompts are the first --prompt-tokens tokens of --num-prompts of its train documents.",
    ),
    prompt_tokens: int = o.opt(GenerateConfig, "prompt_tokens"),
    num_prompts: int = o.opt(GenerateConfig, "num_prompts"),
    num_samples: int = o.opt(GenerateConfig, "num_samples", help="Samples per prompt."),
    max_new_tokens: int = o.opt(GenerateConfig, "max_new_tokens"),
    temperature: float | None = o.opt(GenerateConfig, "temperature", help="0 = argmax (default 1; none for rounding)."),
    top_k: int = o.opt(GenerateConfig, "top_k"),
    top_p: float = o.opt(GenerateConfig, "top_p"),
    sample_steps: int = o.opt(GenerateConfig, "sample_steps", help="Bridge Euler steps per position."),
    bridge_noise: float = o.opt(GenerateConfig, "bridge_noise", help="Scale of the bridge's noise (0: its mean path)."),
    batch_size: str = typer.Option(
        "auto",
        "--batch-size",
        help="Samples per batch; auto: 8 on the CPU, on a GPU the most the card's memory holds (in the id).",
    ),
    baseline: str = o.opt(
        GenerateConfig,
        "baseline",
        help="original: also sample the unmodified backbone; original-only: it alone (--model, no bridge).",
    ),
    model: str | None = o.opt(GenerateConfig, "model", help="--baseline original-only: the backbone."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Recompute every position each step (reference path)."),
    device: str = o.Device,
    dtype: str = o.Dtype,
    seed: int = o.Seed,
    force: bool = o.Force,
    dry_run: bool = o.DryRun,
    trust_remote_code: bool = o.Trust,
    root: str = o.Root,
) -> None:
    """Hybrid generation: bridge -> upper blocks -> LM head (METHOD §3)."""
    prompts = read_prompts(prompt, prompts_file)
    device, dtype = o.device_and_dtype(device, dtype, dry_run)
    batch = o.count_or_auto(batch_size, "--batch-size")  # auto: the config's default, on a GPU sized below
    values = {**o.given(ctx), "batch_size": batch or o.default(GenerateConfig, "batch_size")}
    cfg = o.build(GenerateConfig, values, prompts=prompts, cache=not no_cache, device=device, dtype=dtype)
    if dry_run:
        return dry("generate", cfg)
    from dihal.stages import generate as stage

    store = ArtifactStore(root)
    if mode == "parallel":
        if prior is None:
            raise DihalError("--mode parallel needs --prior ID (a `dihal train-prior` artifact)")
        given = {k: v for k, v in {"bridge": bridge, "decoder": decoder, "autoencoder": autoencoder}.items() if v}
        if len(given) > 1:
            raise DihalError("give one of --bridge (hidden), --decoder (decoder), --autoencoder (latent)")
        prior_art = store.resolve(prior, "prior")
        part = next((store.resolve(ref, stage) for stage, ref in given.items()), None)
        load = lambda: backbone_for(prior_art, device, dtype, trust_remote_code)
        from dihal.stages import generate_parallel

        art = generate_parallel.run_parallel(cfg, prior_art, store, load, part, force=force, progress=make_progress())
        m = art.manifest["metrics"]
        cost = f"{m['prior_ms_per_sample']:.1f} prior, {m['recovery_ms_per_sample']:.1f} recovery"
        plan = "" if m.get("plan_agreement") is None else f", plan agreement {m['plan_agreement']:.3f}"
        s2 = "" if m.get("s2") is None else f", s^2 {m['s2']:.4g}"
        console.print(
            f"{m['label']}: {m['ms_per_sample']:.1f} ms per sample ({cost}), {m['mean_tokens']:.1f} tokens{plan}{s2}",
            highlight=False,
        )
    elif baseline == "original-only":
        if bridge is not None:
            raise DihalError("--baseline original-only samples the backbone alone; give --model, not --bridge")
        from dihal.stages.lm.models import load_model

        load = lambda: load_model(model, device, dtype, None, trust_remote_code)
        if batch is None:
            cfg = replace(cfg, batch_size=stage.auto_batch(cfg, None))
        art = stage.run(cfg, None, store, load, force=force, progress=make_progress())
    else:
        bridge_art = store.resolve(bridge or "latest", "bridge")
        if batch is None:
            cfg = replace(cfg, batch_size=stage.auto_batch(cfg, bridge_art))
        load = lambda: backbone_for(bridge_art, device, dtype, trust_remote_code)
        art = stage.run(cfg, bridge_art, store, load, force=force, progress=make_progress())
    if mode == "ar":
        for name, m in art.manifest["metrics"].items():
            console.print(f"{name}: {m['ms_per_token']:.1f} ms per token (batch step), {m['mean_tokens']:.1f} tokens")
    for line in art.file("samples.jsonl").read_text().splitlines()[:3]:
        row = json.loads(line)
        console.print(f"[bold]{row['model']}[/bold] {row['prompt']!r} -> {row['text'][:200]!r}", highlight=False)
    report(art)


@o.command()
def evaluate(
    ctx: typer.Context,
    bridge: str | None = typer.Option(None, "--bridge", help="Bridge artifact: fidelity, teacher forced."),
    samples: str | None = typer.Option(
        None, "--samples", help="Generate artifact: Gen.PPL, diversity (with --bridge: fidelity on it)."
    ),
    sample_steps: str = o.opt(FidelityConfig, "sample_steps", help="Bridge Euler steps to compare (fidelity)."),
    limit: int = o.opt(FidelityConfig, "limit", help="Held-out sequences (fidelity) or samples to score."),
    dataset: str | None = o.opt(FidelityConfig, "dataset", help="Fidelity on this dataset spec instead (--bridge)."),
    extract: str | None = typer.Option(
        None,
        "--extract",
        help="Fidelity on this extract's validation split instead (the bridge's model and --seq-len).",
    ),
    evaluator: str | None = o.opt(SamplesConfig, "evaluator", help="Model for Gen.PPL (default: the backbone)."),
    lm_eval: str | None = typer.Option(
        None, "--lm-eval", help="lm-evaluation-harness tasks, comma-separated: the hybrid and its backbone (--bridge)."
    ),
    lm_eval_include: str | None = o.opt(HarnessConfig, "include", "--lm-eval-include", help="A folder of task YAMLs."),
    lm_eval_limit: int | None = o.opt(HarnessConfig, "limit", "--lm-eval-limit", help="Documents per task."),
    lm_eval_fewshot: int | None = o.opt(
        HarnessConfig, "num_fewshot", "--lm-eval-fewshot", help="Few-shot examples (default: each task's own)."
    ),
    lm_eval_log_samples: bool = o.opt(
        HarnessConfig, "log_samples", "--lm-eval-log-samples", help="Keep every document's prompt and scores."
    ),
    batch_size: int = o.opt(FidelityConfig, "batch_size"),
    device: str = o.Device,
    dtype: str = o.Dtype,
    seed: int = o.Seed,
    force: bool = o.Force,
    dry_run: bool = o.DryRun,
    trust_remote_code: bool = o.Trust,
    as_json: bool = o.AsJson,
    root: str = o.Root,
) -> None:
    """Bridge fidelity (--bridge [--dataset | --samples]), generation quality (--samples), or the
    harness's tasks (--bridge --lm-eval)."""
    harness_flags = (lm_eval_include, lm_eval_limit, lm_eval_fewshot, lm_eval_log_samples or None)
    if lm_eval is not None or any(flag is not None for flag in harness_flags):
        return evaluate_lm_eval(o.given(ctx))
    for flag, given in (("--dataset", dataset), ("--extract", extract)):
        if given is not None and bridge is None:
            raise DihalError(f"{flag} measures a bridge's fidelity; give --bridge ID with it")
    if bridge is None and samples is None:
        raise DihalError("give --bridge ID (fidelity) or --samples ID (generation quality), or both")
    device, dtype = o.device_and_dtype(device, dtype, dry_run)
    if bridge is not None:
        cfg = o.build(FidelityConfig, o.given(ctx), sample_steps=parse_steps(sample_steps), device=device, dtype=dtype)
    else:
        cfg = o.build(SamplesConfig, o.given(ctx), device=device, dtype=dtype)
    from dihal.stages import evaluate as stage

    if bridge is not None:
        stage.check_inputs(cfg)
    if dry_run:
        return dry("evaluate", cfg)
    store = ArtifactStore(root)
    if bridge is not None:
        on = store.resolve(samples, "generate") if samples else None
        other = store.resolve(extract, "extract") if extract else None
        art = stage.run_fidelity(
            cfg,
            store.resolve(bridge, "bridge"),
            store,
            force=force,
            trust_remote_code=trust_remote_code,
            samples=on,
            held_out=other,
        )
        m = art.manifest["metrics"]
        rows, title, shown = (
            m["fidelity"],
            f"bridge fidelity, layer {m['layer']}, on {m.get('source', 'validation')}",
            FIDELITY,
        )
    else:
        art = stage.run_samples(
            cfg, store.resolve(samples, "generate"), store, force=force, trust_remote_code=trust_remote_code
        )
        rows, title, shown = art.manifest["metrics"]["rows"], "generation quality", SAMPLES
    if as_json:
        return print_json({"id": art.id, "path": str(art.path), "results": rows})
    console.print(table(title, *columns(rows, shown)))
    report(art)


def evaluate_lm_eval(v: dict) -> None:
    """evaluate --bridge ID --lm-eval TASKS: stages/evaluate_harness.py."""
    if v["lm_eval"] is None:
        raise DihalError(
            "--lm-eval-include, --lm-eval-limit, --lm-eval-fewshot and --lm-eval-log-samples go with --lm-eval TASKS"
        )
    if v["bridge"] is None or any(v[k] is not None for k in ("samples", "dataset", "extract")):
        raise DihalError("--lm-eval scores a hybrid: give --bridge ID, without --samples, --dataset or --extract")
    device, dtype = o.device_and_dtype(v["device"], v["dtype"], v["dry_run"])
    tasks = tuple(t.strip() for t in v["lm_eval"].split(","))
    cfg = HarnessConfig(
        tasks=tasks,
        include=v["lm_eval_include"],
        limit=v["lm_eval_limit"],
        num_fewshot=v["lm_eval_fewshot"],
        log_samples=v["lm_eval_log_samples"],
        batch_size=v["batch_size"],
        seed=v["seed"],
        device=device,
        dtype=dtype,
    )
    from dihal.stages import evaluate_harness as harness

    harness.harness()
    manager = harness.task_manager(cfg)  # an unknown task is one line before anything loads
    if v["dry_run"]:
        return dry("evaluate", cfg)
    store = ArtifactStore(v["root"])
    bridge = store.resolve(v["bridge"], "bridge")
    art = harness.run(
        cfg,
        bridge,
        store,
        force=v["force"],
        progress=make_progress(),
        trust_remote_code=v["trust_remote_code"],
        manager=manager,
    )
    rows = art.manifest["metrics"]["lm_eval"]
    if v["as_json"]:
        return print_json({"id": art.id, "path": str(art.path), "results": rows})
    console.print(
        table(f"lm-eval, hybrid at layer {art.manifest['metrics']['layer']} and its backbone", *columns(rows, LM_EVAL))
    )
    report(art)
