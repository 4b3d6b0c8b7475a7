"""The bridge's training text with the backbone's own samples in it (README, "Training on the
model's own text"; `dihal train-bridge --own-text SHARE`).

A hybrid that runs free feeds its bridge the text the backbone writes, not the corpus. So before
the extract a bridge trains on, the original backbone writes `own_samples` unprompted samples
(a generate artifact, `--baseline original-only`, seq_len - 1 new tokens after the start token),
and the extract draws `own_text` of its sequences from them and the rest from the corpus. The
extract's `data` names the generate artifact (generate:<ID>), so the lineage shows which bridge
learned from which model's text. Nothing here changes when own_text is 0.
"""

from __future__ import annotations

from dataclasses import replace

from dihal.artifacts.store import Artifact, ArtifactStore, artifact_id
from dihal.stages import generate
from dihal.stages.configs import ExtractConfig, GenerateConfig, OwnTextConfig
from dihal.stages.lm.models import load_model
from dihal.stages.runtime.progress import Progress
from dihal.stages.text.data import GENERATED


def samples_config(cfg: OwnTextConfig, ecfg: ExtractConfig) -> GenerateConfig:
    """The backbone's own samples: unprompted, one extract sequence long, on the extract's hardware."""
    return GenerateConfig(
        baseline="original-only",
        model=ecfg.model,
        num_samples=cfg.own_samples,
        max_new_tokens=ecfg.data.seq_len - 1,
        batch_size=cfg.batch_size,
        seed=cfg.own_seed,
        device=ecfg.device,
        dtype=ecfg.dtype,
    )


def samples_id(cfg: OwnTextConfig, ecfg: ExtractConfig) -> str:
    """The id the samples have (or will have): what a dry run shows before anything is made."""
    return artifact_id(generate.STAGE, samples_config(cfg, ecfg).hashed(), {})


def with_samples(ecfg: ExtractConfig, cfg: OwnTextConfig, samples: str) -> ExtractConfig:
    """ecfg drawing `own_text` of its sequences from generate artifact `samples`, the rest from its
    own sources at their shares."""
    spec, data = GENERATED + samples, ecfg.data
    if cfg.own_text == 0:
        return ecfg
    if cfg.own_text == 1:
        return replace(ecfg, data=replace(data, dataset=spec, also=(), mix=()))
    mix = tuple(share * (1 - cfg.own_text) for share in data.shares) + (cfg.own_text,)
    return replace(ecfg, data=replace(data, also=(*data.also, spec), mix=mix))


def planned(cfg: OwnTextConfig, ecfg: ExtractConfig) -> ExtractConfig:
    """The extract that run() will return, without running anything (for --dry-run)."""
    return with_samples(ecfg, cfg, samples_id(cfg, ecfg))


def run(
    cfg: OwnTextConfig,
    ecfg: ExtractConfig,
    store: ArtifactStore,
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> tuple[ExtractConfig, Artifact]:
    """Make (or reuse) the backbone's own samples: the extract config that draws on them, and them."""
    load = lambda: load_model(ecfg.model, ecfg.device, ecfg.dtype, ecfg.revision, ecfg.trust_remote_code)  # noqa: E731
    art = generate.run(samples_config(cfg, ecfg), None, store, load, force=force, progress=progress)
    return with_samples(ecfg, cfg, art.id), art
