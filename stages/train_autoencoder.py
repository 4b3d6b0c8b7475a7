"""`dihal train-autoencoder`: the LD4LG-style row of METHOD §5.

LD4LG compresses a frozen encoder's states into a few latent vectors with a Perceiver resampler,
runs diffusion over those latents and decodes with the frozen decoder. BART and T5 are not
available offline, so here the frozen encoder is the backbone itself (its deepest stored layer at positions
1..T-1, read from the extract, or its last layer computed by all its blocks under --states model) and the
decoder is the CoDAR decoder on the backbone's frozen embedding table, cross-attending to the latents:

    z   = Resampler(h_L)            K learned queries cross-attend to W h_L + positions (2 blocks),
                                    then a projection to K x d latents (defaults 8 x 64)
    out = CrossDecoder(tokens, z)   teacher forced, cross-entropy on tokens 1..T-1

Both train together as an autoencoder under the protocol. The artifact then holds every train and
validation sequence's latents (`latents.safetensors`), which `dihal train-prior --latents ID`
models (normalized per dimension) and `--source oracle` reads back. Its reconstruction accuracy
(teacher-forced token accuracy from the real latents, validation) is in the manifest.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dihal.artifacts import files
from dihal.artifacts import hidden_states as hs
from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore
from dihal.stages.configs import DECODER_DEPTH, AutoencoderConfig
from dihal.stages.diffusion import feed, trainer
from dihal.stages.diffusion.cross_decoder import VAL_BATCH, Attention, CrossDecoder, DecoderConfig, teacher_forced
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.lineage import backbone_for
from dihal.stages.lm.capture import ModelStates
from dihal.stages.moments import config_for
from dihal.stages.moments import of as moments_of
from dihal.stages.parts.decoder import frozen_table
from dihal.stages.runtime import plotting
from dihal.stages.runtime.dist import distributed
from dihal.stages.runtime.progress import NullProgress, Progress

STAGE = "autoencoder"
CACHE_VERSION = 1  # bump whenever an autoencoder's bytes change (tests/test_golden.py says when)
RESAMPLER_DEPTH = 2


class Resampler(nn.Module):
    """A Perceiver resampler: K learned queries, each block cross-attention to the states then
    self-attention among the queries and an MLP (pre-norm), then a projection to the latent width."""

    def __init__(self, dim: int, width: int, heads: int, latents: int, latent_dim: int, max_len: int):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(latents, width) * 0.02)
        self.state_in, self.pos = nn.Linear(dim, width), nn.Embedding(max_len, width)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "n1": nn.LayerNorm(width),
                    "cross": Attention(width, heads, causal=False),
                    "n2": nn.LayerNorm(width),
                    "self": Attention(width, heads, causal=False),
                    "n3": nn.LayerNorm(width),
                    "mlp": nn.Sequential(
                        nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width)
                    ),
                }
            )
            for _ in range(RESAMPLER_DEPTH)
        )
        self.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, latent_dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T', D) -> latents (B, K, d)."""
        memory = self.state_in(h) + self.pos(torch.arange(h.shape[1], device=h.device))[None]
        x = self.queries[None].expand(h.shape[0], -1, -1)
        for b in self.blocks:
            x = x + b["cross"](b["n1"](x), memory)
            q = b["n2"](x)
            x = x + b["self"](q, q)
            x = x + b["mlp"](b["n3"](x))
        return self.out(x)


class AutoencoderNet(nn.Module):
    def __init__(self, cfg: AutoencoderConfig, dim: int, length: int, table: torch.Tensor):
        super().__init__()
        self.resampler = Resampler(dim, cfg.width, cfg.heads, cfg.latents, cfg.latent_dim, length)
        vocab, width = (int(n) for n in table.shape)
        dcfg = DecoderConfig(
            vocab=vocab,
            dim=width,
            width=cfg.width,
            depth=DECODER_DEPTH,
            heads=cfg.heads,
            max_len=length,
            memory_dim=cfg.latent_dim,
        )
        self.decoder = CrossDecoder(dcfg, table)

    def forward(self, ids_in: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(ids_in, self.resampler(h))


class AutoencoderTask:
    """(h_L at positions 1..T-1, tokens) of training sequences; loss: token cross-entropy."""

    def __init__(self, group, cfg: AutoencoderConfig, layer: int, norm: Normalizer, computed=None):
        """computed: ModelStates of the last layer (--states model), else h_L is read from the extract."""
        self.group, self.cfg, self.layer, self.norm, self.computed = group, cfg, layer, norm, computed
        self.stored = computed is None  # reads h_L from the store (trainer.py: ranks take their own chunks' items)
        self.on_device = norm.to(cfg.device)
        self.scale = hs.layer_scales(group)[layer] if computed is None else 1.0
        val = trainer.take_split(self, group, cfg.val_sequences)
        self.val = self.read_seqs(val)

    def read_seqs(self, seqs: np.ndarray, ids_only: bool = False):
        ids = np.asarray(self.group["input_ids"].oindex[seqs])
        if ids_only:
            return ids
        if self.computed is not None:
            return {"h": self.computed(ids).cpu().numpy(), "ids": ids}
        return {"h": hs.read_sequences(self.group, self.layer, seqs), "ids": ids}

    def read(self, positions: np.ndarray, alloc=None) -> dict[str, np.ndarray]:
        seqs = self.train_seqs[positions]  # h_L as stored, made float32 on the device (stages/diffusion/feed.py)
        if self.computed is not None:  # --states model: the token ids are all a step reads
            return {"ids": self.read_seqs(seqs, ids_only=True)}
        states = feed.stored(self.group, self.layer, seqs, "h", False, alloc)
        return {**states, "ids": self.read_seqs(seqs, ids_only=True)}

    def states(self, raw: np.ndarray) -> torch.Tensor:
        return self.norm.y(torch.from_numpy(raw[:, 1:].astype(np.float32)))

    def loss(self, net, batch, draws, device) -> torch.Tensor:
        ids = torch.as_tensor(batch["ids"]).to(device).long()
        h = feed.as_float(batch, "h", device, self.scale) if self.computed is None else self.computed(ids)
        logits = net(ids[:, :-1], self.on_device.y(h[:, 1:])).float()
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(dim=1).sum()

    @torch.no_grad()
    def scores(self, net) -> tuple[float, float]:
        """(cross-entropy, token accuracy) on the validation sequences, teacher forced from their latents,
        VAL_BATCH sequences at a time and the logits in slices (cross_decoder.teacher_forced)."""
        device = next(net.parameters()).device
        nll, hits, count = 0.0, 0, 0
        for s in range(0, len(self.val["ids"]), VAL_BATCH):
            ids = torch.from_numpy(self.val["ids"][s : s + VAL_BATCH].astype(np.int64)).to(device)
            latents = net.resampler(self.states(self.val["h"][s : s + VAL_BATCH]).to(device))
            batch = teacher_forced(net.decoder, ids, latents)
            nll, hits, count = nll + batch[0], hits + batch[1], count + batch[2]
        return nll / count, hits / count

    def validate(self, net) -> float:
        return self.scores(net)[0]


@torch.no_grad()
def encode(net: AutoencoderNet, task: AutoencoderTask, seqs: np.ndarray, batch: int = 64) -> torch.Tensor:
    device = next(net.parameters()).device
    out = []
    for s in range(0, len(seqs), batch):
        raw = task.read_seqs(seqs[s : s + batch])["h"]
        out.append(net.resampler(task.states(raw).to(device)).float().cpu())
    return torch.cat(out)


def train(
    cfg: AutoencoderConfig, group, art: Artifact, table: torch.Tensor, progress: Progress, model=None, moments=None
) -> dict:
    """model: the backbone, whose blocks compute h_L (--states model); moments(layer, states) -> h_L's stored
    moments (stages/moments.py)."""
    rank, _ = distributed()
    train_seqs = hs.split_indices(group, "train")
    if model is not None:  # h_L computed by every block; the condition's moments from the table, as a bridge's
        layer = int(group.attrs["num_blocks"])
        computed = ModelStates(model, layer)
        target = moments(layer, computed) if moments else None
        norm = Normalizer.fit(group, 0, layer, train_seqs, 1, table=table, states=computed, target=target)
    else:  # the deepest layer the extract stores (the last, for an extract of every layer)
        layer = max(hs.stored_layers(group))
        if layer == 0:
            raise DihalError(
                "the autoencoder encodes the deepest stored layer, and this extract holds layer 0 alone (the "
                "token embeddings); extract every layer (--layers all, --keep layers) or give --states model"
            )
        target = moments(layer, None) if moments else None
        computed, norm = None, Normalizer.fit(group, 0, layer, train_seqs, 1, target=target)
    task = AutoencoderTask(group, cfg, layer, norm, computed)
    length = group["input_ids"].shape[1] - 1
    torch.manual_seed(cfg.seed)
    net = AutoencoderNet(cfg, int(norm.mu_y.shape[0]), length, norm.c(table.float().cpu()))
    result = trainer.train(task, net, trainer.loop_config(cfg), art.path, progress, "autoencoder")
    log = result.pop("log")
    ce, accuracy = task.scores(net)
    if rank == 0:
        meta = {
            "layer": layer,
            "dim": int(norm.mu_y.shape[0]),
            "seq_len": length + 1,
            "latents": cfg.latents,
            "latent_dim": cfg.latent_dim,
            "width": cfg.width,
            "heads": cfg.heads,
            "start_token": int(np.asarray(group["input_ids"][:1, 0])[0]),
            "decoder": asdict(net.decoder.cfg),
        }
        art.file("autoencoder.json").write_text(json.dumps(meta, indent=2))
        files.save_tensors(art.file("stats.safetensors"), norm.tensors())
        splits = {s: encode(net, task, hs.split_indices(group, s)) for s in ("train", "validation")}
        files.save_tensors(art.file("latents.safetensors"), splits)
        title = f"LD4LG-style autoencoder ({cfg.protocol}), layer {layer} -> {cfg.latents} x {cfg.latent_dim}"
        plotting.loss_curve(log, art.file("loss_curve.png"), title, "token cross-entropy")
    return {
        **result,
        "encoder_layer": layer,
        "reconstruction_accuracy": accuracy,
        "reconstruction_cross_entropy": ce,
        "n_train_sequences": task.n_train,
        "parameters": sum(p.numel() for p in net.parameters()),
        "tokens_seen": result["steps"] * result["global_batch"] * length,
    }


def run(
    cfg: AutoencoderConfig,
    extract: Artifact,
    store: ArtifactStore,
    *,
    loaded=None,
    force: bool = False,
    progress: Progress | None = None,
) -> Artifact:
    """loaded: the backbone, when the caller holds it (stages/train_decoder.py frozen_table)."""
    progress = progress or NullProgress()
    group = hs.open_with_layers(extract, () if cfg.states == "model" else (0,))
    config, parents = cfg.hashed(), {"extract": extract.id}

    def moments(layer: int, computed):
        source = config_for(layer, 1, cfg.states, cfg.device, cfg.precision)
        return moments_of(extract, store, group, source, lambda: computed)

    def train_fn(art, report):
        if cfg.states == "store":
            return train(cfg, group, art, frozen_table(extract, cfg, loaded), report, moments=moments)
        loaded_ = loaded or backbone_for(extract, cfg.device, cfg.precision)
        return train(cfg, group, art, frozen_table(extract, cfg, loaded_), report, loaded_.model, moments)

    return trainer.write_trained(
        store, STAGE, CACHE_VERSION, config, parents, extract, cfg, train_fn, force=force, progress=progress
    )
