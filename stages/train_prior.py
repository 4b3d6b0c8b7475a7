"""`dihal train-prior`: METHOD §5, the sequence diffusion prior of the comparison.

The prior models whole sequences of normalized states at positions 1..T-1 with no condition:
layer 0 (the token embeddings, normalized exactly as the bridge normalizes its condition) for
the Diffusion-LM / SED / CoDAR / DiHAL rows, or layer l (normalized h_l) for DiHAL-direct.
Network: the bridge's denoiser with bidirectional attention, no condition and no skip.
Rectified flow, x0-parameterization, MSE over positions 1..T-1, trained by the shared loop.

- `--self-condition` (SED): with probability 0.5 per sequence, a first pass's x0 estimate
  (no gradient) is fed as an extra input; at sampling, the previous step's estimate.
- `--latents ID` (the LD4LG-style row): the sequence is an autoencoder's K latents of a sequence
  (stages/train_autoencoder.py), normalized per dimension over the train split, instead of a layer.
- clamping (Diffusion-LM) is a sampling option (stages/parts/prior.py `Prior.sample(clamp_to=E)`): each step's x0
  estimate, de-normalized, is replaced by its cosine-nearest row of the raw embedding table E,
  rescaled to the estimate's norm.
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
from dihal.stages.configs import PriorConfig
from dihal.stages.diffusion import flow, trainer
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.parts.autoencoder import latents_of
from dihal.stages.parts.prior import space
from dihal.stages.runtime import plotting
from dihal.stages.runtime.dist import distributed
from dihal.stages.runtime.progress import NullProgress, Progress

STAGE = "prior"
CACHE_VERSION = 1  # bump whenever a prior's bytes change (tests/test_golden.py says when)


def denoiser_config(cfg: PriorConfig, dim: int, length: int) -> DenoiserConfig:
    return DenoiserConfig(
        dim=dim,
        width=cfg.width,
        depth=cfg.depth,
        heads=cfg.heads,
        max_len=length,
        causal=False,
        condition=False,
        self_condition=cfg.self_condition,
    )


# -- training ---------------------------------------------------------------------------------------------------
class PriorTask:
    def __init__(self, group, cfg: PriorConfig, norm: Normalizer):
        self.group, self.cfg = group, cfg
        self.mu, self.sigma = space(norm, cfg.layer)
        val = trainer.take_split(self, group, cfg.val_sequences)
        self.y_val = self.normalize(hs.read_sequences(group, cfg.layer, val))

    def normalize(self, raw: np.ndarray) -> torch.Tensor:
        return (torch.from_numpy(raw[:, 1:].astype(np.float32)) - self.mu) / self.sigma

    def read(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": hs.read_sequences(self.group, self.cfg.layer, self.train_seqs[positions])}

    def loss(self, net, batch, draws, device) -> torch.Tensor:
        y = self.normalize(batch["y"]).to(device)
        t = draws.rand()
        eps = draws.randn(*y.shape[1:])
        x_t = flow.noisy(y, eps, t)
        x0_prev = None
        if self.cfg.self_condition:  # SED: half the sequences see a first pass's estimate
            use = draws.rand() < 0.5
            with torch.no_grad():
                first = net(x_t, t, x0_prev=torch.zeros_like(y)).float()
            x0_prev = torch.where(use[:, None, None], first, torch.zeros_like(first))
        out = net(x_t, t, x0_prev=x0_prev)
        return ((out.float() - y) ** 2).mean(dim=(1, 2)).sum()

    def validate(self, net) -> float:
        return flow.validation_loss(net, self.y_val)


class LatentPriorTask(PriorTask):
    """The prior over an autoencoder's latents: the same loss, its data the stored (N, K, d) latents."""

    def __init__(self, group, cfg: PriorConfig, latents: dict[str, torch.Tensor], norm: Normalizer):
        self.group, self.cfg, self.latents = group, cfg, latents["train"].float()
        self.mu, self.sigma = norm.mu_c, norm.sigma_c
        self.n_train, self.chunk = self.latents.shape[0], int(group.attrs["chunk_seqs"])
        self.tokens_per_item = self.latents.shape[1]
        val = latents["validation"][: cfg.val_sequences].float()
        if val.shape[0] == 0:
            raise DihalError("the extract has no validation sequences; extract with --val-fraction > 0")
        self.y_val = (val - self.mu) / self.sigma

    def normalize(self, raw: np.ndarray) -> torch.Tensor:
        return (torch.from_numpy(np.asarray(raw, dtype=np.float32)) - self.mu) / self.sigma

    def read(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": self.latents[positions].numpy()}


def latent_normalizer(latents: torch.Tensor) -> Normalizer:
    """Per-dimension statistics of (N, K, d) latents, as a Normalizer whose condition half is them."""
    flat = latents.reshape(-1, latents.shape[-1]).double()
    mu, sigma = flat.mean(0).float(), flat.std(0).clamp_min(1e-6).float()
    return Normalizer(mu, sigma, mu.clone(), sigma.clone(), torch.zeros_like(mu))


def train(cfg: PriorConfig, group, art: Artifact, progress: Progress, latents_art: Artifact | None = None) -> dict:
    rank, _ = distributed()
    if cfg.latent:
        stored = {split: latents_of(latents_art, split) for split in ("train", "validation")}
        norm = latent_normalizer(stored["train"])
        task = LatentPriorTask(group, cfg, stored, norm)
    else:
        norm = Normalizer.fit(group, 0, max(cfg.layer, 0), hs.split_indices(group, "train"), 1)
        task = PriorTask(group, cfg, norm)
    den_cfg = denoiser_config(cfg, int(task.mu.shape[0]), task.tokens_per_item)
    torch.manual_seed(cfg.seed)
    net = Denoiser(den_cfg)
    if rank == 0:
        meta = {
            "layer": cfg.layer,
            "self_condition": cfg.self_condition,
            "denoiser": asdict(den_cfg),
            "seq_len": task.tokens_per_item + 1,  # latents: K + 1, so that sampling draws K vectors
            "latent": cfg.latent,
        }
        art.file("prior.json").write_text(json.dumps(meta, indent=2))
        files.save_tensors(art.file("stats.safetensors"), norm.tensors())
    loop = trainer.loop_config(cfg)
    name = "prior over latents" if cfg.latent else f"prior L{cfg.layer}" + (" SC" if cfg.self_condition else "")
    result = trainer.train(task, net, loop, art.path, progress, name)
    log = result.pop("log")
    if rank == 0:
        plotting.loss_curve(
            log, art.file("loss_curve.png"), f"prior over layer {cfg.layer} ({cfg.protocol})", "x0 MSE (normalized)"
        )
    return {
        **result,
        "n_train_sequences": task.n_train,
        "parameters": sum(p.numel() for p in net.parameters()),
        # the text's tokens the sequences hold (for latents, the K vectors per sequence stand for them)
        "tokens_seen": result["steps"] * result["global_batch"] * (group["input_ids"].shape[1] - 1),
        "vectors_per_sequence": task.tokens_per_item,
    }


def run(
    cfg: PriorConfig,
    extract: Artifact,
    store: ArtifactStore,
    *,
    latents: Artifact | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Artifact:
    """latents: the autoencoder artifact whose latents a --latents prior models."""
    progress = progress or NullProgress()
    group = hs.open_with_layers(extract, (0, cfg.layer))
    if cfg.latent != (latents is not None):
        raise DihalError("a prior over latents needs --latents ID (a `dihal train-autoencoder` artifact), and only it")
    if latents is not None and latents.manifest.get("parents", {}).get("extract") != extract.id:
        raise DihalError(f"autoencoder {latents.id} was not trained on extract {extract.id}; use one that was")
    config, parents = cfg.hashed(), {"extract": extract.id, **({"autoencoder": latents.id} if latents else {})}
    train_fn = lambda art, report: train(cfg, group, art, report, latents)
    return trainer.write_trained(
        store, STAGE, CACHE_VERSION, config, parents, extract, cfg, train_fn, force=force, progress=progress
    )
