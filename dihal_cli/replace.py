"""Replace: `dihal train-bridge` (METHOD §2), and the comparison's other trained
parts, `dihal train-prior` and `dihal train-decoder` (METHOD §5).

Every trained part is a recipe (stages/configs.py): a named protocol with the recipe options
given here on top (options.recipe_options adds them, written once); the recipe validates every
field in one place. The stage is imported inside the command, after --help and bad values.
"""

from __future__ import annotations

import importlib

import typer

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import ArtifactStore
from dihal.cli import options as o
from dihal.cli.locate import extract_config, extract_parent
from dihal.cli.ui import console, dry, make_progress, report
from dihal.stages.configs import (
    AutoencoderConfig,
    BridgeConfig,
    DecoderTrainConfig,
    OwnTextConfig,
    PriorConfig,
    parse_condition,
)

ExtractRef = typer.Option("latest", "--extract", help="Extract artifact holding layer 0 (and --layer).")


CONDITION_HELP = "sigma:S (c + sigma z, sigma ~ U(0, S); a bare S too) or prior:T (the prior's x0 estimates, t <= T)."


def condition(spec: str) -> dict:
    kind, value = parse_condition(spec)
    return {"condition_from": kind, "condition_noise": value}


def train_from_extract(ctx, cls, command: str, recipe: tuple, reads=None, **fixed):
    """A part trained on a named extract by `command` (train-prior: stages/train_prior.py, ...) from the
    running command's parameters (o.given(ctx)), its recipe and its own settings (`fixed`); None under
    --dry-run. reads: {keyword of the stage's run: (stage, artifact reference or None)}, the other parts
    it trains on."""
    v = o.given(ctx)
    device, dtype = o.device_and_dtype(v["device"], v["dtype"], v["dry_run"])
    cfg = cls.for_run(v["protocol"], recipe, seed=v["seed"], device=device, dtype=dtype, **fixed)
    if v["dry_run"]:
        return dry(command, cfg)
    stage = importlib.import_module(f"dihal.stages.{command.replace('-', '_')}")
    store = ArtifactStore(v["root"])
    parts = {k: store.resolve(ref, stage) if ref else None for k, (stage, ref) in (reads or {}).items()}
    extract = store.resolve(v["extract"], "extract")
    return stage.run(cfg, extract, store, **parts, force=v["force"], progress=make_progress())


@o.command("train-bridge")
@o.recipe_options()
def train_bridge(
    ctx: typer.Context,
    layer: int = typer.Option(..., "--layer", help="Replace embeddings + blocks 1..layer."),
    protocol: str = o.protocol_opt(BridgeConfig),
    extract: str | None = typer.Option(None, "--extract", help="Holds layers 0, --layer (omitted: extract now)."),
    model: str = o.Model,
    dataset: list[str] = o.Dataset,
    mix: str | None = o.Mix,
    max_sequences: int | None = o.MaxSeq,
    seq_len: int = o.SeqLen,
    store_dtype: str = o.StoreDtype,
    own_text: float = o.opt(
        OwnTextConfig,
        "own_text",
        help="Share of the extract's sequences that are the "
        "backbone's own unprompted samples (0: the corpus alone; README: 0.5 measured).",
    ),
    own_samples: str = typer.Option(
        "auto",
        "--own-samples",
        help="--own-text: how many samples the backbone "
        "writes; auto: enough for the share of --max-sequences (1024 without).",
    ),
    own_seed: int = o.opt(OwnTextConfig, "own_seed", help="--own-text: their seed."),
    prediction: str = o.opt(BridgeConfig, "prediction", help="x0 or velocity."),
    skip_init: str = o.opt(BridgeConfig, "skip_init", help="ridge or zero."),
    out_init: str = o.opt(BridgeConfig, "out_init", help="The denoiser's output layer: plain or zero (DiT's)."),
    positions: str = o.opt(BridgeConfig, "positions", help="learned (ends at --seq-len) or rotary (runs past it)."),
    states: str = o.opt(
        BridgeConfig, "states", help="h_l read from the extract (store) or computed by the backbone's blocks (model)."
    ),
    condition_noise: str = typer.Option(o.condition_default(BridgeConfig), "--condition-noise", help=CONDITION_HELP),
    prior: str | None = typer.Option(None, "--prior", help="With prior:T, the layer-0 prior (dihal train-prior)."),
    device: str = o.Device,
    dtype: str = o.Dtype,
    seed: int = typer.Option(
        0, "--seed", help="The bridge's seed; without --extract, also the extract's (its split and order)."
    ),
    force: bool = o.Force,
    dry_run: bool = o.DryRun,
    trust_remote_code: bool = o.Trust,
    root: str = o.Root,
    recipe: tuple = (),
) -> None:
    """Train the conditional flow-matching bridge h_0 -> h_layer (METHOD §2)."""
    device, dtype = o.device_and_dtype(device, dtype, dry_run)
    fixed = dict(
        layer=layer, prediction=prediction, skip_init=skip_init, out_init=out_init, positions=positions, states=states
    )
    fixed |= condition(condition_noise)
    cfg = BridgeConfig.for_run(protocol, recipe, seed=seed, device=device, dtype=dtype, **fixed)
    ecfg = extract_config(o.given(ctx), device, dtype, "none" if states == "model" else f"0,{layer}")
    own = OwnTextConfig(own_text=own_text, own_samples=o.count_or_auto(own_samples, "--own-samples"), own_seed=own_seed)
    if own.own_text and extract:
        raise DihalError("--own-text makes the extract; leave out --extract (or give an extract of generate:<ID>)")
    from dihal.stages import own_text as own_stage

    if not extract:
        from dihal.stages.extract import check_planned

        check_planned(own_stage.planned(own, ecfg).data, why="the bridge's validation loss")  # before samples or states
    store = ArtifactStore(root)
    for warning in own_stage.check_sizes(own, ecfg, store):  # before any sample is written or model loaded
        console.print(warning, highlight=False, soft_wrap=True)
    if dry_run:
        ecfg, made = own_stage.planned(own, ecfg), [own_stage.samples_config(own, ecfg)] if own.own_text else []
        return dry("train-bridge", cfg, *made, *([] if extract else [ecfg]), plan=None if extract else ecfg)
    from dihal.stages import train_bridge as stage

    prior_art = store.resolve(prior, "prior") if prior else None
    if own.own_text:
        ecfg, samples = own_stage.run(own, ecfg, store, progress=make_progress())
        report(samples)
    parent = extract_parent(store, extract, ecfg)
    art = stage.run(cfg, parent, store, prior=prior_art, force=force, progress=make_progress())
    m = art.manifest["metrics"]
    console.print(
        f"layer {layer}: validation bridge loss {m['val_loss']:.4f} after {m['steps']} steps "
        f"({m['train_tokens_per_s']:,.0f} tokens/s)"
    )
    report(art)


@o.command("train-prior")
@o.recipe_options()
def train_prior(
    ctx: typer.Context,
    layer: int = o.opt(PriorConfig, "layer", help="0: normalized h_0 (the comparison's prior); l: h_l (DiHAL-direct)."),
    self_condition: bool = o.opt(PriorConfig, "self_condition", help="SED's self-conditioning."),
    time_shift: float = o.opt(PriorConfig, "time_shift", help="Train on t = s u / (1 + (s-1) u): s > 1, more noise."),
    token_ce: float = o.opt(PriorConfig, "token_ce", help="Weight of the x0 estimate's token cross-entropy."),
    token_ce_max_t: float = o.opt(PriorConfig, "token_ce_max_t", help="Apply --token-ce only where t <= this."),
    data: str = o.opt(
        PriorConfig, "data", help="extract (stored h_0), corpus (its tokens, embedded) or corpus:SPEC (a dataset)."
    ),
    latents: str | None = typer.Option(None, "--latents", help="Model this autoencoder's latents (LD4LG-style)."),
    states: str = o.opt(
        PriorConfig, "states", help="h_l read from the extract (store) or computed by the backbone's blocks (model)."
    ),
    protocol: str = o.protocol_opt(PriorConfig),
    extract: str = ExtractRef,
    device: str = o.Device,
    dtype: str = o.Dtype,
    seed: int = o.Seed,
    force: bool = o.Force,
    dry_run: bool = o.DryRun,
    root: str = o.Root,
    recipe: tuple = (),
) -> None:
    """Sequence diffusion prior over normalized states, positions 1..T-1 (METHOD §5)."""
    fixed = dict(layer=layer, self_condition=self_condition, latent=latents is not None, time_shift=time_shift)
    fixed.update(token_ce=token_ce, token_ce_max_t=token_ce_max_t, data=data, states=states)
    if (
        art := train_from_extract(
            ctx, PriorConfig, "train-prior", recipe, reads={"latents": ("autoencoder", latents)}, **fixed
        )
    ) is None:
        return
    m, over = art.manifest["metrics"], "latents" if latents else f"layer {layer}"
    console.print(
        f"prior over {over}: validation x0 loss {m['val_loss']:.4f} after {m['steps']} steps, "
        f"{m['parameters']:,} parameters"
    )
    report(art)


@o.command("train-decoder")
@o.recipe_options(exclude=("depth",))
def train_decoder(
    ctx: typer.Context,
    condition_noise: str = typer.Option(
        o.condition_default(DecoderTrainConfig), "--condition-noise", help=CONDITION_HELP
    ),
    prior: str | None = typer.Option(None, "--prior", help="With prior:T, the layer-0 prior (dihal train-prior)."),
    states: str = o.opt(
        DecoderTrainConfig, "states", help="h_0 read from the extract (store) or computed from its token ids (model)."
    ),
    protocol: str = o.protocol_opt(DecoderTrainConfig),
    extract: str = ExtractRef,
    device: str = o.Device,
    dtype: str = o.Dtype,
    seed: int = o.Seed,
    force: bool = o.Force,
    dry_run: bool = o.DryRun,
    root: str = o.Root,
    recipe: tuple = (),
) -> None:
    """CoDAR's recovery: a causal decoder cross-attending to normalized h_0 (METHOD §5)."""
    if (
        art := train_from_extract(
            ctx,
            DecoderTrainConfig,
            "train-decoder",
            recipe,
            reads={"prior": ("prior", prior)},
            states=states,
            **condition(condition_noise),
        )
    ) is None:
        return
    m = art.manifest["metrics"]
    console.print(f"decoder: validation cross-entropy {m['val_loss']:.4f} after {m['steps']} steps")
    report(art)


@o.command("train-autoencoder")
@o.recipe_options(exclude=("depth",))
def train_autoencoder(
    ctx: typer.Context,
    latents: int = o.opt(AutoencoderConfig, "latents", help="K latent vectors per sequence."),
    latent_dim: int = o.opt(AutoencoderConfig, "latent_dim", help="Width d of each latent."),
    states: str = o.opt(
        AutoencoderConfig, "states", help="h_L read from the extract (store) or computed by every block (model)."
    ),
    protocol: str = o.protocol_opt(AutoencoderConfig),
    extract: str = ExtractRef,
    device: str = o.Device,
    dtype: str = o.Dtype,
    seed: int = o.Seed,
    force: bool = o.Force,
    dry_run: bool = o.DryRun,
    root: str = o.Root,
    recipe: tuple = (),
) -> None:
    """LD4LG-style: resampler over the frozen backbone's last layer, decoded by CoDAR's decoder (METHOD §5)."""
    fixed = dict(latents=latents, latent_dim=latent_dim, states=states)
    if (art := train_from_extract(ctx, AutoencoderConfig, "train-autoencoder", recipe, **fixed)) is None:
        return
    m = art.manifest["metrics"]
    console.print(
        f"autoencoder: layer {m['encoder_layer']} -> {latents} x {latent_dim}; validation reconstruction accuracy "
        f"{m['reconstruction_accuracy']:.3f} after {m['steps']} steps"
    )
    report(art)
