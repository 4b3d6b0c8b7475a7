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
- `--time-shift s`: t = s u / (1 + (s - 1) u) for u ~ U(0, 1) (flow.shift_time), more steps at high noise,
  where the structure of text is learned; the sampler's grid is unchanged.
- `--token-ce w`: adds w times the cross-entropy of the x0 estimate's token under cosine logits
  cos(x0_hat, E_v) / TOKEN_CE_TEMPERATURE (raw units, the rounding recovery's geometry), over the token types
  of the training sequences: the estimate is taught the token that rounding will read from it (the role of
  CDCD's score interpolation and Plaid's output head, without a second network). `--token-ce-max-t m` applies
  it only to sequences noised to t <= m: at high noise the MSE-optimal estimate is a mean of many tokens, and
  the cross-entropy there pulls it onto the frequent ones instead.
- `--data corpus` reads token ids instead of stored states: h_0 is the embedding of the tokens with the
  backbone's own scaling (stages/lm/vocab.py embedding_table), so no state is read or written per token;
  `--data corpus:SPEC` trains on another dataset's train split, tokenized here at the extract's length. The
  extract still gives the normalization, the validation sequences and the model.
- `--states model` (DiHAL-direct, l >= 1): h_l is computed from the token ids by the backbone's first l blocks on
  the training device (stages/lm/capture.py ModelStates), as train-bridge's: only the extract's token ids are read.
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
from dihal.stages.configs import DataConfig, PriorConfig
from dihal.stages.diffusion import feed, flow, trainer
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.lineage import backbone_for
from dihal.stages.lm.capture import ModelStates
from dihal.stages.lm.vocab import embedding_table
from dihal.stages.moments import config_for
from dihal.stages.moments import of as moments_of
from dihal.stages.parts.autoencoder import latents_of
from dihal.stages.parts.prior import space
from dihal.stages.runtime import plotting
from dihal.stages.runtime.dist import distributed
from dihal.stages.runtime.progress import NullProgress, Progress
from dihal.stages.text import data as data_mod

STAGE = "prior"
CACHE_VERSION = 1  # bump whenever a prior's bytes change (tests/test_golden.py says when)
TOKEN_CE_TEMPERATURE = 0.1  # --token-ce's logits are cosines / 0.1: a 20-nat range between opposite tokens


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
class Tokens:
    """The token side of a prior's data: the backbone's raw (V, D) embedding table, the (N, T) token ids that
    the task's sequence indices point into, and the token types of the training sequences (the vocabulary of
    --token-ce's logits)."""

    def __init__(self, table: torch.Tensor, ids: np.ndarray, train: np.ndarray):
        self.table, self.ids = table.float().cpu(), np.asarray(ids, dtype=np.int64)
        self.types = torch.from_numpy(np.unique(self.ids[train, 1:]))
        self.lookup = torch.full((self.table.shape[0],), -1, dtype=torch.long)
        self.lookup[self.types] = torch.arange(len(self.types))
        self.unit = torch.nn.functional.normalize(self.table[self.types], dim=-1)

    def embed(self, seqs: np.ndarray) -> np.ndarray:
        """h_0 of sequences (B, T, D): their tokens' rows of the table, as the extract stores them."""
        return self.table[torch.from_numpy(self.ids[seqs])].numpy()


class PriorTask:
    def __init__(
        self, group, cfg: PriorConfig, norm: Normalizer, tokens: Tokens | None = None, corpus=None, states=None
    ):
        """tokens: the token side (--data corpus, --token-ce); corpus: (N, T) ids of another dataset's train
        split (--data corpus:SPEC), which the training sequences are then; states: ModelStates (--states model)."""
        self.group, self.cfg, self.tokens, self.moved, self.states = group, cfg, tokens, {}, states
        self.mu, self.sigma = space(norm, cfg.layer)
        if cfg.data == "extract" and states is None:
            self.scale = hs.layer_scales(group)[cfg.layer]
        val = trainer.take_split(self, group, cfg.val_sequences)
        if corpus is not None:
            self.train_seqs, self.n_train = np.arange(len(corpus)), len(corpus)
        self.y_val = self.normalize(self._states(val, validation=True))

    def _states(self, seqs: np.ndarray, validation: bool = False) -> np.ndarray:
        if self.states is not None:
            return self.states(hs.token_ids(self.group, seqs)).cpu().numpy()
        if self.cfg.data == "extract":
            return hs.read_sequences(self.group, self.cfg.layer, seqs)
        if validation and self.cfg.data != "corpus":  # the extract's own validation tokens, embedded
            return self.tokens.table[torch.from_numpy(np.asarray(self.group["input_ids"][:])[seqs])].numpy()
        return self.tokens.embed(seqs)

    scale = 1.0  # of the stored layer the training reads (hidden_states.layer_scales); 1 for other data
    states = None  # --states model's ModelStates: h_l computed, not read

    @property
    def stored(self) -> bool:
        """Reads a stored layer (its ranks then take their own chunks' items: stages/diffusion/trainer.py)."""
        return self.cfg.data == "extract" and self.states is None

    def normalize(self, raw: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Float32 states (B, T, D), a host array or the step's tensor on the device: positions 1..T-1 normalized
        where they lie."""
        x = torch.as_tensor(raw)[:, 1:].float()
        return (x - self.moment("mu", x.device)) / self.moment("sigma", x.device)

    def moment(self, name: str, device: torch.device) -> torch.Tensor:
        """mu or sigma on `device`, moved there once (a host-to-device copy each step would wait for the device)."""
        key = (name, str(device))
        if key not in self.moved:
            self.moved[key] = getattr(self, name).to(device)
        return self.moved[key]

    def read(self, positions: np.ndarray, alloc=None) -> dict[str, np.ndarray]:
        seqs = self.train_seqs[positions]
        if self.states is not None:  # --states model: the token ids are all a step reads
            return {"ids": hs.token_ids(self.group, seqs)}
        if self.cfg.data == "extract":  # as stored: made float32 on the device (stages/diffusion/feed.py)
            out = feed.stored(self.group, self.cfg.layer, seqs, "y", False, alloc)
        else:
            out = {"y": self._states(seqs)}
        if self.cfg.token_ce:
            out["ids"] = self.tokens.ids[seqs, 1:]
        return out

    def loss(self, net, batch, draws, device) -> torch.Tensor:
        if self.states is None:
            y = self.normalize(feed.as_float(batch, "y", device, self.scale))
            targets = batch.get("ids")  # positions 1.. (read)
        else:  # --states model: the whole sequences' ids, whose positions 1.. --token-ce reads
            y = self.normalize(self.states(batch["ids"]))
            targets = torch.as_tensor(batch["ids"])[:, 1:]
        t = flow.shift_time(draws.rand(), self.cfg.time_shift)
        eps = draws.randn(*y.shape[1:])
        x_t = flow.noisy(y, eps, t)
        x0_prev = None
        if self.cfg.self_condition:  # SED: half the sequences see a first pass's estimate
            use = draws.rand() < 0.5
            with torch.no_grad():
                first = net(x_t, t, x0_prev=torch.zeros_like(y)).float()
            x0_prev = torch.where(use[:, None, None], first, torch.zeros_like(first))
        out = net(x_t, t, x0_prev=x0_prev).float()
        loss = ((out - y) ** 2).mean(dim=(1, 2))
        if self.cfg.token_ce:
            ce = self.token_ce(out, torch.as_tensor(targets).to(device))
            loss = loss + self.cfg.token_ce * ce * (t.to(device) <= self.cfg.token_ce_max_t)
        return loss.sum()

    def token_ce(self, out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Per sequence, the mean cross-entropy of the true tokens under cos(x0_hat, E_v) / TOKEN_CE_TEMPERATURE
        over the training sequences' token types; x0_hat de-normalized into the table's raw units."""
        unit, lookup = self.tokens.unit.to(out.device), self.tokens.lookup.to(out.device)
        raw = out * self.sigma.to(out.device) + self.mu.to(out.device)
        logits = torch.nn.functional.normalize(raw, dim=-1) @ unit.T / TOKEN_CE_TEMPERATURE
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), lookup[ids].flatten(), reduction="none")
        return ce.view(ids.shape).mean(dim=1)

    def validate(self, net) -> float:
        return flow.validation_loss(net, self.y_val)


class LatentPriorTask(PriorTask):
    """The prior over an autoencoder's latents: the same loss, its data the stored (N, K, d) latents."""

    stored = False  # latents in memory, no stored layer

    def __init__(self, group, cfg: PriorConfig, latents: dict[str, torch.Tensor], norm: Normalizer):
        self.group, self.cfg, self.latents, self.moved = group, cfg, latents["train"].float(), {}
        self.mu, self.sigma = norm.mu_c, norm.sigma_c
        self.n_train, self.chunk = self.latents.shape[0], int(group.attrs["chunk_seqs"])
        self.tokens_per_item = self.latents.shape[1]
        val = latents["validation"][: cfg.val_sequences].float()
        if val.shape[0] == 0:
            raise DihalError("the extract has no validation sequences; extract with --val-fraction > 0")
        self.y_val = (val - self.mu) / self.sigma

    def normalize(self, raw: np.ndarray | torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(raw).float()
        return (x - self.moment("mu", x.device)) / self.moment("sigma", x.device)

    def read(self, positions: np.ndarray, alloc=None) -> dict[str, np.ndarray]:
        return {"y": self.latents[positions].numpy()}


def latent_normalizer(latents: torch.Tensor) -> Normalizer:
    """Per-dimension statistics of (N, K, d) latents, as a Normalizer whose condition half is them."""
    flat = latents.reshape(-1, latents.shape[-1]).double()
    mu, sigma = flat.mean(0).float(), flat.std(0).clamp_min(1e-6).float()
    return Normalizer(mu, sigma, mu.clone(), sigma.clone(), torch.zeros_like(mu))


def corpus_spec(cfg: PriorConfig, extract: Artifact) -> DataConfig | None:
    """--data corpus:SPEC as the data config it is read with: the extract's length, split rule and seed."""
    if not cfg.data.startswith("corpus:"):
        return None
    own = extract.config["data"]
    return DataConfig(
        dataset=cfg.data.removeprefix("corpus:"),
        seq_len=own["seq_len"],
        val_fraction=own["val_fraction"],
        seed=own["seed"],
        text_field=own.get("text_field", "text"),
    )


def token_data(cfg: PriorConfig, extract: Artifact, group, progress: Progress) -> tuple[Tokens | None, dict]:
    """The token side of --data corpus / --token-ce, read from the backbone once, and what the manifest says of
    it; (None, {}) for a prior that reads only stored states."""
    if not cfg.reads_tokens:
        return None, {}
    loaded = backbone_for(extract, cfg.device, cfg.precision)
    table, spec = embedding_table(loaded.model), corpus_spec(cfg, extract)
    if spec is None:
        ids = np.asarray(group["input_ids"][:])
        return Tokens(table, ids, hs.split_indices(group, "train")), {}
    packed = data_mod.pack(spec, loaded.tokenizer, loaded.max_positions)
    train_ids = packed.input_ids[packed.split == 0]
    if len(train_ids) == 0:
        raise DihalError(f"--data {cfg.data} gives no training sequence of {spec.seq_len} tokens; give more text")
    progress.log(f"corpus {spec.dataset}: {len(train_ids)} training sequences of {spec.seq_len} tokens")
    about = {"corpus_fingerprint": packed.fingerprint, "corpus_documents": packed.n_documents}
    return Tokens(table, train_ids, np.arange(len(train_ids))), about


def train(
    cfg: PriorConfig,
    group,
    art: Artifact,
    progress: Progress,
    latents_art: Artifact | None = None,
    extract: Artifact | None = None,
    store: ArtifactStore | None = None,
) -> dict:
    rank, _ = distributed()
    about = {}
    if cfg.latent:
        stored = {split: latents_of(latents_art, split) for split in ("train", "validation")}
        norm = latent_normalizer(stored["train"])
        task = LatentPriorTask(group, cfg, stored, norm)
    elif cfg.states == "model":  # h_l from the backbone's blocks; the unused condition moments from its table
        loaded = backbone_for(extract, cfg.device, cfg.precision)
        states = ModelStates(loaded.model, cfg.layer)
        table = embedding_table(loaded.model)
        target = moments_of(
            extract, store, group, config_for(cfg.layer, 1, "model", cfg.device, cfg.precision), lambda: states
        )
        norm = Normalizer.fit(
            group, 0, cfg.layer, hs.split_indices(group, "train"), 1, table=table, states=states, target=target
        )
        tokens, about = token_data(cfg, extract, group, progress)  # --token-ce's token side, at layer 0
        task = PriorTask(group, cfg, norm, tokens, states=states)
    else:
        target = moments_of(extract, store, group, config_for(max(cfg.layer, 0), 1))
        norm = Normalizer.fit(group, 0, max(cfg.layer, 0), hs.split_indices(group, "train"), 1, target=target)
        tokens, about = token_data(cfg, extract, group, progress)
        task = PriorTask(group, cfg, norm, tokens, corpus=tokens.ids if about else None)
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
        **about,
        "n_train_sequences": task.n_train,
        "distinct_sequences_seen": min(result["steps"] * result["global_batch"], task.n_train),
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
    group = hs.open_with_layers(extract, () if cfg.states == "model" or cfg.latent else (0, cfg.layer))
    if cfg.latent != (latents is not None):
        raise DihalError("a prior over latents needs --latents ID (a `dihal train-autoencoder` artifact), and only it")
    if latents is not None and latents.manifest.get("parents", {}).get("extract") != extract.id:
        raise DihalError(f"autoencoder {latents.id} was not trained on extract {extract.id}; use one that was")
    config, parents = cfg.hashed(), {"extract": extract.id, **({"autoencoder": latents.id} if latents else {})}
    if spec := corpus_spec(cfg, extract):  # another dataset: its content is part of the id, as an extract's
        data_mod.check(spec)
        if data_mod.is_generated(spec.dataset):
            raise DihalError("--data corpus:generate:ID is not read by train-prior; extract it and use --data corpus")
        name, extra = data_mod.hashed_source(spec)  # a local corpus by its content, not its path
        config.update(data=f"corpus:{name}", **extra)
    train_fn = lambda art, report: train(cfg, group, art, report, latents, extract, store)
    return trainer.write_trained(
        store, STAGE, CACHE_VERSION, config, parents, extract, cfg, train_fn, force=force, progress=progress
    )
