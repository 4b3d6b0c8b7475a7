"""`dihal train-bridge`: METHOD §2 (replace: the conditional diffusion bridge).

The bridge models h_l (positions 1..T-1, normalized per dimension) given c = h_0 (normalized
with its own statistics); position 0 (BOS, the attention sink) is one stored constant vector.
h_0 is the backbone's embedding of each token (its layer-0 state, scaling included), computed from the
token ids on the training device through the backbone's own table (what generation computes it as), so
training reads one layer of the extract: h_l (issue 64).
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
from dihal.stages.condition import check_condition_prior, condition_prior
from dihal.stages.configs import BridgeConfig
from dihal.stages.diffusion import feed, flow, trainer
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.lineage import backbone_for
from dihal.stages.lm.capture import ModelStates, hidden_states
from dihal.stages.moments import config_for
from dihal.stages.moments import of as moments_of
from dihal.stages.parts.decoder import frozen_table
from dihal.stages.runtime import plotting
from dihal.stages.runtime.dist import distributed
from dihal.stages.runtime.progress import NullProgress, Progress

STAGE = "bridge"
CACHE_VERSION = 2  # bump whenever a bridge's bytes change (tests/test_golden.py says when)
# 2: h_0 from the token ids through the backbone's table in float32, not read from the float16 extract


# -- data -----------------------------------------------------------------------------------------
def covered_start(group) -> int:
    """1 when every sequence starts with the same token (the start token): position 0 is then a constant."""
    first = np.asarray(group["input_ids"][:, 0])
    return 1 if first.size and (first == first[0]).all() else 0


# -- training ------------------------------------------------------------------------------------
class BridgeTask:
    """The bridge as a task of the shared training loop (stages/diffusion/trainer.py): reads h_l and the token
    ids of training sequences from the Zarr store, never the whole split; h_0 = table[ids] on the device."""

    def __init__(
        self, group, cfg: BridgeConfig, norm: Normalizer, start: int, table: torch.Tensor, prior=None, states=None
    ):
        """table: the backbone's (V, D) layer-0 state of every token (stages/parts/decoder.frozen_table), on the
        training device; prior: a trained stages.parts.prior.Prior whose estimates corrupt c (--condition-noise
        prior:T); states: ModelStates (--states model), else h_l is read from the store."""
        self.group, self.cfg, self.norm, self.start, self.prior = group, cfg, norm, start, prior
        self.table, self.states = table, states
        self.stored = states is None  # reads h_l from the store (trainer.py: ranks take their own chunks' items)
        self.on_device = norm.to(cfg.device)  # the loss normalizes where it trains
        self.scale = hs.layer_scales(group)[cfg.layer] if states is None else 1.0
        val = trainer.take_split(
            self, group, cfg.val_sequences, start, fix="--val-fraction > 0 and more --max-sequences"
        )
        self.c_val = norm.c(self.h0(hs.token_ids(group, val))[:, start:].cpu())
        self.y_val = norm.y(self.target(val))

    def target(self, seqs: np.ndarray) -> torch.Tensor:
        """h_l of sequences `seqs` at positions start.. on the host, float32: read, or computed (--states model)."""
        if self.states is None:
            return _read(self.group, self.cfg.layer, seqs, self.start)
        return self.states(hs.token_ids(self.group, seqs))[:, self.start :].cpu()

    def h0(self, ids) -> torch.Tensor:
        """(B, T) token ids (a host array or a tensor) -> (B, T, D) float32 layer-0 states on the table's device."""
        return self.table[torch.as_tensor(ids).to(self.table.device).long()]

    def read(self, positions: np.ndarray, alloc=None) -> dict[str, np.ndarray]:
        seqs, whole = self.train_seqs[positions], self.start == 0  # position 0 only where the bridge models it
        if self.states is not None:  # --states model: the token ids are all a step reads
            return {"ids": hs.token_ids(self.group, seqs)}
        target = feed.stored(self.group, self.cfg.layer, seqs, "y", whole, alloc)
        return {"ids": hs.token_ids(self.group, seqs), **target}

    def loss(self, net, batch, draws, device) -> torch.Tensor:
        norm = self.on_device
        raw = self.h0(batch["ids"])
        c = norm.c(raw[:, self.start :])
        if self.states is None:
            y = norm.y(feed.as_float(batch, "y", device, self.scale)[:, self.start :])
        else:
            y = norm.y(self.states(batch["ids"])[:, self.start :])
        t = draws.rand()
        eps = draws.randn(*y.shape[1:])
        if self.prior is not None:  # positions 1..T' only: the prior does not model position 0
            estimate = norm.c(self.prior.corrupt(raw[:, 1:], self.cfg.condition_noise, draws))
            c = torch.cat([c[:, : 1 - self.start], estimate], dim=1)
        else:
            c = flow.corrupt(c, self.cfg.condition_noise, draws)
        out = net(flow.noisy(y, eps, t), t, c)
        return ((out.float() - flow.training_target(y, eps, self.cfg.prediction)) ** 2).mean(dim=(1, 2)).sum()

    def validate(self, net) -> float:
        return flow.validation_loss(net, self.y_val, self.c_val, self.cfg.prediction)


def _read(group, layer: int, seqs: np.ndarray, start: int) -> torch.Tensor:
    return torch.from_numpy(hs.read_sequences(group, layer, seqs)[:, start:].astype(np.float32))


def check_layer0(group, table: torch.Tensor, seqs: np.ndarray, model=None) -> None:
    """The extract's stored layer 0 of a few training sequences (or, in an extract of token ids alone, the
    backbone's own layer 0 of them: `model`) is table[ids] to the precisions involved (the float16 store, a
    bfloat16 backbone: 2^-7 relative); else h_0 is not the embedding of each token alone (a model with position
    embeddings, or another backbone's table), and a bridge trained on table[ids] would not see what the extract
    saw."""
    seqs = np.asarray(seqs)[:8]
    ids = torch.from_numpy(hs.token_ids(group, seqs)).to(table.device).long()
    if 0 in hs.stored_layers(group) or model is None:
        stored = torch.from_numpy(hs.read_sequences(group, 0, seqs).astype(np.float32))
    else:
        stored = hidden_states(model, ids, [0])[0].float().cpu()
    ours = table[ids].float().cpu()
    off = (ours - stored).abs() > 2**-7 * stored.abs() + 2**-14 * stored.abs().amax()
    if bool(off.any()):
        raise DihalError(
            f"layer 0 of this extract is not the backbone's embedding of each token alone ({int(off.sum())} of "
            f"{off.numel()} values differ); extract anew from the model as it is now"
        )


def ridge_skip(net: Denoiser, task: BridgeTask, rows: int = 16384, seed: int = 0) -> None:
    """Start A at the ridge least-squares map from c to y (normalized units), fitted on `rows`
    positions of randomly chosen training sequences (read from the store, not the whole split)."""
    gen = torch.Generator().manual_seed(seed)
    n_seqs = min(task.n_train, -(-rows // task.tokens_per_item))
    seqs = np.sort(task.train_seqs[torch.randperm(task.n_train, generator=gen)[:n_seqs].numpy()])
    c = task.norm.c(task.h0(hs.token_ids(task.group, seqs))[:, task.start :].cpu()).reshape(-1, net.cfg.dim)
    y = task.norm.y(task.target(seqs)).reshape(-1, net.cfg.dim)
    pick = torch.randperm(c.shape[0], generator=gen)[:rows]
    cc = torch.cat([c[pick].double(), torch.ones(len(pick), 1, dtype=torch.float64)], dim=1)
    gram = cc.T @ cc + 1e-3 * len(pick) * torch.eye(cc.shape[1], dtype=torch.float64)
    sol = torch.linalg.solve(gram, cc.T @ y[pick].double())
    with torch.no_grad():
        net.skip.weight.copy_(sol[:-1].T.float())
        net.skip.bias.copy_(sol[-1].float())


def train(
    cfg: BridgeConfig,
    group,
    art: Artifact,
    progress: Progress,
    table: torch.Tensor,
    prior_art: Artifact | None = None,
    states: ModelStates | None = None,
    target=None,
) -> dict:
    """Train (or resume) into art; returns final metrics. table: the backbone's layer-0 state of every token;
    states: --states model's ModelStates; target: h_l's stored moments (stages/moments.py), else computed here."""
    rank, _ = distributed()
    start = covered_start(group)
    train_seqs = hs.split_indices(group, "train")
    check_layer0(group, table, train_seqs, states.model if states is not None else None)
    norm = Normalizer.fit(group, 0, cfg.layer, train_seqs, start, table=table, states=states, target=target)
    task = BridgeTask(group, cfg, norm, start, table, condition_prior(prior_art, cfg), states)
    den_cfg = DenoiserConfig(
        dim=norm.mu_y.shape[0],
        width=cfg.width,
        depth=cfg.depth,
        heads=cfg.heads,
        max_len=task.tokens_per_item,
        positions=cfg.positions,
    )
    torch.manual_seed(cfg.seed)
    net = Denoiser(den_cfg)
    if cfg.out_init == "zero":  # DiT's zeroed output layer: f = 0, the bridge starts at A c
        torch.nn.init.zeros_(net.out.weight)
        torch.nn.init.zeros_(net.out.bias)
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
_TABLES: dict[tuple, torch.Tensor] = {}


def layer0_table(extract: Artifact, cfg: BridgeConfig) -> torch.Tensor:
    """The backbone's (V, D) layer-0 table on the training device, read from the backbone once per process and
    extract (a sweep trains a bridge per layer from one)."""
    key = (extract.id, cfg.device, cfg.precision)
    if key not in _TABLES:
        _TABLES.clear()  # one at a time: at 8B it is 2 GiB of the device
        _TABLES[key] = frozen_table(extract, cfg).to(cfg.device)
    return _TABLES[key]


def config_dict(cfg: BridgeConfig) -> dict:
    return cfg.hashed()


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
    group = hs.open_with_layers(extract, () if cfg.states == "model" else (0, cfg.layer))
    config, parents = config_dict(cfg), {"extract": extract.id, **check_condition_prior(cfg, extract, prior)}

    def train_fn(art, report):
        moments = config_for(cfg.layer, covered_start(group), cfg.states, cfg.device, cfg.precision)
        if cfg.states == "store":
            target = moments_of(extract, store, group, moments)
            return train(cfg, group, art, report, layer0_table(extract, cfg), prior, target=target)
        loaded = backbone_for(extract, cfg.device, cfg.precision)
        states = ModelStates(loaded.model, cfg.layer)
        target = moments_of(extract, store, group, moments, lambda: states)
        return train(cfg, group, art, report, frozen_table(extract, cfg, loaded), prior, states, target)

    return trainer.write_trained(
        store, STAGE, CACHE_VERSION, config, parents, extract, cfg, train_fn, force=force, progress=progress
    )
