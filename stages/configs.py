"""Every stage's configuration, and the training protocols: frozen keyword-only dataclasses that
check themselves when they are built.

This module imports no torch, transformers, scipy or pandas, so the CLI builds and validates a
config (and `dihal --help` shows every default) without loading the numeric stack. Each default
is written here once; the CLI reads it from here (dihal_cli/options.py).

    Config       the base: NaN and infinity are refused in every float field, then `check()`
    Recipe       what the one training loop needs (stages/diffusion/trainer.py); the only place
                 that validates batch, lr, warm-up, schedule, EMA, clipping and precision
    PartRecipe   a trained part under a named protocol (PROTOCOLS): network width and heads
    BridgeConfig, PriorConfig, DecoderTrainConfig     the three trained parts
    DataConfig, ExtractConfig, ScoreConfig, FidelityConfig, SamplesConfig, GenerateConfig,
    SweepConfig, CompareConfig, ConfirmConfig        the other stages

An artifact's id hashes `config.hashed()` (artifacts/store.py): asdict, less the fields added after
ids were published where they keep the meaning every config had before them (`added()`, on the
field). So a field's name, default and meaning never change silently: a change that moves ids says so
in docs/history.md.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from dihal.artifacts.errors import DihalError
from dihal.stages.registry import PROXY_SETS, RECOVERIES, ROW_KEYS

# -- names a config may take --------------------------------------------------------------------
STORE_DTYPES = ("auto", "float16", "float32")
NORMALIZATIONS = ("none", "rms", "standardize")
R2_PENALTIES = ("kfold", "gcv")  # r2_token's ridge penalty: 5-fold cross-validation, or the GCV of before
SELECTIONS = ("S", "r2_token")  # what l* is the argmax of: the paper's S, or dihal's r2_token
SPLITS = ("train", "validation")
PREDICTIONS = ("x0", "velocity")
SCHEDULES = ("cosine", "constant")
PRECISIONS = ("float32", "bfloat16")
SOURCES = ("prior", "null", "oracle")  # what a parallel recovery reads: METHOD §5's controls bracket the prior
CONFIRM_NAMED = {"l_star": "l_star", "oracle": "oracle_layer", "worst": "worst_layer"}  # --at name -> sweep key
DIST_TIMEOUT_MINUTES = 60.0  # a torchrun rank's wait for the others (NCCL's own 10 minutes ends a sweep early)
DIST_TIMEOUT_ENV = "DIHAL_DIST_TIMEOUT"  # how `dihal --dist-timeout` reaches every rank's process group
COMPARISON_CONDITION_NOISE = 0.5  # METHOD §5: sigma_max of the corrupted conditions of decoder and bridges
DECODER_DEPTH = 2  # METHOD §5: the decoder has the protocol's width and depth 2
# the AR hybrid's bridge noise scale (GenerateConfig.bridge_noise): 0, the flow's mean path, by the rule of
# docs/results/hybrid_generation.md (issue 66); every generation before it sampled at 1
BRIDGE_NOISE = 0.0

# the CPU protocols share one network and batch; each names only what it changes
_CPU = dict(epochs=None, batch_size=32, schedule="cosine", width=256, depth=4, heads=4, val_sequences=64)

PROTOCOLS: dict[str, dict] = {
    # the measurement setting of METHOD §2 with 1000 steps instead of 600 (about 7 minutes
    # on two CPU cores for smollm2-135m): at layer 3, 600 steps gave top-1 0.642 at 8 steps, 1000 gave 0.659
    "cpu-small": dict(_CPU, steps=1000, lr=1e-3, warmup=30, ema=0.995, eval_every=100, checkpoint_every=50),
    # one fixed short budget per layer for sweeps (under 2 minutes a layer on CPU)
    "sweep-tiny": dict(_CPU, steps=150, lr=2e-3, warmup=15, ema=0.99, eval_every=75, checkpoint_every=50),
    # the comparison on two CPU cores: every part (priors, decoder, bridges) gets this budget, so that
    # `dihal compare` with two seeds and N = 256 samples per row fits in two hours
    "compare-cpu": dict(_CPU, steps=200, lr=2e-3, warmup=20, ema=0.99, eval_every=100, checkpoint_every=50),
    # GPU scale, as in the paper: one epoch over the train split
    "paper": dict(
        steps=None,
        epochs=1,
        batch_size=64,
        lr=3e-4,
        warmup=500,
        schedule="cosine",
        ema=0.9999,
        width=1024,
        depth=8,
        heads=16,
        eval_every=1000,
        checkpoint_every=1000,
        val_sequences=512,
    ),
}

FLAGS = {"steps": "--train-steps"}  # a field whose flag is not --<field with dashes>


def flag(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def require(condition: bool, message: str) -> None:
    if not condition:
        raise DihalError(message)


def at_least(cfg, minimum: int, *names: str) -> None:
    """Each named field (None skipped) is at least `minimum`."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < minimum:
            raise DihalError(f"{flag(name)} must be at least {minimum}, got {value}")


def one_of(cfg, name: str, allowed) -> None:
    value = getattr(cfg, name)
    require(value in allowed, f"unknown {flag(name)} '{value}'; use one of {', '.join(allowed)}")


def distinct_seeds(seeds: tuple[int, ...]) -> None:
    require(bool(seeds) and len(set(seeds)) == len(seeds), "--seeds must name distinct seeds, e.g. 0,1,2")
    require(min(seeds) >= 0, f"--seeds must be >= 0, got {min(seeds)}")


def _floats(value):
    if isinstance(value, float):
        yield value
    elif isinstance(value, tuple):
        for item in value:
            yield from _floats(item)


def precision_for(dtype: str) -> str:
    """Training precision for a --dtype name: bf16 autocast for bfloat16, float32 otherwise."""
    return "bfloat16" if dtype == "bfloat16" else "float32"


class Config:
    """The base of every config: a float field that is NaN or infinite is refused (every range
    check `x <= 0` is False for NaN), seeds are >= 0, then the class's own `check()`."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if any(not math.isfinite(v) for v in _floats(value)):
                raise DihalError(f"{flag(f.name)} must be a finite number, got {value}")
        if getattr(self, "seed", 0) < 0:
            raise DihalError(f"--seed must be >= 0, got {self.seed}")
        self.check()

    def check(self) -> None:
        """The class's own checks (every one raises DihalError, naming the flag)."""

    def hashed(self) -> dict:
        """What an artifact's id hashes: asdict (a nested config hashed likewise), less each field added
        after ids were published (`added()`) while it keeps the meaning configs had before it."""
        out = asdict(self)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Config):
                out[f.name] = value.hashed()
            if "added" in f.metadata:
                old, when = f.metadata["added"]
                if when(self) if when else value == old:
                    out.pop(f.name)
        return out


def added(default, *, old=MISSING, when=None):
    """A config field added after artifact ids were published. `Config.hashed()` leaves it out when it
    holds `old` (by default its default: the meaning before it existed), or, given `when`, whenever
    `when(config)` holds (a field that means nothing in that config), so a config made before the field
    existed keeps its id. Every such field is marked here, on the field, and nowhere else."""
    return field(default=default, metadata={"added": (default if old is MISSING else old, when)})


# -- training ---------------------------------------------------------------------------------------
KEPT_WEIGHTS = ("final+ema", "ema", "ema-bfloat16")  # what a complete part keeps (stages/diffusion/trainer.py)


def gpu_key(device: str) -> dict:
    """What a trained part's id, and that of a stage that trains parts (sweep, confirm, compare), hashes of how a
    GPU trains it otherwise than a CPU: the fused AdamW (stages/diffusion/trainer.optimizer), which rounds otherwise
    than the per-tensor AdamW every part was trained with before it, and the validation noise drawn on the device
    (stages/diffusion/flow.validation_loss: another stream, so another validation loss). Nothing on a CPU."""
    return {"optimizer": "adamw, fused", "validation_noise": "device"} if device == "cuda" else {}


@dataclass(frozen=True, kw_only=True)
class Recipe(Config):
    """The training loop's settings, shared by every trained part (the loop's own config)."""

    steps: int | None
    epochs: int | None
    batch_size: int  # global: summed over ranks
    lr: float
    warmup: int
    schedule: str
    ema: float
    eval_every: int
    checkpoint_every: int
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    precision: str = "float32"  # bfloat16: forward under bf16 autocast (CUDA or CPU)
    shuffle_window: int = 512  # sequences shuffled together in an epoch's order; bounds a read
    # the training step's network under torch.compile (issue 64): its kernels round otherwise than eager ones
    compile: bool = added(False)
    # what a complete part keeps (stages/diffusion/trainer.py): final+ema, ema, or ema-bfloat16 (a quarter of the
    # disk: the paper protocol's 85 parts within a node's disk, issue 64)
    keep_weights: str = added("final+ema")

    def hashed(self) -> dict:
        return {**super().hashed(), **gpu_key(self.device)}

    def check(self) -> None:
        require(self.steps is not None or self.epochs is not None, "give --train-steps or --epochs")
        at_least(self, 1, "steps", "epochs", "batch_size", "eval_every", "checkpoint_every", "shuffle_window")
        require(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        at_least(self, 0, "warmup")
        require(0 <= self.ema < 1, f"--ema must be in [0, 1), got {self.ema}")
        require(self.grad_clip >= 0, f"the gradient clip must be >= 0, got {self.grad_clip}")
        require(self.weight_decay >= 0, f"the weight decay must be >= 0, got {self.weight_decay}")
        one_of(self, "schedule", SCHEDULES)
        one_of(self, "precision", PRECISIONS)
        one_of(self, "keep_weights", KEPT_WEIGHTS)


LoopConfig = Recipe  # the name trainer.py's loop knows it by


@dataclass(frozen=True, kw_only=True)
class PartRecipe(Recipe):
    """A trained part's recipe: the loop's settings and the network's, from a named protocol."""

    protocol: str
    width: int
    heads: int
    val_sequences: int

    @classmethod
    def from_protocol(cls, protocol: str | None = None, **settings):
        """PROTOCOLS[protocol] (the fields cls has) with the non-None settings on top; None keeps the
        protocol's value, and a name that is not a field is refused (never dropped). --epochs alone
        means the run length comes from the epochs."""
        protocol = protocol or cls.__dataclass_fields__["protocol"].default
        require(protocol in PROTOCOLS, f"unknown --protocol '{protocol}'; use one of {', '.join(PROTOCOLS)}")
        names = {f.name for f in fields(cls)} - {"protocol"}
        unknown = sorted(k for k in settings if k not in names)
        if unknown:
            raise DihalError(f"unknown setting '{unknown[0]}'; settings are {', '.join(sorted(names))}")
        values = {k: v for k, v in PROTOCOLS[protocol].items() if k in names}
        values |= {k: v for k, v in settings.items() if v is not None}
        if settings.get("epochs") is not None and settings.get("steps") is None:
            values["steps"] = None
        return cls(protocol=protocol, **values)

    @classmethod
    def for_run(cls, protocol: str, overrides=(), *, seed: int, device: str, dtype: str, **settings):
        """The protocol's recipe with the run's overrides, seed, device and the training precision
        of its --dtype (bf16 autocast for bfloat16, float32 otherwise)."""
        merged = {**dict(overrides), **settings}
        return cls.from_protocol(protocol, seed=seed, device=device, precision=precision_for(dtype), **merged)

    def check(self) -> None:
        super().check()
        at_least(self, 1, *(n for n in ("width", "heads", "val_sequences", "depth") if hasattr(self, n)))
        require(self.width % self.heads == 0, f"--width {self.width} must be divisible by --heads {self.heads}")


CONDITIONS = ("sigma", "prior")


def check_condition(cfg) -> None:
    one_of(cfg, "condition_from", CONDITIONS)
    require(cfg.condition_noise >= 0, f"--condition-noise must be >= 0, got {cfg.condition_noise}")
    require(
        cfg.condition_from == "sigma" or 0 < cfg.condition_noise <= 1,
        f"--condition-noise prior:T needs a noise time T in (0, 1], got {cfg.condition_noise}",
    )


def parse_condition(spec: str) -> tuple[str, float]:
    """--condition-noise: 'prior:T' (the prior's own x0 estimates from t ~ U(0, T)), 'sigma:S' or a bare
    S (c + sigma z, sigma ~ U(0, S)) -> (condition_from, condition_noise)."""
    kind, _, value = spec.rpartition(":")
    kind = kind or "sigma"
    try:
        number = float(value)
    except ValueError:
        raise DihalError(f"cannot read --condition-noise '{spec}'; use prior:0.5, sigma:0.5 or 0.5") from None
    require(kind in CONDITIONS, f"cannot read --condition-noise '{spec}'; use prior:T or sigma:S")
    require(math.isfinite(number), f"--condition-noise must be finite, got {spec}")
    return kind, number


def check_evaluator(evaluator: str, backbone: str) -> None:
    """The comparison's primary evaluator must be a model other than the backbone (it judges the backbone's
    own choices otherwise): checked once, here, before any extract (the CLI) or model load (compare.check)."""
    same = lambda spec: Path(spec).expanduser().resolve()
    require(
        same(evaluator) != same(backbone),
        f"--evaluator {evaluator} is the backbone; the primary evaluator must be another model",
    )


def condition_label(cfg) -> str:
    return f"{cfg.condition_from}:{cfg.condition_noise:g}"


@dataclass(frozen=True, kw_only=True)
class MomentsConfig(Config):
    """A layer's per-dimension moments over an extract's training split (stages/moments.py), which every part
    normalizing by that layer shares. A stored layer's are the host's float64 pass over what is stored, whatever
    device trains; computed states (--states model) depend on the device and precision that compute them."""

    layer: int
    start: int  # the first position counted (1: the start token left out)
    states: str = "store"
    device: str | None = None  # the device type that computes the states (states: model), else None
    precision: str | None = None  # and its precision

    def check(self) -> None:
        one_of(self, "states", ("store", "model"))
        require(self.layer >= 0 and self.start in (0, 1), "moments of a layer >= 0 from position 0 or 1")
        require((self.states == "model") == (self.device is not None), "a device only for computed states")


@dataclass(frozen=True, kw_only=True)
class BridgeConfig(PartRecipe):
    """A bridge's whole recipe (METHOD §2); protocol fields come from PROTOCOLS."""

    protocol: str = "cpu-small"
    layer: int
    depth: int
    objective: str = "flow"
    prediction: str = "x0"
    skip_init: str = "ridge"  # "ridge": A starts at the least-squares map c -> y; "zero": plain init
    # the denoiser's output layer f's last linear: "plain" (PyTorch's init, every bridge before issue 66) or "zero"
    # (DiT's adaLN-Zero zeroes it too: f = 0 and the bridge starts at A c exactly)
    out_init: str = added("plain")
    condition_noise: float = 0.0  # sigma: sigma_max of c + sigma z; prior: T, the prior's estimates from t <= T
    condition_from: str = added("sigma")  # "sigma" or "prior" (METHOD §5's corrupted conditions)
    # the denoiser's positions: "rotary" (runs past --seq-len; the default by METHOD §2's rule,
    # measured: scripts/long_context.sh) or "learned" (ends at --seq-len; every bridge before issue 47)
    positions: str = added("rotary", old="learned")
    # where h_l comes from: "store" (read from the extract) or "model" (the backbone's first `layer` blocks run on
    # the training device on the token ids of the same sequences, issue 64: no layer but 0 read from the store)
    states: str = added("store")

    def check(self) -> None:
        super().check()
        require(self.layer >= 1, "--layer must be at least 1 (layer 0 is the condition itself)")
        one_of(self, "states", ("store", "model"))
        one_of(self, "prediction", PREDICTIONS)
        require(self.objective == "flow", "only --objective flow (rectified flow) is implemented")
        check_condition(self)
        one_of(self, "skip_init", ("ridge", "zero"))
        one_of(self, "out_init", ("plain", "zero"))
        one_of(self, "positions", ("learned", "rotary"))
        require(
            self.positions == "learned" or (self.width // self.heads) % 2 == 0,
            f"--positions rotary rotates pairs: --width / --heads ({self.width} / {self.heads}) must be even",
        )


@dataclass(frozen=True, kw_only=True)
class PriorConfig(PartRecipe):
    """A sequence prior over normalized states (METHOD §5); protocol fields come from PROTOCOLS."""

    protocol: str = "compare-cpu"
    layer: int = 0  # 0: normalized h_0; l >= 1: normalized h_l (DiHAL-direct)
    depth: int
    self_condition: bool = False  # SED
    latent: bool = added(False)  # over an autoencoder's latents (the LD4LG-style row) instead of a layer
    # the remedies of issue 52 (METHOD §5): train more at high noise, and teach the x0 estimate its token
    time_shift: float = added(1.0)  # t = s u / (1 + (s - 1) u), u ~ U(0, 1) (flow.shift_time); 1: uniform
    token_ce: float = added(0.0)  # weight of the cross-entropy of the x0 estimate's cosine-nearest token
    token_ce_max_t: float = added(1.0)  # the cross-entropy applies only where t <= this (1: at every t)
    # extract: the extract's stored h_0; corpus: its token ids, embedded by the backbone's table (no state read);
    # corpus:SPEC: the train split of another dataset (a builtin, local files or a hub id), tokenized here
    data: str = added("extract")
    # where h_l comes from: "store" (read from the extract) or "model" (the backbone's first `layer` blocks, none
    # for layer 0, on the training device, on the token ids of the same sequences: BridgeConfig.states, issue 64)
    states: str = added("store")

    def check(self) -> None:
        super().check()
        require(self.layer >= 0, f"--layer must be >= 0 (0: the embeddings), got {self.layer}")
        one_of(self, "states", ("store", "model"))
        require(
            self.states == "store" or (not self.latent and self.data == "extract"),
            "--states model computes the extract's layer from its token ids; leave it out for --latents and "
            "--data corpus (which read no stored layer either)",
        )
        require(not self.latent or self.layer == 0, "--latents models an autoencoder's latents; leave out --layer")
        check_prior_recipe(self.time_shift, self.token_ce, self.data, token_ce_max_t=self.token_ce_max_t)
        if self.reads_tokens:
            require(self.layer == 0 and not self.latent, "--data corpus and --token-ce model layer 0 (the tokens)")

    @property
    def reads_tokens(self) -> bool:
        """Whether training reads token ids (and the backbone's embedding table), not only stored states."""
        return self.data != "extract" or self.token_ce > 0


def check_prior_recipe(
    time_shift: float, token_ce: float, data: str, flag: str = "--", token_ce_max_t: float = 1.0
) -> None:
    """The prior's remedies (train-prior's --time-shift, --token-ce[-max-t], --data; compare's --prior-*), once."""
    require(
        math.isfinite(time_shift) and time_shift > 0,
        f"{flag}time-shift must be a finite number > 0 (1: t uniform; 3: toward noise), got {time_shift}",
    )
    require(math.isfinite(token_ce) and token_ce >= 0, f"{flag}token-ce must be a finite weight >= 0, got {token_ce}")
    require(
        math.isfinite(token_ce_max_t) and 0 < token_ce_max_t <= 1,
        f"{flag}token-ce-max-t must be a time in (0, 1] (1: the cross-entropy at every t), got {token_ce_max_t}",
    )
    require(
        token_ce > 0 or token_ce_max_t == 1,
        f"{flag}token-ce-max-t limits the token cross-entropy; give {flag}token-ce w > 0 with it",
    )
    require(
        data == "extract" or data == "corpus" or data.startswith("corpus:") and data[7:],
        f"{flag}data must be extract, corpus or corpus:SPEC (a dataset), got {data!r}",
    )


@dataclass(frozen=True, kw_only=True)
class DecoderTrainConfig(PartRecipe):
    """CoDAR's decoder (METHOD §5): the protocol's width, depth DECODER_DEPTH."""

    protocol: str = "compare-cpu"
    condition_noise: float = COMPARISON_CONDITION_NOISE
    condition_from: str = added("sigma")
    # where its condition h_0 comes from: "store" (the extract's layer 0) or "model" (the backbone's embedding of
    # the extract's token ids on the training device, no stored layer read: BridgeConfig.states, issue 64)
    states: str = added("store")

    def check(self) -> None:
        super().check()
        check_condition(self)
        one_of(self, "states", ("store", "model"))


@dataclass(frozen=True, kw_only=True)
class AutoencoderConfig(PartRecipe):
    """The LD4LG-style row's autoencoder (METHOD §5): a Perceiver resampler from the frozen backbone's
    last-layer states to `latents` x `latent_dim`, and the CoDAR decoder (frozen table) reading them."""

    protocol: str = "compare-cpu"
    latents: int = 8
    latent_dim: int = 64
    # where h_L comes from: "store" (the extract's last layer) or "model" (every block of the backbone, issue 64)
    states: str = added("store")

    def check(self) -> None:
        super().check()
        at_least(self, 1, "latents", "latent_dim")
        one_of(self, "states", ("store", "model"))


# -- locate ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DataConfig(Config):
    """`dataset` and the `also` sources are each a builtin, local files, a hub id or generate:<ID> (a
    generate artifact's token ids); with `also`, `mix` gives each source's share of the sequences
    of each split (dataset first)."""

    dataset: str = "pydoc"
    dataset_config: str | None = None
    split: str = "train"  # the hub split to stream
    text_field: str = "text"
    seq_len: int = 64
    val_fraction: float = 0.1
    max_sequences: int | None = None
    seed: int = 0
    also: tuple[str, ...] = added((), when=lambda c: not c.also)  # more sources after dataset (repeated --dataset)
    mix: tuple[float, ...] = added((), when=lambda c: not c.also)  # their shares, dataset's first, summing to 1
    # dolma: sources only: shards chosen of each Dolma source (stages/text/dolma.py), documents in the seeded
    # shuffle buffer (0 or 1: none)
    dolma_shards: int = added(1, when=lambda c: not c.reads_dolma)
    shuffle_buffer: int = added(10_000, when=lambda c: not c.reads_dolma)

    def check(self) -> None:
        require(self.seq_len >= 2, f"--seq-len must be at least 2 (a start token and one more), got {self.seq_len}")
        require(0 <= self.val_fraction < 1, f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        at_least(self, 1, "max_sequences")
        require(bool(self.text_field), "--text-field must name a field")
        require(all(self.sources), "--dataset must name a builtin, local files, a hub id or generate:<ID>")
        require(len(set(self.sources)) == len(self.sources), "--dataset names a source twice; give each once")
        require(
            len(self.mix) == len(self.sources) if self.also else not self.mix,
            f"--mix gives {len(self.mix)} shares for {len(self.sources)} --dataset sources; give one share each"
            if self.also
            else "--mix needs two or more --dataset sources to share out",
        )
        require(all(0 < m < 1 for m in self.mix), f"--mix shares must each be in (0, 1), got {list(self.mix)}")
        require(not self.mix or abs(sum(self.mix) - 1) < 1e-6, f"--mix shares must sum to 1, got {sum(self.mix):g}")
        at_least(self, 1, "dolma_shards")
        at_least(self, 0, "shuffle_buffer")

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.dataset, *self.also)

    @property
    def shares(self) -> tuple[float, ...]:
        return self.mix or (1.0,)

    @property
    def reads_dolma(self) -> bool:
        return any(s.startswith("dolma:") for s in self.sources)


def parse_layers(spec: str, num_blocks: int | None, none_ok: bool = False) -> list[int]:
    """'all' | '0-4' | '0,3,7' (mixed allowed: '0,2-4') -> sorted indices in 0..L (L unknown: syntax only);
    none_ok: 'none' -> [] (an extract of token ids alone, for parts that compute their states)."""
    if spec == "none" and none_ok:
        return []
    if spec == "all":
        return list(range(num_blocks + 1)) if num_blocks is not None else []
    layers: set[int] = set()
    try:
        for part in spec.split(","):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-"))
                require(lo <= hi, f"--layers range {lo}-{hi} is reversed; write {hi}-{lo}")
                layers.update(range(lo, hi + 1))
            else:
                layers.add(int(part))
    except ValueError:
        raise DihalError(f"cannot read --layers '{spec}'; use all, a range like 0-4, or a list like 0,3,7") from None
    if num_blocks is None:
        return sorted(layers)
    bad = sorted(x for x in layers if not 0 <= x <= num_blocks)
    if bad or not layers:
        raise DihalError(
            f"layer {bad[0] if bad else spec} is out of range: this model has layers 0..{num_blocks} "
            f"({num_blocks} blocks)"
        )
    return sorted(layers)


EXTRACT_KEEPS = ("layers", "pool")


@dataclass(frozen=True, kw_only=True)
class ExtractConfig(Config):
    model: str = "smollm2-135m"
    revision: str | None = None
    data: DataConfig = DataConfig()
    layers: str = "all"
    store_dtype: str = "auto"
    batch_size: int = 8  # sequences per forward pass and per Zarr chunk
    score_pool: int = 16384  # train positions whose states are also kept apart for `dihal score` (0: none)
    device: str = "cpu"
    dtype: str = "float32"
    trust_remote_code: bool = False
    # layers: every position of every layer; pool: layer 0 whole (r2_token reads the positions before each of
    # its own there) and every other layer at the score's pool alone, what `dihal score` reads (issue 64)
    keep: str = added("layers")

    def check(self) -> None:
        require(
            self.store_dtype in STORE_DTYPES,
            f"--store-dtype {self.store_dtype} would not keep the states; use {', '.join(STORE_DTYPES)}",
        )
        at_least(self, 1, "batch_size")
        require(self.score_pool >= 0, f"--score-pool must be >= 0 (0: none), got {self.score_pool}")
        parse_layers(self.layers, None, none_ok=True)  # syntax and order now; the range once the model is known
        one_of(self, "keep", EXTRACT_KEEPS)
        if self.keep == "pool":
            require(
                self.score_pool > 0, "--keep pool keeps the layers at the score's pool alone; give --score-pool > 0"
            )
            require(self.layers != "none", "--keep pool keeps layers at the score's pool; --layers none keeps none")


def excluded_positions(spec: str) -> list[int]:
    try:
        positions = [int(p) for p in spec.split(",") if p.strip()] if spec else []
    except ValueError:
        raise DihalError(f"cannot read --exclude-positions '{spec}'; use a comma list like 0 or 0,1") from None
    require(all(p >= 0 for p in positions), "--exclude-positions must be positions >= 0")
    return positions


@dataclass(frozen=True, kw_only=True)
class ScoreConfig(Config):
    tokens: int = 4096
    k: int = 64
    eps_rel: float = 1e-3
    pairs: int = 8192
    normalize: str = "none"
    exclude_positions: str = "0"
    candidates: str | None = None  # None: 1..L-1
    split: str = "train"
    seed: int = 0
    device: str = "cpu"
    chunk: int = 512  # points per batched kNN / Gram block; bounds memory, not results
    bootstrap: int = 0  # B more draws of --tokens positions, for the stability of S and l*
    outlier_mads: float | None = None  # also the robust proxies, outlier-norm positions left out
    r2_penalty: str = added("kfold", old="gcv")  # how r2_token's and r2_context's ridge penalty is chosen
    select: str = added("S")  # which pick is l*: "S" (argmax of the paper's score) or "r2_token" (its argmax)
    proxies: str = "all"  # "all": every registered proxy; "paper": the paper's alone (the id lists them)

    def check(self) -> None:
        excluded_positions(self.exclude_positions)
        at_least(self, 3, "tokens")
        at_least(self, 2, "k")
        at_least(self, 1, "pairs", "chunk")
        at_least(self, 0, "bootstrap")
        require(self.k < self.tokens, f"--k {self.k} must be smaller than --tokens {self.tokens}")
        require(self.eps_rel > 0, f"--eps-rel must be > 0, got {self.eps_rel}")
        if self.candidates is not None:
            parse_layers(self.candidates, None)
        one_of(self, "normalize", NORMALIZATIONS)
        one_of(self, "split", SPLITS)
        require(
            self.outlier_mads is None or self.outlier_mads > 0, f"--outlier-mads must be > 0, got {self.outlier_mads}"
        )
        one_of(self, "r2_penalty", R2_PENALTIES)
        one_of(self, "select", SELECTIONS)
        one_of(self, "proxies", PROXY_SETS)
        require(
            self.select == "S" or self.proxies == "all",
            f"--select {self.select} picks by a proxy --proxies paper leaves out; use --proxies all",
        )


# -- use ------------------------------------------------------------------------------------------------
def parse_steps(spec: str) -> tuple[int, ...]:
    try:
        steps = tuple(sorted({int(s) for s in spec.split(",") if s.strip()}))
    except ValueError:
        raise DihalError(f"cannot read --sample-steps '{spec}'; use a comma list like 4,8,16") from None
    require(bool(steps) and min(steps) >= 1, "--sample-steps must list positive integers")
    return steps


@dataclass(frozen=True, kw_only=True)
class FidelityConfig(Config):
    sample_steps: tuple[int, ...] = (1, 4, 8, 16)  # Euler steps of the bridge sampler, compared
    limit: int = 64  # held-out sequences
    batch_size: int = 16
    seed: int = 0
    dataset: str | None = None  # a dataset spec to measure on; None: the extract's validation split
    device: str = "cpu"
    dtype: str = "float32"

    def check(self) -> None:
        require(bool(self.sample_steps) and min(self.sample_steps) >= 1, "--sample-steps must list positive integers")
        at_least(self, 1, "limit", "batch_size")
        require(self.dataset is None or bool(self.dataset), "--dataset must name a builtin, local files or a hub id")


@dataclass(frozen=True, kw_only=True)
class SamplesConfig(Config):
    evaluator: str | None = None  # model spec; None = the bridge's original backbone
    limit: int = 64
    batch_size: int = 16
    device: str = "cpu"
    dtype: str = "float32"

    def check(self) -> None:
        at_least(self, 1, "limit", "batch_size")


READOUTS = ("independent", "guided", "refine:K", "causal")


def readout_parts(spec: str) -> tuple[str, int]:
    """--readout independent|guided|refine:K|causal -> (kind, K); one line for anything else."""
    kind, _, k = spec.partition(":")
    if kind == "refine":
        require(k.isdigit(), f"--readout refine:K takes a whole number K >= 0 of refining passes, got '{spec}'")
        return kind, int(k)
    require(
        kind in ("independent", "guided", "causal") and not k,
        f"unknown --readout '{spec}'; use one of {', '.join(READOUTS)}",
    )
    return kind, 0


@dataclass(frozen=True, kw_only=True)
class GenerateConfig(Config):
    prompts: tuple[str, ...] = ()
    num_samples: int = 8
    max_new_tokens: int = 48
    temperature: float | None = None  # None: 1.0 where the recovery ends in a distribution; rounding takes none
    top_k: int = 0
    top_p: float = 1.0
    sample_steps: int = 8  # Euler steps of the bridge sampler per position
    batch_size: int = 8
    mode: str = "ar"  # ar: the hybrid, token by token; parallel: a prior's samples, recovered (METHOD §5)
    baseline: str = "none"  # "original": also generate with the unmodified backbone; "original-only": it alone
    prior_steps: int = 50  # parallel: Euler steps of the prior
    recovery: str = "rounding"  # parallel: a name of stages/registry.py's RECOVERIES
    clamp: bool = False  # parallel: Diffusion-LM clamping of each step's x0 estimate
    # parallel, --recovery hidden: independent, guided, refine:K, causal (METHOD §5.1)
    readout: str = added("independent", when=lambda c: c.readout == "independent")
    # gamma of guided, refine:K and causal: a multiplier of the prior's own calibration s^2
    guidance: float = added(1.0, when=lambda c: c.readout == "independent")
    # parallel: prior (its samples), null (its initial noise), oracle (held-out real states)
    source: str = added("prior", when=lambda c: c.mode == "ar")
    cache: bool = True
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    model: str | None = added(None)  # --baseline original-only: the backbone (no bridge)
    # ar: prompts are the first prompt_tokens tokens of this dataset's documents, num_prompts of them (of its
    # train split), num_samples each
    prompts_from: str | None = added(None)
    prompt_tokens: int = added(8, when=lambda c: c.prompts_from is None)
    num_prompts: int = added(64, when=lambda c: c.prompts_from is None)
    # ar: the hybrid's bridge samples from its noise times this (0: the flow's mean path, one state per context;
    # chosen by the rule of docs/results/hybrid_generation.md); 1 is every generation's before it existed
    bridge_noise: float = added(
        BRIDGE_NOISE, when=lambda c: c.mode == "parallel" or c.baseline == "original-only" or c.bridge_noise == 1.0
    )

    def check(self) -> None:
        one_of(self, "mode", ("ar", "parallel"))
        noise = self.bridge_noise
        require(0 <= noise <= 1 and math.isfinite(noise), f"--bridge-noise must be in [0, 1], got {noise}")
        require(
            (self.mode == "ar" and self.baseline != "original-only") or noise == BRIDGE_NOISE,
            "--bridge-noise scales the AR hybrid's bridge; --mode parallel and --baseline original-only take none",
        )
        require(
            self.baseline != "original-only" or self.model is not None,
            "--baseline original-only samples a backbone alone; name it with --model",
        )
        require(
            self.model is None or self.baseline == "original-only",
            "--model is for --baseline original-only; a hybrid's backbone is its bridge's",
        )
        require(self.baseline != "original-only" or self.mode == "ar", "--baseline original-only is --mode ar")
        require(not (self.prompts_from and self.prompts), "give --prompt/--prompts-file or --prompts-from, not both")
        require(self.mode == "ar" or not self.prompts_from, "--mode parallel takes no prompts; drop --prompts-from")
        at_least(self, 1, "prompt_tokens", "num_prompts")
        require(
            self.mode != "parallel" or not self.prompts,
            "--mode parallel generates whole sequences from the start token; leave out --prompt",
        )
        one_of(self, "recovery", tuple(RECOVERIES))
        require(0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        require(
            self.temperature is None or self.temperature >= 0,
            f"--temperature must be >= 0 (0 = greedy), got {self.temperature}",
        )
        at_least(self, 0, "top_k")
        require(
            not self.rounds or (self.temperature is None and self.top_p == 1 and not self.top_k),
            "--recovery rounding is deterministic (the cosine-nearest token embedding); "
            "leave out --temperature, --top-p and --top-k",
        )
        at_least(self, 1, "prior_steps", "num_samples", "max_new_tokens", "sample_steps", "batch_size")
        one_of(self, "baseline", ("none", "original", "original-only"))
        one_of(self, "source", SOURCES)
        require(self.mode == "parallel" or self.source == "prior", "--source applies to --mode parallel only")
        require(self.source == "prior" or not self.clamp, "--clamp acts on the prior's steps; --source prior only")
        kind, passes = readout_parts(self.readout)
        require(self.guidance >= 0, f"--guidance must be >= 0 (0: the independent readout), got {self.guidance}")
        require(
            kind == "independent" or (self.mode == "parallel" and self.recovery == "hidden"),
            f"--readout {self.readout} reads the upper blocks' logits: it goes with --mode parallel --recovery hidden"
            + ("" if self.mode == "ar" else f"; --recovery {self.recovery} has no logits to read"),
        )

    @property
    def readout_kind(self) -> tuple[str, int]:
        """(independent|guided|refine|causal, K): K the refining passes (0 but for refine:K)."""
        return readout_parts(self.readout)

    @property
    def rounds(self) -> bool:
        """Its tokens come from rounding (no distribution to sample from)."""
        return self.mode == "parallel" and self.recovery == "rounding"

    @property
    def decoding_temperature(self) -> float | None:
        """The temperature actually used: None for rounding, else the given one or 1.0."""
        return None if self.rounds else 1.0 if self.temperature is None else self.temperature

    def hashed(self) -> dict:
        """Config.hashed with the temperature actually used (None and 1.0 are one run)."""
        return {**super().hashed(), "temperature": self.decoding_temperature}


@dataclass(frozen=True)
class OwnTextConfig(Config):
    """The bridge's training text (docs/results/own_text.md): `own_text` of the extract's sequences are
    the backbone's own unprompted samples, `own_samples` of them drawn at `own_seed` (seq_len - 1 new
    tokens each, batch_size at a time), the rest the corpus. 0: the corpus alone, as in the paper."""

    own_text: float = 0.0
    own_samples: int | None = None  # None: auto, sized from the share before any sample is written (stages/own_text.py)
    own_seed: int = 100  # evaluation draws its held-out own samples at another seed (scripts/own_text.sh: 200)
    batch_size: int = 32

    def check(self) -> None:
        require(
            0 <= self.own_text <= 1, f"--own-text must be a share in [0, 1] (0: the corpus alone), got {self.own_text}"
        )
        at_least(self, 1, "own_samples", "batch_size")
        at_least(self, 0, "own_seed")


# -- claims ----------------------------------------------------------------------------------------------
def overrides_recipe(protocol: str, overrides: tuple, layer: int = 1) -> None:
    """The protocol with these overrides makes a valid bridge recipe (checked before any work)."""
    BridgeConfig.from_protocol(protocol, layer=layer, **dict(overrides))


@dataclass(frozen=True, kw_only=True)
class SweepConfig(Config):
    layers: tuple[int, ...]
    protocol: str = "sweep-tiny"
    overrides: tuple[tuple[str, object], ...] = ()  # protocol fields changed for every layer alike
    sample_steps: int = 8  # Euler steps for each bridge's fidelity
    eval_limit: int = 32
    seeds: tuple[int, ...] = (0,)  # a bridge per layer and seed; the loss of a layer is the mean
    device: str = "cpu"
    dtype: str = "float32"

    def check(self) -> None:
        require(bool(self.layers), "--layers must name at least one layer")
        at_least(self, 1, "sample_steps", "eval_limit")
        distinct_seeds(self.seeds)
        for layer in self.layers:  # every layer's recipe is valid before the first one trains
            overrides_recipe(self.protocol, self.overrides, layer)


@dataclass(frozen=True, kw_only=True)
class HarnessConfig(Config):
    """`dihal evaluate --bridge ID --lm-eval TASKS`: lm-evaluation-harness tasks on the hybrid and on its
    backbone, both read in windows of the bridge's positions (stages/evaluate_harness.py)."""

    tasks: tuple[str, ...]
    include: str | None = None  # a folder of task YAMLs (--lm-eval-include); its files' digest is in the id
    limit: int | None = None  # documents per task; None: all
    num_fewshot: int | None = None  # few-shot examples per document (--lm-eval-fewshot); None: each task's own
    log_samples: bool = False  # keep every document's prompt, answers and scores (--lm-eval-log-samples)
    batch_size: int = 16
    sample_steps: int = GenerateConfig.sample_steps  # the hybrid's bridge steps
    seed: int = 0  # the hybrid's noise (stages/hybrid_lm.py) and the harness's seeds
    device: str = "cpu"
    dtype: str = "float32"

    def check(self) -> None:
        require(bool(self.tasks) and all(self.tasks), "--lm-eval must name at least one task, e.g. hellaswag")
        at_least(self, 1, "batch_size", "sample_steps")
        require(self.limit is None or self.limit >= 1, f"--lm-eval-limit must be >= 1, got {self.limit}")
        require(
            self.num_fewshot is None or self.num_fewshot >= 0, f"--lm-eval-fewshot must be >= 0, got {self.num_fewshot}"
        )


@dataclass(frozen=True, kw_only=True)
class ExportConfig(Config):
    """`dihal export OUT`: a bridge as a package that leaves its store (stages/export.py): the sampling
    defaults it carries, and the hub repo it goes to."""

    out: str
    sample_steps: int = GenerateConfig.sample_steps  # the package's default bridge Euler steps per position
    seed: int = 0  # the package's default noise seed (stages/hybrid_lm.py)
    push_to_hub: str | None = None  # a hub repo id, owner/name
    private: bool = False

    def check(self) -> None:
        at_least(self, 1, "sample_steps")
        repo = self.push_to_hub
        require(
            repo is None or (repo.count("/") == 1 and all(repo.split("/"))),
            f"--push-to-hub takes owner/name, got {repo}",
        )
        require(not self.private or repo is not None, "--private goes with --push-to-hub REPO")


@dataclass(frozen=True, kw_only=True)
class CompareConfig(Config):
    layer: int | None = None  # l*; None: the score's argmax S
    oracle: int | None = None  # a sweep's oracle layer, for an extra DiHAL row
    protocol: str = "compare-cpu"
    seeds: tuple[int, ...] = (0, 1)
    num_samples: int = 256
    prior_steps: int = GenerateConfig.prior_steps
    sample_steps: int = GenerateConfig.sample_steps
    condition_noise: float = COMPARISON_CONDITION_NOISE
    condition_from: str = "prior"  # METHOD §5's default prior:0.5; "sigma": method revision 1's c + sigma z
    evaluator: str | None = None  # the primary evaluator, a model other than the backbone; None: the other builtin
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)  # the decoding grid of every row that ends in a distribution
    top_p: float = 1.0
    rows: tuple[str, ...] = ()  # registry row keys; (): every row
    controls: tuple[str, ...] = (
        "sed",
        "codar",
        "ld4lg",
        "dihal",
        "dihal-direct",
    )  # rows whose recovery gets oracle/null
    budgets: tuple[int, ...] = (1, 5)  # multiples of the protocol's steps; every part trains at each
    # DiHAL (l*)'s readouts (METHOD §5.1): each but independent a row; gamma of the guided ones
    readouts: tuple[str, ...] = added(("independent",))
    guidance: float = added(GenerateConfig.guidance, when=lambda c: c.readouts == ("independent",))
    batch_size: int = 32  # samples per generation batch
    overrides: tuple[tuple[str, object], ...] = ()  # protocol fields changed for every part alike
    device: str = "cpu"
    dtype: str = "float32"
    # the remedies of every prior over h_0 (train-prior's --time-shift, --token-ce, --data; docs/results/prior.md)
    prior_time_shift: float = added(1.0)
    prior_token_ce: float = added(0.0)
    prior_token_ce_max_t: float = added(1.0)
    prior_data: str = added("extract")
    # where the parts over h_l (l >= 1: the bridges, DiHAL-direct's prior) get it: BridgeConfig.states (issue 64)
    states: str = added("store")

    def check(self) -> None:
        distinct_seeds(self.seeds)
        one_of(self, "states", ("store", "model"))
        check_prior_recipe(
            self.prior_time_shift, self.prior_token_ce, self.prior_data, "--prior-", self.prior_token_ce_max_t
        )
        at_least(self, 1, "num_samples", "prior_steps", "sample_steps", "batch_size", "layer", "oracle")
        check_condition(self)
        require(bool(self.temperatures), "--temperatures must name at least one temperature")
        for t in self.temperatures:
            require(t >= 0, f"--temperatures must be >= 0 (0 = argmax), got {t}")
        require(len(set(self.temperatures)) == len(self.temperatures), "--temperatures repeats a value")
        require(0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        for name in self.rows + self.controls:
            require(name in ROW_KEYS, f"unknown row '{name}'; the rows are {', '.join(ROW_KEYS)}")
        require(not self.rows or "dihal" in self.rows, "--rows must include dihal: claim 3 compares it with the rest")
        for name in self.controls:
            require(
                not self.rows or name in self.rows,
                f"--controls {name}: that row is not in --rows, so its recovery is not trained",
            )
        require(bool(self.budgets), "--budgets must name at least one multiple of the protocol's steps")
        for k in self.budgets:
            require(isinstance(k, int) and k >= 1, f"--budgets must be whole multiples >= 1, got {k}")
        require(len(set(self.budgets)) == len(self.budgets), "--budgets repeats a value")
        overrides_recipe(self.protocol, self.overrides)
        require("independent" in self.readouts, "--readout must include independent: DiHAL (l*)'s own row reads it")
        for readout in self.readouts:
            readout_parts(readout)
        require(len(set(self.readouts)) == len(self.readouts), "--readout repeats a value")
        require(self.guidance >= 0, f"--guidance must be >= 0 (0: the independent readout), got {self.guidance}")


@dataclass(frozen=True, kw_only=True)
class ConfirmConfig(Config):
    protocol: str = "cpu-small"
    at: tuple[str, ...] = ("l_star", "oracle", "worst")  # sweep names or layer numbers
    seeds: tuple[int, ...] = (0, 1, 2)
    overrides: tuple[tuple[str, object], ...] = ()  # protocol fields changed for every bridge alike
    sample_steps: int = GenerateConfig.sample_steps
    eval_limit: int = FidelityConfig.limit  # held-out sequences for fidelity
    num_samples: int = 64  # AR hybrid generations per layer and seed
    evaluator: str | None = None  # the second evaluator; None: the other builtin
    batch_size: int = 16
    device: str = "cpu"
    dtype: str = "float32"

    def check(self) -> None:
        require(bool(self.at), "--at must name at least one layer: l_star, oracle, worst or a number")
        for name in self.at:
            require(
                name in CONFIRM_NAMED or (name.isdigit() and int(name) >= 1),
                f"cannot read --at '{name}'; use l_star, oracle, worst or a layer number >= 1",
            )
        distinct_seeds(self.seeds)
        at_least(self, 1, "sample_steps", "eval_limit", "num_samples", "batch_size")
        overrides_recipe(self.protocol, self.overrides)
