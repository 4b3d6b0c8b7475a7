"""`dihal generate --mode parallel` (METHOD §5): whole sequences from a prior's noise, then
tokens by a recovery of stages/registry.py's RECOVERIES.

    source    the prior's samples (cfg.prior_steps Euler steps, clamped for Diffusion-LM), its initial
              noise (the null prior) or held-out real states (the oracle prior): the controls that
              bracket each recovery
    recovery  rounding, a decoder, the bridge and the upper blocks, or an autoencoder's decoder
              (stages/recover.py), each decoded with the one decoding of stages/lm/decoding.py

Rows of a comparison that share a prior, its steps, the seed and clamping read the same samples,
integrated once per process (prior_samples). Its cost is reported apart from the recovery's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import torch

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import COMMANDS, Artifact, ArtifactStore, Job
from dihal.stages.configs import GenerateConfig
from dihal.stages.generate import CACHE_VERSION, STAGE
from dihal.stages.lineage import origin
from dihal.stages.lm import decoding
from dihal.stages.lm.models import LoadedModel
from dihal.stages.lm.tokens import truncate
from dihal.stages.registry import RECOVERIES, resolve
from dihal.stages.runtime import clock, dist
from dihal.stages.runtime.progress import NullProgress, Progress


def check_parallel(cfg: GenerateConfig, prior_art: Artifact, recovery_art: Artifact | None) -> None:
    """Every way the prior, the recovery and its part can disagree, as one line each."""
    layer, latent = prior_art.config.get("layer", 0), prior_art.config.get("latent", False)
    if latent != (cfg.recovery == "latent"):
        raise DihalError(
            f"prior {prior_art.id} models an autoencoder's latents: use --recovery latent --autoencoder ID"
            if latent
            else "--recovery latent reads a prior over latents (dihal train-prior --latents ID)"
        )
    made_by = prior_art.manifest["parents"].get("autoencoder")
    if latent and (recovery_art is None or recovery_art.id != made_by):
        raise DihalError(f"prior {prior_art.id} models the latents of autoencoder {made_by}; give it as --autoencoder")
    if cfg.clamp and latent:
        raise DihalError("--clamp snaps to token embeddings, so it applies to a prior over layer 0 only")
    needs = RECOVERIES[cfg.recovery].needs if layer == 0 else None
    if layer and cfg.recovery != "hidden":
        raise DihalError(
            f"prior {prior_art.id} models h_{layer} (DiHAL-direct), which the upper blocks recover: "
            "use --recovery hidden without --bridge"
        )
    if layer and recovery_art is not None:
        raise DihalError(
            f"prior {prior_art.id} models h_{layer} itself; a bridge or decoder has nothing to do, leave them out"
        )
    if needs and (recovery_art is None or recovery_art.stage != needs):
        raise DihalError(f"--recovery {cfg.recovery} needs --{needs} ID (a `dihal {COMMANDS[needs]}` artifact)")
    if needs is None and layer == 0 and recovery_art is not None:
        raise DihalError(f"--recovery rounding uses no {recovery_art.stage}; leave --{recovery_art.stage} out")
    if cfg.clamp and layer:
        raise DihalError("--clamp snaps to token embeddings, so it applies to a prior over layer 0 only")
    if cfg.readout != "independent" and layer:
        raise DihalError(
            f"--readout {cfg.readout} conditions a bridge on token embeddings; prior {prior_art.id} models h_{layer} "
            "(DiHAL-direct), which has no bridge: use a prior over h_0 with --bridge ID"
        )
    if recovery_art is not None and origin(recovery_art) != origin(prior_art):
        a, b = origin(prior_art), origin(recovery_art)
        other = " (the same path, other weights)" if (a.model, a.seq_len) == (b.model, b.seq_len) else ""
        raise DihalError(
            f"prior {prior_art.id} was trained on {a.model} at --seq-len {a.seq_len} but {recovery_art.stage} "
            f"{recovery_art.id} on {b.model} at --seq-len {b.seq_len}{other}; use parts of the same model and seq_len"
        )


def parallel_label(prior_art: Artifact, cfg: GenerateConfig, recovery_art: Artifact | None) -> str:
    layer, sc = prior_art.config.get("layer", 0), prior_art.config.get("self_condition")
    if prior_art.config.get("latent"):
        layer = "latents"
    part = f" L{recovery_art.config['layer']}" if recovery_art is not None and recovery_art.stage == "bridge" else ""
    source = "" if cfg.source == "prior" else f" ({cfg.source} prior)"
    readout = "" if cfg.readout == "independent" else f", {cfg.readout} gamma {cfg.guidance:g}"
    return (
        f"prior h_{layer}{' SC' if sc else ''}{' clamp' if cfg.clamp else ''}{source} + {cfg.recovery}{part}{readout}"
    )


# The prior's samples of this process, by what determines them: rows that share a prior, its steps, the
# seed and clamping read the same samples (METHOD §5), so `dihal compare` integrates each prior once for
# all of them (CoDAR, DiHAL and DiHAL at argmin S, at every temperature) instead of once per row. Kept on
# the CPU, the last PRIOR_SAMPLES_KEPT of them; each entry keeps the seconds its integration took, which
# every generation that reads it reports as its prior's cost.
_PRIOR_SAMPLES: dict[tuple, tuple[torch.Tensor, float]] = {}
PRIOR_SAMPLES_KEPT = 4


def prior_samples(cfg: GenerateConfig, prior, prior_art: Artifact, table) -> tuple[torch.Tensor, float, bool]:
    """(N, T', D) samples of the prior (cfg.prior_steps Euler steps, clamped if cfg.clamp), the seconds
    their integration took, and whether they were already in memory (a fresh copy either way)."""
    key = (prior_art.id, str(prior_art.path), prior_art.manifest.get("created"), cfg.num_samples, cfg.prior_steps)
    key += (cfg.seed, cfg.batch_size, cfg.clamp, cfg.device, cfg.dtype)
    reused = key in _PRIOR_SAMPLES
    if not reused:
        start = clock.now(cfg.device)
        e = prior.sample(cfg.num_samples, cfg.prior_steps, cfg.seed, cfg.batch_size, table() if cfg.clamp else None)
        _PRIOR_SAMPLES[key] = (e.detach().cpu().clone(), clock.now(cfg.device) - start)
        while len(_PRIOR_SAMPLES) > PRIOR_SAMPLES_KEPT:
            _PRIOR_SAMPLES.pop(next(iter(_PRIOR_SAMPLES)))
    e, seconds = _PRIOR_SAMPLES[key]
    return e.clone().to(cfg.device), seconds, reused


def sources(
    cfg: GenerateConfig, prior, prior_art: Artifact, store: ArtifactStore, table, loaded=None
) -> tuple[torch.Tensor, float | None, bool]:
    """(N, T', D) normalized states the recovery reads: the prior's samples, its initial noise (the
    null prior: zero denoising steps) or the held-out real states it models (the oracle prior); with
    the prior's samples, the seconds their integration took and whether they were reused."""
    if cfg.source == "oracle" and prior.latent:
        return oracle_latents(prior, prior_art, store, cfg.num_samples).to(cfg.device), None, False
    if cfg.source == "oracle":
        return oracle_states(prior, prior_art, store, cfg.num_samples, loaded).to(cfg.device), None, False
    if cfg.source == "null":
        return prior.sample(cfg.num_samples, 0, cfg.seed, cfg.batch_size, table() if cfg.clamp else None), None, False
    return prior_samples(cfg, prior, prior_art, table)


def plan_agreement(e: torch.Tensor, tokens: torch.Tensor, prior, table) -> float:
    """The share of tokens (N, T') equal to the cosine-nearest token of the prior's sample at their
    position (METHOD §5.1; 1 for rounding by definition): how much of the text the diffusion planned."""
    from dihal.stages.lm.vocab import rounding

    return float((rounding(e, table(), prior.mu, prior.sigma) == tokens.to(e.device)).float().mean())


def held_out(prior_art: Artifact, store: ArtifactStore, n: int) -> None:
    """--source oracle reads n held-out sequences (an autoencoder's validation latents for a prior over
    latents): one line where there are fewer, before any model is loaded."""
    import numpy as np

    from dihal.artifacts import hidden_states as hs

    extract = store.load("extract", prior_art.manifest["parents"]["extract"])
    split = np.asarray(hs.open_group(extract)["split"][:])
    have = int((split == hs.SPLITS["validation"]).sum())
    if have < n:
        raise DihalError(
            f"--source oracle reads held-out sequences, but extract {extract.id} has {have} validation "
            f"sequences; use --num-samples {have} or fewer, or extract with a larger --val-fraction"
        )


def oracle_latents(prior, prior_art: Artifact, store: ArtifactStore, n: int) -> torch.Tensor:
    """The autoencoder's latents of the first n validation sequences, in the prior's normalization."""
    from dihal.stages.parts.autoencoder import latents_of

    val = latents_of(store.load("autoencoder", prior_art.manifest["parents"]["autoencoder"]), "validation")
    return (val[:n].to(prior.mu.device) - prior.mu) / prior.sigma


def oracle_states(prior, prior_art: Artifact, store: ArtifactStore, n: int, loaded=None) -> torch.Tensor:
    """The first n validation sequences of the prior's extract, at its layer, in its normalization: read, or
    computed by the backbone's first l blocks where the prior computed its own (--states model)."""
    import numpy as np

    from dihal.artifacts import hidden_states as hs
    from dihal.stages.lm.capture import ModelStates

    extract = store.load("extract", prior_art.manifest["parents"]["extract"])
    group = hs.open_group(extract)
    val = hs.split_indices(group, "validation")[:n]
    if prior_art.config.get("states") == "model":
        states, ids = ModelStates(loaded.model, prior.layer), hs.token_ids(group, val)
        raw = torch.cat([block[:, 1:] for block in states.blocks(ids)])
        return (raw.to(prior.mu.device) - prior.mu) / prior.sigma
    raw = torch.from_numpy(hs.read_sequences(group, prior.layer, val)[:, 1:].astype(np.float32))
    return (raw.to(prior.mu.device) - prior.mu) / prior.sigma


def run_parallel(
    cfg: GenerateConfig,
    prior_art: Artifact,
    store: ArtifactStore,
    loaded: LoadedModel | Callable[[], LoadedModel],
    recovery_art: Artifact | None = None,
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Artifact:
    """N sequences of seq_len - 1 tokens from the prior's noise (seed), recovered as cfg.recovery says."""
    from dihal.stages.lm.vocab import embedding_table
    from dihal.stages.parts.prior import Prior

    progress = progress or NullProgress()
    if cfg.mode != "parallel":
        raise DihalError("run_parallel needs --mode parallel")
    check_parallel(cfg, prior_art, recovery_art)
    if cfg.source == "oracle":  # before the model loads: the held-out sequences must be there
        held_out(prior_art, store, cfg.num_samples)
    parents = {"prior": prior_art.id, **({recovery_art.stage: recovery_art.id} if recovery_art is not None else {})}
    config = cfg.hashed()
    extra = {"model": prior_art.manifest.get("model"), "extract_config": prior_art.manifest.get("extract_config")}

    def work(art: Artifact) -> None:
        nonlocal loaded
        loaded = loaded() if callable(loaded) else loaded
        prior = Prior.load(prior_art, cfg.device)
        tables = []  # the raw embedding table, computed once if clamping, rounding or a decoder needs it

        def table() -> torch.Tensor:
            if not tables:
                tables.append(embedding_table(loaded.model).to(cfg.device))
            return tables[0]

        progress.start("generate", cfg.num_samples, "sample")
        start = clock.now(cfg.device)
        e, integrated, reused = sources(cfg, prior, prior_art, store, table, loaded)
        prior_seconds, start = integrated or clock.now(cfg.device) - start, clock.now(cfg.device)  # reused: its cost
        e_digest = hashlib.sha256(e.detach().cpu().numpy().tobytes()).hexdigest()[:16]
        recovery = resolve(RECOVERIES[cfg.recovery].fn)(loaded, prior, recovery_art, cfg, table)
        if hasattr(recovery, "calibrate"):  # guided readouts: s^2 from this run's own samples (METHOD §5.1)
            recovery.calibrate(e)
        tokens = []
        for first in range(0, cfg.num_samples, cfg.batch_size):
            block = e[first : first + cfg.batch_size]
            tokens.append(recovery.tokens(block, first))
            progress.advance(block.shape[0])
        recovery_seconds = clock.now(cfg.device) - start
        progress.stop()
        agreement = plan_agreement(e, torch.cat(tokens), prior, table) if not (prior.layer or prior.latent) else None
        label, tok = parallel_label(prior_art, cfg, recovery_art), loaded.tokenizer
        rows = []
        for row_ids in torch.cat(tokens).tolist():
            kept = truncate(row_ids, loaded.stop_ids)
            rows.append(
                {
                    "prompt": "",
                    "text": tok.decode(kept, skip_special_tokens=True),
                    "token_ids": kept,
                    "model": label,
                    "n_tokens": len(kept),
                }
            )
        art.file("samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        n = cfg.num_samples
        art.manifest["metrics"] = {
            "label": label,
            "mean_tokens": sum(r["n_tokens"] for r in rows) / n,
            "ms_per_sample": 1000 * (prior_seconds + recovery_seconds) / n,
            "prior_ms_per_sample": 1000 * prior_seconds / n,
            "recovery_ms_per_sample": 1000 * recovery_seconds / n,
            "prior_steps": cfg.prior_steps,
            "prior_samples_reused": reused,  # integrated for an earlier row of this process (the same samples)
            "prior_samples_sha256": e_digest,  # rows sharing the prior and seed (and clamping) share it
            "plan_agreement": agreement,  # METHOD §5.1: tokens equal to the cosine-nearest token of the sample
            **(recovery.describe() if hasattr(recovery, "describe") else {}),
        }
        art.manifest["decoding"] = decoding.describe(cfg.decoding_temperature, cfg.top_p, cfg.top_k)

    job = Job(STAGE, CACHE_VERSION, config, parents, work, seed=cfg.seed, device=cfg.device, extra=extra)
    return store.run_stage(job, force=force, progress=progress, group=dist.group())
