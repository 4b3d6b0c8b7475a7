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

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, Job
from dihal.stages import generate
from dihal.stages.configs import DataConfig, ExtractConfig, GenerateConfig, OwnTextConfig
from dihal.stages.extract import given_sequences
from dihal.stages.lm.models import load_model
from dihal.stages.runtime.progress import Progress
from dihal.stages.text.data import GENERATED, SPLIT_NAMES, allot, is_validation, wanted_counts

# --own-samples auto: each sample is counted as giving YIELD of an extract sequence. A sample of seq_len - 1
# new tokens gives one; one that stopped at EOS part of one (1024 smollm2-135m samples of 63 tokens gave 977
# sequences, 0.95; one split of 600 gave 0.87), so 0.8 leaves a margin for a model that stops more often.
YIELD = 0.8
UNSIZED = 1024  # auto without --max-sequences: the mix then takes as many sequences as the samples give


# -- how many samples, known before any is written -------------------------------------------------------------
def asked(cfg: OwnTextConfig, ecfg: ExtractConfig) -> tuple[int, int] | None:
    """(train, validation) sequences the extract's mix asks of the samples; None without --max-sequences
    (the mix then takes as many as the scarcest source gives)."""
    data = with_samples(ecfg, cfg, "planned").data
    wanted = wanted_counts(data)
    if wanted[0] is None:
        return None
    return tuple(allot(w, data.shares)[len(data.sources) - 1] for w in wanted)


def documents_per_split(n: int, data: DataConfig) -> tuple[int, int]:
    """(train, validation) samples among the first n: a document's split is a hash of its index (the
    extract's rule), and every sample is one document."""
    val = sum(is_validation(i, data.val_fraction, data.seed) for i in range(n))
    return n - val, val


def sized(cfg: OwnTextConfig, ecfg: ExtractConfig) -> OwnTextConfig:
    """cfg with --own-samples auto made a number: the fewest samples whose documents, at YIELD of a
    sequence each, give every split its share (UNSIZED without --max-sequences)."""
    if cfg.own_samples is not None or not cfg.own_text:
        return cfg
    need = asked(cfg, ecfg)
    return replace(cfg, own_samples=UNSIZED if need is None else fewest(need, ecfg.data, YIELD))


def fewest(need: tuple[int, int], data: DataConfig, per_sample: float) -> int:
    """The fewest samples whose documents per split, times per_sample, cover need."""
    n, have = 0, [0, 0]
    while any(have[s] * per_sample < need[s] for s in (0, 1)):
        have[int(is_validation(n, data.val_fraction, data.seed))] += 1
        n += 1
    return n


def check_sizes(cfg: OwnTextConfig, ecfg: ExtractConfig, store: ArtifactStore) -> list[str]:
    """Before any sample is written: one error line where the samples cannot give a split its share (exactly,
    when they exist already; at most one sequence a sample, when they do not), naming the --own-samples and
    the --max-sequences that would do; a warning where only samples that all run to full length would."""
    need = asked(cfg, ecfg)
    if not cfg.own_text or need is None:
        return []
    data, n = with_samples(ecfg, cfg, "planned").data, sized(cfg, ecfg).own_samples
    existing = store.load(generate.STAGE, samples_id(cfg, ecfg))
    given = given_sequences(existing, data) if existing.complete else None
    have = given or documents_per_split(n, data)
    short = [s for s in (0, 1) if have[s] < need[s]]
    if short:
        s, m = short[0], ecfg.data.max_sequences
        fits = next((k for k in range(m, 0, -1) if all(a <= h for a, h in zip(asked_at(cfg, ecfg, k), have))), None)
        bound = "give" if given else "give at most"
        raise DihalError(
            f"--own-samples {n} {bound} {have[s]} {SPLIT_NAMES[s]} sequences, but --own-text {cfg.own_text:g} of "
            f"--max-sequences {m} asks {need[s]} of them; use --own-samples {fewest(need, data, YIELD)} (or auto)"
            + (f", or --max-sequences {fits}" if fits else "")
        )
    if given:
        return []
    return [
        f"warning: --own-samples {n} give at most {have[s]} {SPLIT_NAMES[s]} sequences and the mix asks {need[s]}: "
        f"samples that stop early may leave too few; --own-samples {fewest(need, data, YIELD)} (auto) leaves a margin"
        for s in (0, 1)
        if have[s] * YIELD < need[s]
    ]


def asked_at(cfg: OwnTextConfig, ecfg: ExtractConfig, max_sequences: int) -> tuple[int, int]:
    return asked(cfg, replace(ecfg, data=replace(ecfg.data, max_sequences=max_sequences)))


def samples_config(cfg: OwnTextConfig, ecfg: ExtractConfig) -> GenerateConfig:
    """The backbone's own samples: unprompted, one extract sequence long, on the extract's hardware."""
    return GenerateConfig(
        baseline="original-only",
        model=ecfg.model,
        num_samples=sized(cfg, ecfg).own_samples,
        max_new_tokens=ecfg.data.seq_len - 1,
        batch_size=cfg.batch_size,
        seed=cfg.own_seed,
        device=ecfg.device,
        dtype=ecfg.dtype,
    )


def samples_id(cfg: OwnTextConfig, ecfg: ExtractConfig) -> str:
    """The id the samples have (or will have): what a dry run shows before anything is made."""
    return Job(generate.STAGE, generate.CACHE_VERSION, generate.generate_key(samples_config(cfg, ecfg)), {}).id


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
    """The extract that run() will return, without running anything (for --dry-run); ecfg itself without
    --own-text (no samples' id is computed, so nothing of the model is read or its digest remembered)."""
    return with_samples(ecfg, cfg, samples_id(cfg, ecfg)) if cfg.own_text else ecfg


def run(
    cfg: OwnTextConfig,
    ecfg: ExtractConfig,
    store: ArtifactStore,
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> tuple[ExtractConfig, Artifact]:
    """Make (or reuse) the backbone's own samples: the extract config that draws on them, and them."""
    load = lambda: load_model(ecfg.model, ecfg.device, ecfg.dtype, ecfg.revision, ecfg.trust_remote_code)
    art = generate.run(samples_config(cfg, ecfg), None, store, load, force=force, progress=progress)
    return with_samples(ecfg, cfg, art.id), art
