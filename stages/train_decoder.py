"""`dihal train-decoder`: the CoDAR recovery of METHOD §5.

A causal decoder with cross-attention (stages/diffusion/cross_decoder.py) learns to emit a sequence's
tokens 1..T-1 from its normalized embeddings e = (h_0 - mu_c) / sigma_c at positions 1..T-1,
teacher forced, with the conditions corrupted as the hidden-state recovery's bridge sees them:
e + sigma z, sigma ~ U(0, --condition-noise) per sequence. Its token input and output are the
backbone's embedding table, frozen (read from the backbone once, never saved with the weights),
so only its blocks and projections train, as for the bridge. Same protocols and loop as the
bridge and the prior (the same steps x batch as the bridge it is compared with); width from the
protocol, depth 2. The manifest records the unigram entropy of the training tokens: the loss of
a decoder that reads neither its condition nor its context.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F

from dihal.artifacts import files
from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import Artifact, ArtifactStore
from dihal.stages.condition import check_condition_prior, condition_prior
from dihal.stages.configs import DECODER_DEPTH, DecoderTrainConfig
from dihal.stages.diffusion import feed, trainer
from dihal.stages.diffusion.cross_decoder import VAL_BATCH, CrossDecoder, DecoderConfig, teacher_forced
from dihal.stages.diffusion.flow import corrupt
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.lineage import backbone_for
from dihal.stages.lm.capture import ModelStates
from dihal.stages.moments import config_for
from dihal.stages.moments import of as moments_of
from dihal.stages.parts.decoder import frozen_table
from dihal.stages.runtime import plotting
from dihal.stages.runtime.dist import distributed
from dihal.stages.runtime.progress import NullProgress, Progress

STAGE = "decoder"
# 2: the token input and output are the backbone's frozen embedding table (METHOD §5, method revision 2); a
#    version-1 decoder trained its own vocabulary-sized table and head, and its weights do not load.
#    Bump whenever a decoder's bytes change (tests/test_golden.py says when).
CACHE_VERSION = 2


class DecoderTask:
    def __init__(self, group, cfg: DecoderTrainConfig, norm: Normalizer, prior=None, states=None):
        """prior: a trained stages.parts.prior.Prior whose estimates corrupt e (--condition-noise prior:T);
        states: ModelStates of layer 0 (--states model: h_0 computed from the token ids, none read)."""
        self.group, self.cfg, self.norm, self.prior, self.states = group, cfg, norm, prior, states
        self.stored = states is None  # reads h_0 from the store (trainer.py: ranks take their own chunks' items)
        self.on_device = norm.to(cfg.device)  # the condition is normalized where it trains
        self.scale = hs.layer_scales(group)[0] if states is None else 1.0
        val = trainer.take_split(self, group, cfg.val_sequences)
        ids = np.asarray(group["input_ids"].oindex[val])
        c = hs.read_sequences(group, 0, val) if states is None else torch.cat(list(states.blocks(ids))).numpy()
        self.val = {"c": c, "ids": ids}

    def read(self, positions: np.ndarray, alloc=None) -> dict[str, np.ndarray]:
        seqs = self.train_seqs[positions]  # h_0 as stored, made float32 on the device (stages/diffusion/feed.py)
        if self.states is not None:  # --states model: the token ids are all a step reads
            return {"ids": hs.token_ids(self.group, seqs)}
        condition = feed.stored(self.group, 0, seqs, "c", False, alloc)
        return {**condition, "ids": hs.token_ids(self.group, seqs)}

    def condition(self, raw: np.ndarray) -> torch.Tensor:
        return self.norm.c(torch.from_numpy(raw[:, 1:].astype(np.float32)))

    def loss(self, net, batch, draws, device) -> torch.Tensor:
        if self.states is None:
            raw = feed.as_float(batch, "c", device, self.scale)[:, 1:]
        else:
            raw = self.states(batch["ids"])[:, 1:]
        if self.prior is not None:
            e = self.on_device.c(self.prior.corrupt(raw, self.cfg.condition_noise, draws))
        else:
            e = corrupt(self.on_device.c(raw), self.cfg.condition_noise, draws)
        ids = torch.as_tensor(batch["ids"]).to(device).long()
        logits = net(ids[:, :-1], e).float()
        per_token = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        return per_token.mean(dim=1).sum()

    def validate(self, net) -> float:
        """Token cross-entropy on clean validation conditions (teacher forced), VAL_BATCH sequences at a
        time and the logits in slices (cross_decoder.teacher_forced)."""
        device = next(net.parameters()).device
        nll, count = 0.0, 0
        for s in range(0, len(self.val["ids"]), VAL_BATCH):
            e = self.condition(self.val["c"][s : s + VAL_BATCH]).to(device)
            ids = torch.from_numpy(self.val["ids"][s : s + VAL_BATCH].astype(np.int64)).to(device)
            batch_nll, _, tokens = teacher_forced(net, ids, e)
            nll, count = nll + batch_nll, count + tokens
        return nll / count


def unigram_entropy(ids: np.ndarray) -> float:
    """Entropy (nats) of the token frequencies of ids: the cross-entropy floor of a decoder that uses
    neither its condition nor the tokens before."""
    counts = np.bincount(ids.ravel())
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def train(
    cfg: DecoderTrainConfig,
    group,
    art: Artifact,
    table: torch.Tensor,
    progress: Progress,
    prior=None,
    target=None,
    states=None,
) -> dict:
    """table: the backbone's raw (V, D) embedding table (stages/lm/vocab.py embedding_table); target: layer 0's
    stored moments (stages/moments.py), else computed here; states: ModelStates of layer 0 (--states model)."""
    rank, _ = distributed()
    norm = Normalizer.fit(group, 0, 0, hs.split_indices(group, "train"), 1, states=states, target=target)
    task = DecoderTask(group, cfg, norm, prior, states)
    net_cfg = DecoderConfig(
        vocab=int(table.shape[0]),
        dim=int(norm.mu_c.shape[0]),
        width=cfg.width,
        depth=DECODER_DEPTH,
        heads=cfg.heads,
        max_len=task.tokens_per_item,
    )
    torch.manual_seed(cfg.seed)
    net = CrossDecoder(net_cfg, norm.c(table.float().cpu()))
    start = int(np.asarray(group["input_ids"][:1, 0])[0])
    if rank == 0:
        meta = {"decoder": asdict(net_cfg), "start_token": start, "seq_len": task.tokens_per_item + 1}
        art.file("decoder.json").write_text(json.dumps(meta, indent=2))
        files.save_tensors(art.file("stats.safetensors"), norm.tensors())
    loop = trainer.loop_config(cfg)
    result = trainer.train(task, net, loop, art.path, progress, "decoder")
    log = result.pop("log")
    floor = unigram_entropy(np.asarray(group["input_ids"].oindex[task.train_seqs])[:, 1:])
    if rank == 0:
        title = f"decoder ({cfg.protocol}); dashed: unigram entropy {floor:.2f}"
        plotting.loss_curve(log, art.file("loss_curve.png"), title, "token cross-entropy", floor=floor)
    return {
        **result,
        "n_train_sequences": task.n_train,
        "unigram_entropy": floor,
        "parameters": sum(p.numel() for p in net.parameters()),
        "frozen_parameters": int(table.numel()),
        "tokens_seen": result["steps"] * result["global_batch"] * task.tokens_per_item,
    }


def run(
    cfg: DecoderTrainConfig,
    extract: Artifact,
    store: ArtifactStore,
    *,
    prior: Artifact | None = None,
    loaded=None,
    force: bool = False,
    progress: Progress | None = None,
) -> Artifact:
    """prior: the layer-0 prior of --condition-noise prior:T; loaded: the backbone, when the caller holds it
    (its embedding table is read from it), else it is read once on the run's device and dtype."""
    progress = progress or NullProgress()
    group = hs.open_with_layers(extract, () if cfg.states == "model" else (0,))
    config, parents = cfg.hashed(), {"extract": extract.id, **check_condition_prior(cfg, extract, prior)}

    def train_fn(art, report):
        if cfg.states == "store":
            table = frozen_table(extract, cfg, loaded)
            target = moments_of(extract, store, group, config_for(0, 1))
            return train(cfg, group, art, table, report, condition_prior(prior, cfg), target)
        loaded_ = loaded or backbone_for(extract, cfg.device, cfg.precision)
        states = ModelStates(loaded_.model, 0)  # h_0: the backbone's embedding of the token ids, on the device
        target = moments_of(extract, store, group, config_for(0, 1, "model", cfg.device, cfg.precision), lambda: states)
        table = frozen_table(extract, cfg, loaded_)
        return train(cfg, group, art, table, report, condition_prior(prior, cfg), target, states)

    return trainer.write_trained(
        store, STAGE, CACHE_VERSION, config, parents, extract, cfg, train_fn, force=force, progress=progress
    )
