"""`dihal train-bridge`: docs/method.md section 2 (replace: the conditional diffusion bridge).

The bridge models h_l (positions 1..T-1, normalized per dimension) given c = h_0 (normalized
with its own statistics); position 0 (BOS, the attention sink) is one stored constant vector.
Training randomness is drawn per step from (seed, step), so a resumed run replays exactly
what an uninterrupted one would have done.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import torch

from dihal.artifacts import files
from dihal.artifacts import hidden_states as hs
from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore
from dihal.stages.configs import BridgeConfig, part_hash
from dihal.stages.diffusion import flow, trainer
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.diffusion.trainer import distributed
from dihal.stages.runtime import plotting
from dihal.stages.runtime.progress import NullProgress, Progress

STAGE = "bridge"


# -- data -----------------------------------------------------------------------------------------
def covered_start(group) -> int:
    """1 when every sequence starts with the same token (the start token): position 0 is then a constant."""
    first = np.asarray(group["input_ids"][:, 0])
    return 1 if first.size and (first == first[0]).all() else 0


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
    def sample_condition(self, c: torch.Tensor, steps: int, noise: torch.Tensor) -> torch.Tensor:
        """c: (B, T', D) normalized conditions at positions 1..T' (a prior's sample) -> (B, T'+1, D)
        raw layer-l states, position 0 the stored start-token state."""
        y = flow.sample(lambda x, t, i: self.net(x, t, c), noise[:, : c.shape[1]], steps, self.prediction)
        return self._assemble(y, c.shape[0])

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
        self.started = False  # position 0 (the stored start-token state) emitted

    @torch.no_grad()
    def extend(self, h0_new: torch.Tensor, noise_new: torch.Tensor) -> torch.Tensor:
        """h0_new: (B, n, D) layer-0 states of the next n positions (absolute positions continue)."""
        b = self.bridge
        first = None
        if not self.started:  # an unprompted prefix is the start token alone: done stays 0 after it
            self.started = True
            if b.start == 1:
                first, h0_new = h0_new[:, :1], h0_new[:, 1:]
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
class BridgeTask:
    """The bridge as a task of the shared training loop (stages/diffusion/trainer.py): reads
    (h_0, h_l) for training sequences from the Zarr store, never the whole split."""

    def __init__(self, group, cfg: BridgeConfig, norm: Normalizer, start: int, prior=None):
        """prior: a trained stages.prior.Prior whose estimates corrupt c (--condition-noise prior:T)."""
        self.group, self.cfg, self.norm, self.start, self.prior = group, cfg, norm, start, prior
        self.on_device = norm.to(cfg.device)  # the loss normalizes where it trains
        self.train_seqs = hs.split_indices(group, "train")
        self.n_train, self.chunk = len(self.train_seqs), int(group.attrs["chunk_seqs"])
        self.tokens_per_item = group["input_ids"].shape[1] - start
        val = hs.split_indices(group, "validation")[: cfg.val_sequences]
        if val.size == 0:
            raise DihalError(
                "the extract has no validation sequences; extract with --val-fraction > 0 and more --max-sequences"
            )
        self.c_val = norm.c(_read(group, 0, val, start))
        self.y_val = norm.y(_read(group, cfg.layer, val, start))

    def read(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        seqs = self.train_seqs[positions]
        return {"c": hs.read_sequences(self.group, 0, seqs), "y": hs.read_sequences(self.group, self.cfg.layer, seqs)}

    def loss(self, net, batch, draws, device) -> torch.Tensor:
        norm = self.on_device
        c = norm.c(torch.from_numpy(batch["c"][:, self.start :].astype(np.float32)).to(device))
        y = norm.y(torch.from_numpy(batch["y"][:, self.start :].astype(np.float32)).to(device))
        t = draws.rand()
        eps = draws.randn(*y.shape[1:])
        if self.prior is not None:  # positions 1..T' only: the prior does not model position 0
            raw = torch.from_numpy(batch["c"][:, 1:].astype(np.float32)).to(device)
            estimate = norm.c(self.prior.corrupt(raw, self.cfg.condition_noise, draws))
            c = torch.cat([c[:, : 1 - self.start], estimate], dim=1)
        else:
            c = flow.corrupt(c, self.cfg.condition_noise, draws)
        out = net(flow.noisy(y, eps, t), t, c)
        return ((out.float() - flow.training_target(y, eps, self.cfg.prediction)) ** 2).mean(dim=(1, 2)).sum()

    def validate(self, net) -> float:
        return validation_loss(net, self.y_val, self.c_val, self.cfg.prediction)


def _read(group, layer: int, seqs: np.ndarray, start: int) -> torch.Tensor:
    return torch.from_numpy(hs.read_sequences(group, layer, seqs)[:, start:].astype(np.float32))


def ridge_skip(net: Denoiser, task: BridgeTask, rows: int = 16384, seed: int = 0) -> None:
    """Start A at the ridge least-squares map from c to y (normalized units), fitted on `rows`
    positions of randomly chosen training sequences (read from the store, not the whole split)."""
    gen = torch.Generator().manual_seed(seed)
    n_seqs = min(task.n_train, -(-rows // task.tokens_per_item))
    seqs = np.sort(task.train_seqs[torch.randperm(task.n_train, generator=gen)[:n_seqs].numpy()])
    c = task.norm.c(_read(task.group, 0, seqs, task.start)).reshape(-1, net.cfg.dim)
    y = task.norm.y(_read(task.group, task.cfg.layer, seqs, task.start)).reshape(-1, net.cfg.dim)
    pick = torch.randperm(c.shape[0], generator=gen)[:rows]
    cc = torch.cat([c[pick].double(), torch.ones(len(pick), 1, dtype=torch.float64)], dim=1)
    gram = cc.T @ cc + 1e-3 * len(pick) * torch.eye(cc.shape[1], dtype=torch.float64)
    sol = torch.linalg.solve(gram, cc.T @ y[pick].double())
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


def train(cfg: BridgeConfig, group, art: Artifact, progress: Progress, prior_art: Artifact | None = None) -> dict:
    """Train (or resume) into art; returns final metrics."""
    rank, _ = distributed()
    start = covered_start(group)
    norm = Normalizer.fit(group, 0, cfg.layer, hs.split_indices(group, "train"), start)
    task = BridgeTask(group, cfg, norm, start, condition_prior(prior_art, cfg))
    den_cfg = DenoiserConfig(
        dim=norm.mu_y.shape[0], width=cfg.width, depth=cfg.depth, heads=cfg.heads, max_len=task.tokens_per_item
    )
    torch.manual_seed(cfg.seed)
    net = Denoiser(den_cfg)
    if cfg.skip_init == "ridge":
        ridge_skip(net, task, seed=cfg.seed)
    if rank == 0:
        meta = {"layer": cfg.layer, "start": start, "prediction": cfg.prediction, "denoiser": asdict(den_cfg)}
        art.file("bridge.json").write_text(json.dumps(meta, indent=2))
        files.save_tensors(art.file("stats.safetensors"), norm.tensors())
    result = trainer.train(task, net, trainer.loop_config(cfg), art.path, progress, f"bridge L{cfg.layer}")
    log = result.pop("log")
    if rank == 0:
        plotting.loss_curve(
            log,
            art.file("loss_curve.png"),
            f"bridge layer {cfg.layer} ({cfg.protocol})",
            f"{cfg.prediction} MSE (normalized)",
        )
    return {
        **result,
        "n_train_sequences": task.n_train,
        "n_val_sequences": int(task.y_val.shape[0]),
        "covered_start": start,
        "parameters": sum(p.numel() for p in net.parameters()),
        "tokens_seen": result["steps"] * result["global_batch"] * task.tokens_per_item,
    }


# -- the stage ----------------------------------------------------------------------------------
def config_dict(cfg: BridgeConfig) -> dict:
    return part_hash(cfg)


def condition_prior(prior_art: Artifact | None, cfg):
    """The loaded prior of --condition-noise prior:T (on the training device), else None."""
    if cfg.condition_from != "prior":
        return None
    from dihal.stages.prior import Prior

    device = cfg.device if cfg.device != "auto" else "cpu"
    return Prior.load(prior_art, device)


def check_condition_prior(cfg, extract: Artifact, prior_art: Artifact | None) -> dict[str, str]:
    """The parents a part gains from its condition: {} for sigma:S, {"prior": id} for prior:T."""
    if cfg.condition_from != "prior":
        if prior_art is not None:
            raise DihalError("--prior is for --condition-noise prior:T; leave it out with sigma:S")
        return {}
    if prior_art is None:
        raise DihalError("--condition-noise prior:T needs --prior ID (a `dihal train-prior --layer 0` artifact)")
    if prior_art.manifest.get("parents", {}).get("extract") != extract.id or prior_art.config.get("layer") != 0:
        raise DihalError(f"prior {prior_art.id} is not a prior over layer 0 of extract {extract.id}; train one on it")
    return {"prior": prior_art.id}


def run(
    cfg: BridgeConfig,
    extract: Artifact,
    store: ArtifactStore,
    *,
    prior: Artifact | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Artifact:
    """Under torchrun every rank trains its shard; rank 0 owns the artifact and writes it.
    prior: the layer-0 prior of --condition-noise prior:T."""
    progress = progress or NullProgress()
    group = hs.open_with_layers(extract, (0, cfg.layer))
    config, parents = config_dict(cfg), {"extract": extract.id, **check_condition_prior(cfg, extract, prior)}
    if cached := store.cached(STAGE, config, parents, force=force):
        return cached
    train_fn = lambda art, report: train(cfg, group, art, report, prior)  # noqa: E731
    return trainer.write_trained(store, STAGE, config, parents, extract, cfg, train_fn, force=force, progress=progress)
