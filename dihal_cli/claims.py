"""The paper's claims as commands: `dihal compare` (claim 3, METHOD §5) and
`dihal confirm` (claim 4). `dihal sweep` (claims 1 and 2) is in locate.py.

The comparison's rows come from stages/registry.py's ROWS; every trained part runs under
one protocol with the same overrides, so the budget is matched.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dihal.artifacts.store import ArtifactStore
from dihal.cli import options as o
from dihal.cli.locate import extract_config, extract_parent
from dihal.cli.options import default
from dihal.cli.tables import compare_tables, confirm_tables
from dihal.cli.ui import console, dry, make_progress, report
from dihal.stages.configs import (
    BridgeConfig,
    CompareConfig,
    ConfirmConfig,
    ScoreConfig,
    check_evaluator,
    parse_condition,
)
from dihal.stages.registry import ROW_KEYS


@o.command()
@o.recipe_options(batch_flag="--train-batch")
def compare(
    ctx: typer.Context,
    layer: int | None = o.opt(CompareConfig, "layer", help="l* (default: the score's argmax S)."),
    oracle: int | None = o.opt(CompareConfig, "oracle", help="A sweep's oracle layer: one more DiHAL row."),
    protocol: str = o.opt(CompareConfig, "protocol"),
    seeds: str = o.opt(CompareConfig, "seeds", help="Comma list; each part is trained per seed."),
    num_samples: int = o.opt(CompareConfig, "num_samples", help="Samples per row and seed."),
    prior_steps: int = o.opt(CompareConfig, "prior_steps"),
    sample_steps: int = o.opt(CompareConfig, "sample_steps"),
    condition_noise: str = typer.Option(
        o.condition_default(CompareConfig),
        "--condition-noise",
        help="How the decoder and bridges see their conditions: prior:T or sigma:S.",
    ),
    evaluator: str | None = o.opt(
        CompareConfig, "evaluator", help="Primary evaluator, not the backbone (default: the other builtin)."
    ),
    temperatures: str = o.opt(CompareConfig, "temperatures", help="Decoding grid of every curve row (0 = argmax)."),
    top_p: float = o.opt(CompareConfig, "top_p"),
    rows: str = o.opt(CompareConfig, "rows", help="Row keys (default all): " + ", ".join(ROW_KEYS) + "."),
    controls: str = o.opt(CompareConfig, "controls", help="Rows whose recovery reads the oracle and null priors."),
    budgets: str = o.opt(CompareConfig, "budgets", help="Multiples of the protocol's steps, each trained."),
    readout: str = o.opt(
        CompareConfig,
        "readouts",
        "--readout",
        help="DiHAL (l*)'s readouts, comma list of independent, guided, refine:K, causal: each a row.",
    ),
    guidance: float = o.opt(CompareConfig, "guidance", help="gamma of the guided readouts."),
    prior_time_shift: float = o.opt(CompareConfig, "prior_time_shift", help="Every h_0 prior's --time-shift."),
    prior_token_ce: float = o.opt(CompareConfig, "prior_token_ce", help="Every h_0 prior's --token-ce."),
    prior_token_ce_max_t: float = o.opt(
        CompareConfig, "prior_token_ce_max_t", help="Every h_0 prior's --token-ce-max-t."
    ),
    prior_data: str = o.opt(CompareConfig, "prior_data", help="Every h_0 prior's --data (train-prior --help)."),
    extract: str | None = typer.Option(None, "--extract", help="Extract of every layer (omitted: extract now)."),
    score: str | None = typer.Option(None, "--score", help="Score of that extract (omitted: score now)."),
    tokens: int = o.opt(ScoreConfig, "tokens", help="Score sample size when scoring now."),
    select: str = o.opt(ScoreConfig, "select", help="l* when scoring now: S (the paper's) or r2_token."),
    model: str = o.Model,
    dataset: list[str] = o.Dataset,
    mix: str | None = o.Mix,
    max_sequences: int | None = o.MaxSeq,
    seq_len: int = o.SeqLen,
    store_dtype: str = o.StoreDtype,
    batch_size: int = o.opt(CompareConfig, "batch_size", help="Samples per batch."),
    states: str = o.opt(CompareConfig, "states", help="h_l of the parts over it: store (read) or model (computed)."),
    device: str = o.Device,
    dtype: str = o.Dtype,
    force: bool = o.Force,
    dry_run: bool = o.DryRun,
    trust_remote_code: bool = o.Trust,
    root: str = o.Root,
    recipe: tuple = (),
) -> None:
    """Diffusion-LM, SED, CoDAR and DiHAL from one prior at a matched budget, with references (METHOD §5)."""
    device, dtype = o.device_and_dtype(device, dtype, dry_run)
    condition_from, noise = parse_condition(condition_noise)
    cfg = o.build(
        CompareConfig,
        o.given(ctx),
        condition_noise=noise,
        device=device,
        dtype=dtype,
        seeds=o.seeds(seeds),
        overrides=recipe,
        condition_from=condition_from,
        rows=o.comma_list(rows),
        controls=o.comma_list(controls),
        temperatures=o.numbers(temperatures, "--temperatures"),
        budgets=o.numbers(budgets, "--budgets", int),
        readouts=o.comma_list(readout),
    )
    if evaluator is not None and not extract:  # before the extract; with --extract, compare.check reads its model
        check_evaluator(evaluator, model)
    # the comparison's own extract (seed 0): every layer, or the token ids alone where a given score's extract
    # holds the layers and the parts compute their h_l (--states model)
    ecfg = extract_config({**o.given(ctx), "seed": 0}, device, dtype, "none" if states == "model" and score else "all")
    scfg = ScoreConfig(tokens=tokens, select=select, device=device)
    if not extract:
        from dihal.stages.extract import check_planned

        held_out = cfg.num_samples if cfg.controls else 1  # the oracle controls read N held-out sequences
        fix = " (or lower --num-samples, or --controls '')"
        check_planned(ecfg.data, validation=held_out, tokens=None if score else tokens, why="the comparison", fix=fix)
    if dry_run:
        return dry(
            "compare", cfg, *([] if extract else [ecfg]), *([] if score else [scfg]), plan=None if extract else ecfg
        )
    from dihal.stages import compare as stage
    from dihal.stages import score as score_stage
    from dihal.stages.lm.models import load_model

    store = ArtifactStore(root)
    parent = extract_parent(store, extract, ecfg)
    score_art = (
        store.resolve(score, "score") if score else score_stage.run(scfg, parent, store, progress=make_progress())
    )
    load = lambda spec: load_model(spec, device, dtype, trust_remote_code=trust_remote_code)
    art = stage.run(cfg, parent, score_art, store, load, force=force, progress=make_progress())
    for out in compare_tables(json.loads(art.file("compare.json").read_text())):
        console.print(out)
    report(art)


@o.command()
@o.recipe_options(batch_flag="--train-batch")
def confirm(
    ctx: typer.Context,
    sweep: str = typer.Option("latest", "--sweep", help="Sweep whose l*, oracle and worst layer to train fully."),
    protocol: str = o.protocol_opt(ConfirmConfig),
    at: str = o.opt(ConfirmConfig, "at", help="l_star, oracle, worst, layers"),
    seeds: str = o.opt(ConfirmConfig, "seeds", help="A bridge per layer and seed."),
    sample_steps: int = o.opt(ConfirmConfig, "sample_steps", help="Bridge Euler steps (fidelity and generation)."),
    eval_limit: int = o.opt(ConfirmConfig, "eval_limit", help="Held-out sequences for fidelity."),
    num_samples: int = o.opt(ConfirmConfig, "num_samples", help="AR hybrid samples per layer and seed."),
    evaluator: str | None = o.opt(ConfirmConfig, "evaluator", help="Second evaluator (default: the other builtin)."),
    batch_size: int = o.opt(ConfirmConfig, "batch_size", help="Samples per generation batch."),
    states: str = o.opt(BridgeConfig, "states", help="Every bridge's h_l: store (read) or model (computed)."),
    device: str = o.Device,
    dtype: str = o.Dtype,
    force: bool = o.Force,
    dry_run: bool = o.DryRun,
    trust_remote_code: bool = o.Trust,
    root: str = o.Root,
    recipe: tuple = (),
) -> None:
    """Claim 4: l*, the oracle and the worst layer fully trained per seed; fidelity and generations."""
    device, dtype = o.device_and_dtype(device, dtype, dry_run)
    cfg = o.build(
        ConfirmConfig,
        o.given(ctx),
        at=o.comma_list(at),
        seeds=o.seeds(seeds),
        overrides=recipe + ((("states", states),) if states != default(BridgeConfig, "states") else ()),
        device=device,
        dtype=dtype,
    )
    if dry_run:
        return dry("confirm", cfg)
    from dihal.stages import confirm as stage
    from dihal.stages.lm.models import load_model

    store = ArtifactStore(root)
    sweep_art = store.resolve(sweep, "sweep")
    extract = store.resolve(sweep_art.manifest["parents"]["extract"], "extract")
    load = lambda spec: load_model(spec, device, dtype, trust_remote_code=trust_remote_code)
    art = stage.run(cfg, sweep_art, extract, store, load, force=force, progress=make_progress())
    rows = json.loads(art.file("confirm.json").read_text())["rows"]
    for out in confirm_tables(rows, Path(art.manifest["metrics"]["evaluator"]).name, protocol, seeds):
        console.print(out)
    report(art)
