"""`dihal train-bridge`: docs/method.md section 2 (replace: the conditional diffusion bridge).

The bridge models h_l (positions 1..T-1, normalized per dimension) given c = h_0 (normalized
with its own statistics); position 0 (BOS, the attention sink) is one stored constant vector.
Training randomness is drawn per step from (seed, step), so a resumed run replays exactly
what an uninterrupted one would have done.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from artifacts import files
from artifacts import hidden_states as hs
from artifacts.errors import DihalError
from artifacts.store import Artifact, ArtifactStore
from stages.diffusion import flow
from stages.diffusion.denoiser import Denoiser, DenoiserConfig
from stages.runtime import plotting
from stages.runtime.progress import NullProgress, Progress

STAGE = "bridge"

PROTOCOLS: dict[str, dict] = {
    # the measurement setting of docs/method.md section 2 with 1000 steps instead of 600 (about 7 minutes on two
    # CPU cores for smollm2-135m): at layer 3, 600 steps gave top-1 0.642 at 8 steps, 1000 gave 0.659
    "cpu-small": dict(
        steps=1000,
        epochs=None,
        batch_size=32,
        lr=1e-3,
        warmup=30,
        schedule="cosine",
        ema=0.995,
        width=256,
        depth=4,
        heads=4,
        eval_every=100,
        checkpoint_every=50,
        val_sequences=64,
    ),
    # one fixed short budget per layer for sweeps (under 2 minutes a layer on CPU)
    "sweep-tiny": dict(
        steps=150,
        epochs=None,
        batch_size=32,
        lr=2e-3,
        warmup=15,
        schedule="cosine",
        ema=0.99,
        width=256,
        depth=4,
        heads=4,
        eval_every=75,
        checkpoint_every=50,
        val_sequences=64,
    ),
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


PROTOCOL_FIELDS = tuple(PROTOCOLS["cpu-small"])


@dataclass(frozen=True, kw_only=True)
class BridgeConfig:
    """A bridge's whole training recipe. Protocol fields have no default here: they come from
    PROTOCOLS (one place), through BridgeConfig.from_protocol, with named overrides."""

    layer: int
    protocol: str
    steps: int | None
    epochs: int | None
    batch_size: int
    lr: float
    warmup: int
    schedule: str
    ema: float
    width: int
    depth: int
    heads: int
    eval_every: int
    checkpoint_every: int
    val_sequences: int
    objective: str = "flow"
    prediction: str = "x0"
    skip_init: str = "ridge"  # "ridge": A starts at the least-squares map c -> y; "zero": plain init
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"

    @staticmethod
    def from_protocol(layer: int, protocol: str, **overrides) -> BridgeConfig:
        """PROTOCOLS[protocol] with the given fields replaced; None leaves a field as the protocol has it,
        and a name that is not a field is refused (never dropped)."""
        if protocol not in PROTOCOLS:
            raise DihalError(f"unknown --protocol '{protocol}'; use one of {', '.join(PROTOCOLS)}")
        known = {f.name for f in fields(BridgeConfig)} - {"layer", "protocol"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise DihalError(f"unknown bridge setting '{unknown[0]}'; settings are {', '.join(sorted(known))}")
        values = {**PROTOCOLS[protocol], **{k: v for k, v in overrides.items() if v is not None}}
        if overrides.get("epochs") is not None and overrides.get("steps") is None:
            values["steps"] = None  # --epochs alone: the run length comes from the epochs
        return BridgeConfig(layer=layer, protocol=protocol, **values)

    def __post_init__(self) -> None:
        if self.layer < 1:
            raise DihalError("--layer must be at least 1 (layer 0 is the condition itself)")
        if self.prediction not in flow.PREDICTIONS:
            raise DihalError(f"unknown --prediction '{self.prediction}'; use x0 or velocity")
        if self.objective != "flow":
            raise DihalError("only --objective flow (rectified flow) is implemented")
        if self.skip_init not in ("ridge", "zero"):
            raise DihalError(f"unknown --skip-init '{self.skip_init}'; use ridge or zero")
        if self.schedule not in ("cosine", "constant"):
            raise DihalError(f"unknown schedule '{self.schedule}'; use cosine or constant")
        if self.steps is None and self.epochs is None:
            raise DihalError("give --train-steps or --epochs")
        for name in ("steps", "epochs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise DihalError(f"--{'train-steps' if name == 'steps' else name} must be at least 1")
        for name in ("batch_size", "width", "depth", "heads", "eval_every", "checkpoint_every", "val_sequences"):
            if getattr(self, name) < 1:
                raise DihalError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.warmup < 0 or not 0 <= self.ema < 1 or self.grad_clip < 0 or self.weight_decay < 0:
            raise DihalError("--lr must be > 0, --warmup >= 0, --ema in [0, 1), grad clip and weight decay >= 0")
        if self.width % self.heads:
            raise DihalError(f"--width {self.width} must be divisible by --heads {self.heads}")


def resolve_config(layer: int, protocol: str, overrides: dict) -> BridgeConfig:
    return BridgeConfig.from_protocol(layer, protocol, **overrides)


# -- data -----------------------------------------------------------------------------------------
@dataclass
class BridgeData:
    cond: torch.Tensor  # (N, T, D) raw layer-0 states
    target: torch.Tensor  # (N, T, D) raw layer-l states


def load_split(group, layer: int, split: str, limit: int | None = None) -> BridgeData:
    seqs = hs.split_indices(group, split)
    if limit is not None:
        seqs = seqs[:limit]
    if seqs.size == 0:
        raise DihalError(
            f"the extract has no {split} sequences; extract with --val-fraction > 0 and more --max-sequences"
        )
    read = lambda l: torch.from_numpy(hs.read_sequences(group, l, seqs).astype(np.float32))  # noqa: E731
    return BridgeData(read(0), read(layer))


def covered_start(group) -> int:
    """1 when every sequence starts with the same token (BOS): position 0 is then a constant."""
    first = np.asarray(group["input_ids"][:, 0])
    return 1 if first.size and (first == first[0]).all() else 0


@dataclass
class Normalizer:
    mu_y: torch.Tensor
    sigma_y: torch.Tensor
    mu_c: torch.Tensor
    sigma_c: torch.Tensor
    pos0: torch.Tensor  # (D,) the constant layer-l state at position 0 (zeros when start == 0)

    @staticmethod
    def fit(data: BridgeData, start: int) -> Normalizer:
        y = data.target[:, start:].reshape(-1, data.target.shape[-1]).double()
        c = data.cond[:, start:].reshape(-1, data.cond.shape[-1]).double()
        pos0 = data.target[:, 0].double().mean(0) if start == 1 else torch.zeros(data.target.shape[-1])
        std = lambda x: x.std(0).clamp_min(1e-6)  # noqa: E731
        return Normalizer(y.mean(0).float(), std(y).float(), c.mean(0).float(), std(c).float(), pos0.float())

    def y(self, h: torch.Tensor) -> torch.Tensor:
        return (h - self.mu_y) / self.sigma_y

    def c(self, h0: torch.Tensor) -> torch.Tensor:
        return (h0 - self.mu_c) / self.sigma_c

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.sigma_y + self.mu_y

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "mu_y": self.mu_y,
            "sigma_y": self.sigma_y,
            "mu_c": self.mu_c,
            "sigma_c": self.sigma_c,
            "pos0": self.pos0,
        }

    def to(self, device) -> Normalizer:
        return Normalizer(**{k: v.to(device) for k, v in self.tensors().items()})


# -- the bridge at use time -----------------------------------------------------------------------
class Bridge:
    """A trained bridge: h_0 sequence -> sampled h_l sequence (raw units, position 0 exact)."""

    def __init__(self, net: Denoiser, norm: Normalizer, layer: int, start: int, prediction: str):
        self.net, self.norm, self.layer, self.start, self.prediction = net.eval(), norm, layer, start, prediction

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    @staticmethod
    def load(art: Artifact, device: str = "cpu", weights: str = "ema") -> Bridge:
        meta = json.loads(art.file("bridge.json").read_text())
        net = Denoiser(DenoiserConfig(**meta["denoiser"]))
        net.load_state_dict(
            files.load_tensors(
                art.file(f"weights_{weights}.safetensors" if weights == "ema" else "weights.safetensors")
            )
        )
        norm = Normalizer(**files.load_tensors(art.file("stats.safetensors")))
        return Bridge(net.to(device), norm.to(device), meta["layer"], meta["start"], meta["prediction"])

    def cached_sampler(self, steps: int, batch: int) -> CachedSampler:
        return CachedSampler(self, steps, batch)

    def noise(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """Noise for the covered positions, drawn once per position."""
        return torch.randn(batch, length - self.start, self.net.cfg.dim, generator=generator).to(self.device)

    @torch.no_grad()
    def sample(self, h0: torch.Tensor, steps: int, noise: torch.Tensor) -> torch.Tensor:
        """h0: (B, T, D) raw layer-0 states -> (B, T, D) raw layer-l states."""
        c = self.norm.c(h0[:, self.start :].float())
        y = flow.sample(lambda x, t, i: self.net(x, t, c), noise[:, : c.shape[1]], steps, self.prediction)
        return self._assemble(y, h0.shape[0])

    def _assemble(self, y: torch.Tensor, batch: int) -> torch.Tensor:
        h = self.norm.unnormalize(y)
        if self.start == 1:
            h = torch.cat([self.norm.pos0.expand(batch, 1, -1), h], dim=1)
        return h


class CachedSampler:
    """Incremental bridge sampling for generation: each new position runs the denoiser once per
    Euler step against that step's key/value cache of earlier positions; nothing is recomputed."""

    def __init__(self, bridge: Bridge, steps: int, batch: int):
        self.bridge, self.steps, self.batch = bridge, steps, batch
        self.caches = [bridge.net.new_caches() for _ in range(steps)]
        self.done = 0  # covered positions already sampled

    @torch.no_grad()
    def extend(self, h0_new: torch.Tensor, noise_new: torch.Tensor) -> torch.Tensor:
        """h0_new: (B, n, D) layer-0 states of the next n positions (absolute positions continue)."""
        b = self.bridge
        if self.done == 0 and b.start == 1:
            first, h0_new = h0_new[:, :1], h0_new[:, 1:]
        else:
            first = None
        out = []
        if h0_new.shape[1]:
            c = b.norm.c(h0_new.float())
            start = self.done
            y = flow.sample(
                lambda x, t, i: b.net(x, t, c, start, self.caches[i]),
                noise_new[:, : c.shape[1]],
                self.steps,
                b.prediction,
            )
            self.done += c.shape[1]
            out.append(b.norm.unnormalize(y))
        if first is not None:
            out.insert(0, b.norm.pos0.expand(h0_new.shape[0], 1, -1))
        return torch.cat(out, dim=1)


# -- training ------------------------------------------------------------------------------------
def lr_at(step: int, total: int, cfg: BridgeConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def ridge_skip(net: Denoiser, y: torch.Tensor, c: torch.Tensor, samples: int = 16384, seed: int = 0) -> None:
    """Start A at the ridge least-squares map from c to y (normalized units)."""
    flat_c, flat_y = c.reshape(-1, c.shape[-1]), y.reshape(-1, y.shape[-1])
    pick = torch.randperm(flat_c.shape[0], generator=torch.Generator().manual_seed(seed))[:samples]
    cc = torch.cat([flat_c[pick].double(), torch.ones(len(pick), 1, dtype=torch.float64)], dim=1)
    gram = cc.T @ cc + 1e-3 * len(pick) * torch.eye(cc.shape[1], dtype=torch.float64)
    sol = torch.linalg.solve(gram, cc.T @ flat_y[pick].double())
    with torch.no_grad():
        net.skip.weight.copy_(sol[:-1].T.float())
        net.skip.bias.copy_(sol[-1].float())


@torch.no_grad()
def validation_loss(net: Denoiser, y: torch.Tensor, c: torch.Tensor, prediction: str, batch: int = 64) -> float:
    """x0 mean squared error over the fixed grid t = (j + 0.5)/16, noise from a fixed seed."""
    gen = torch.Generator().manual_seed(1234)
    device = next(net.parameters()).device
    total, count = 0.0, 0
    for t_value in flow.VALIDATION_TIMES:
        eps_all = torch.randn(y.shape, generator=gen)
        for s in range(0, y.shape[0], batch):
            yb, cb, eb = y[s : s + batch].to(device), c[s : s + batch].to(device), eps_all[s : s + batch].to(device)
            t = torch.full((yb.shape[0],), t_value, device=device)
            x_t = flow.noisy(yb, eb, t)
            y_hat = flow.clean_estimate(net(x_t, t, cb).float(), x_t, t, prediction)
            total += float(((y_hat - yb) ** 2).sum())
            count += yb.numel()
    return total / count


def total_steps(cfg: BridgeConfig, n_train: int) -> int:
    if cfg.steps is not None:
        return cfg.steps
    return (cfg.epochs or 1) * math.ceil(n_train / cfg.batch_size)


class EMA:
    def __init__(self, net: Denoiser, decay: float):
        self.decay = decay
        self.params = {k: v.detach().clone() for k, v in net.state_dict().items()}

    @torch.no_grad()
    def update(self, net: Denoiser, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        for k, v in net.state_dict().items():
            self.params[k].mul_(d).add_(v.detach(), alpha=1 - d)


def train(cfg: BridgeConfig, group, art: Artifact, progress: Progress) -> dict:
    """Train (or resume) into art; returns final metrics."""
    device = torch.device(cfg.device)
    start = covered_start(group)
    train_data = load_split(group, cfg.layer, "train")
    val_data = load_split(group, cfg.layer, "validation", cfg.val_sequences)
    norm = Normalizer.fit(train_data, start)
    y_train, c_train = norm.y(train_data.target[:, start:]), norm.c(train_data.cond[:, start:])
    y_val, c_val = norm.y(val_data.target[:, start:]), norm.c(val_data.cond[:, start:])
    del train_data, val_data
    den_cfg = DenoiserConfig(
        dim=y_train.shape[-1], width=cfg.width, depth=cfg.depth, heads=cfg.heads, max_len=y_train.shape[1]
    )
    torch.manual_seed(cfg.seed)
    net = Denoiser(den_cfg)
    if cfg.skip_init == "ridge":
        ridge_skip(net, y_train, c_train, seed=cfg.seed)
    net = net.to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    ema = EMA(net, cfg.ema)
    steps = total_steps(cfg, y_train.shape[0])
    state_path, metrics_path = art.file(files.STATE_FILE), art.file("metrics.jsonl")
    first_step, log = 0, []
    state = files.load_state(art.path)
    if state is not None:  # tensors go to the training device (the EMA update mixes them with the net's)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        ema.params = {k: v.to(device) for k, v in state["ema"].items()}
        first_step, log = state["step"], state["log"]
        files.write_jsonl(metrics_path, log)
        progress.log(f"resuming bridge training at step {first_step} of {steps}")
    meta = {"layer": cfg.layer, "start": start, "prediction": cfg.prediction, "denoiser": asdict(den_cfg)}
    art.file("bridge.json").write_text(json.dumps(meta, indent=2))
    files.save_tensors(art.file("stats.safetensors"), norm.tensors())
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _nullcontext()
    progress.start(f"bridge L{cfg.layer}", steps - first_step, "step")
    tokens_per_step = cfg.batch_size * y_train.shape[1]
    clock = time.time()
    for step in range(first_step, steps):
        gen = step_generator(cfg.seed, step)
        idx = torch.randint(0, y_train.shape[0], (cfg.batch_size,), generator=gen)
        t = torch.rand(cfg.batch_size, generator=gen)
        eps = torch.randn((cfg.batch_size, *y_train.shape[1:]), generator=gen)
        yb, cb, t, eps = y_train[idx].to(device), c_train[idx].to(device), t.to(device), eps.to(device)
        lr = lr_at(step, steps, cfg)
        for group_ in optimizer.param_groups:
            group_["lr"] = lr
        x_t = flow.noisy(yb, eps, t)
        with autocast:
            out = net(x_t, t, cb)
        loss = ((out.float() - flow.training_target(yb, eps, cfg.prediction)) ** 2).mean()
        if not torch.isfinite(loss):
            kept = files.load_state(art.path)
            where = f"step {kept['step']}" if kept else "none yet"
            raise DihalError(
                f"bridge loss became {loss.item()} at step {step} (last good checkpoint: {where}); "
                "lower --lr or raise --warmup, then rerun to resume"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
        optimizer.step()
        ema.update(net, step)
        row = {"step": step + 1, "train_loss": loss.item(), "lr": lr}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == steps:
            row["val_loss"] = _ema_val_loss(net, ema, y_val, c_val, cfg.prediction)
        elapsed = time.time() - clock
        row["tokens_per_s"] = tokens_per_step * (step + 1 - first_step) / max(elapsed, 1e-9)
        log.append(row)
        files.append_jsonl(metrics_path, row)
        if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < steps:
            files.save_state(
                art.path,
                {
                    "step": step + 1,
                    "model": net.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "ema": ema.params,
                    "log": log,
                },
            )
        progress.advance(
            1,
            loss=row["train_loss"],
            tokens_per_s=row["tokens_per_s"],
            **({"val_loss": row["val_loss"]} if "val_loss" in row else {}),
        )
    progress.stop()
    files.save_tensors(art.file("weights.safetensors"), net.state_dict())
    files.save_tensors(art.file("weights_ema.safetensors"), ema.params)
    final_val = log[-1].get("val_loss")
    plot_losses(log, art.file("loss_curve.png"), cfg)
    if state_path.exists():
        state_path.unlink()
    return {
        "val_loss": final_val,
        "steps": steps,
        "train_tokens_per_s": log[-1]["tokens_per_s"],
        "final_train_loss": log[-1]["train_loss"],
        "n_train_sequences": int(y_train.shape[0]),
        "n_val_sequences": int(y_val.shape[0]),
        "covered_start": start,
    }


def _ema_val_loss(net: Denoiser, ema: EMA, y_val, c_val, prediction: str) -> float:
    raw = {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(ema.params)
    try:
        return validation_loss(net.eval(), y_val, c_val, prediction)
    finally:
        net.load_state_dict(raw)
        net.train()


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def plot_losses(log: list[dict], path, cfg: BridgeConfig) -> None:
    fig, ax = plotting.figure(7, 4)
    ax.plot([r["step"] for r in log], [r["train_loss"] for r in log], alpha=0.5, label="train")
    val = [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), marker="o", label="validation (EMA)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{cfg.prediction} MSE (normalized)")
    ax.legend()
    plotting.save(fig, ax, path, f"bridge layer {cfg.layer} ({cfg.protocol})", dpi=110)


# -- the stage ----------------------------------------------------------------------------------
def config_dict(cfg: BridgeConfig) -> dict:
    return asdict(cfg)


def run(
    cfg: BridgeConfig, extract: Artifact, store: ArtifactStore, *, force: bool = False, progress: Progress | None = None
) -> Artifact:
    progress = progress or NullProgress()
    group = hs.open_group(extract.path / "hidden.zarr")
    stored = hs.stored_layers(group)
    if 0 not in stored or cfg.layer not in stored:
        raise DihalError(
            f"extract {extract.id} lacks layer {0 if 0 not in stored else cfg.layer} "
            f"(it holds {stored}); extract with --layers 0,{cfg.layer}"
        )
    config, parents = config_dict(cfg), {"extract": extract.id}
    if cached := store.cached(STAGE, config, parents, force=force):
        return cached
    with store.writing(
        STAGE,
        config,
        parents,
        force=force,
        seed=cfg.seed,
        device=cfg.device,
        extra={"model": extract.manifest.get("model"), "extract_config": extract.config},
    ) as art:
        art.manifest["metrics"] = train(cfg, group, art, progress)
    return art
