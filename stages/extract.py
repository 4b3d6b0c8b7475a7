"""`dihal extract`: per-layer hidden states -> one chunked Zarr v3 group per artifact.

Work is split into chunks of `batch_size` sequences; each chunk is one forward pass and one
committed write, so an interrupted run resumes at the first uncommitted chunk and ends with
the same bytes as an uninterrupted one. Under torchrun, rank r takes chunks r, r+W, r+2W, ...
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, Job, dir_size
from dihal.stages.configs import ExtractConfig, parse_layers
from dihal.stages.lineage import same_model
from dihal.stages.lm.capture import capture_layers, run_capture
from dihal.stages.lm.models import (
    BUILTINS,
    LoadedModel,
    builtin_gguf,
    check_remote_code,
    load_model,
    locate,
    not_finite,
    weights_digests,
)
from dihal.stages.lm.tokens import document_end
from dihal.stages.runtime import dist, hub
from dihal.stages.runtime.progress import NullProgress, Progress
from dihal.stages.text import data as data_mod
from dihal.stages.text import dolma

STAGE = "extract"
CACHE_VERSION = 2  # 2: documents joined by the pretraining end-of-document token (stages/lm/tokens.py)
FLOAT16_MAX = 65504.0
AUTO_HEADROOM = 4.0  # --store-dtype auto: float16 only for a layer whose first batch stays under 65504 / 4


def resolved_config(cfg: ExtractConfig, hashed: tuple | None = None) -> dict:
    """What the artifact id hashes: the flags plus what makes the inputs unique. hashed: data.hashed_data's
    result for cfg.data, when the caller has it already."""
    resolved = cfg.hashed()
    resolved["data"], digests, _ = hashed or data_mod.hashed_data(cfg.data)  # local files: by their content
    if digests:
        resolved["data_sha256"] = digests
    if "pydoc" in cfg.data.sources:
        resolved["pydoc_python"] = data_mod.python_version_tag()
    resolved.update(weights_digests(model=cfg.model))  # a local model: its files' content, not only its path
    if cfg.store_dtype != "float32":  # float16 layers keep position 0 apart (pos0/<l>) and auto scales them
        resolved["float16_layout"] = "position 0 apart in float32; auto divides a layer by 2^k to fit"
    return resolved


def prompt_of(row: dict, tokenizer) -> list[int]:
    """A sample's prompt ids after the start token: as recorded, or re-tokenized for older samples."""
    if "prompt_ids" in row:
        return row["prompt_ids"][1:]
    return tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] if row["prompt"] else []


def generated_documents(data, store: ArtifactStore, loaded: LoadedModel) -> dict[str, list[list[int]]]:
    """{generate:<ID>: documents} for the generate: sources of `data`. A document is one
    sample as its model wrote it: the prompt's ids after the start token (as the model read them;
    re-tokenized only for samples made before they were recorded), the new ids, and the document end
    (stages/lm/tokens.py) where the sample stopped. The backbone's own samples are read
    (samples_original.jsonl, or samples.jsonl of an original-only artifact); an artifact of another
    model is refused."""
    import json

    docs, tok = {}, loaded.tokenizer
    end = document_end(tok)
    for spec in (s for s in data.sources if data_mod.is_generated(s)):
        art = store.resolve(spec.removeprefix(data_mod.GENERATED), "generate")
        if not same_model(art.manifest.get("model") or {}, loaded.identity):
            made_by = (art.manifest.get("model") or {}).get("name", "another model")
            raise DihalError(
                f"generate artifact {art.id} holds token ids of {made_by}, which mean nothing to the tokenizer "
                f"of {loaded.identity['name']}; extract it with --model {made_by}"
            )
        rows = [json.loads(line) for line in art.file(samples_file(art)).read_text().splitlines()]
        if not rows or rows[0]["model"] != "original":
            raise DihalError(
                f"generate artifact {art.id} has no samples of the original backbone; make them with "
                "`dihal generate --baseline original-only` (or --baseline original)"
            )
        stopped = [end is not None and r["n_tokens"] < art.config["max_new_tokens"] for r in rows]
        docs[spec] = [prompt_of(r, tok) + r["token_ids"] + [end["id"]] * s for r, s in zip(rows, stopped)]
    return docs


def model_config(spec: str, trust_remote_code: bool = False):
    """The backbone's config only (no weights), for validation and dry runs: nothing is converted or written
    (a builtin's shape is recorded beside it, a .gguf's is read from its header)."""
    from transformers import AutoConfig, PretrainedConfig

    if spec in BUILTINS:
        builtin_gguf(spec, assemble=False)  # its package is installed (one line naming the install if not)
        return PretrainedConfig(**BUILTINS[spec]["shape"]), {"name": spec, "source": "builtin"}
    if spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise DihalError(f"GGUF file '{spec}' does not exist; check the path")
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name), {"name": path.name, "source": "gguf"}
    where, identity = locate(spec)
    check_remote_code(spec, where, trust_remote_code)
    if identity["source"] == "hub":
        try:
            return AutoConfig.from_pretrained(
                where, local_files_only=True, trust_remote_code=trust_remote_code
            ), identity
        except OSError:
            raise DihalError(
                f"model '{spec}' is not in the local Hugging Face cache; the dry run checks hub models "
                "only once they are cached"
            ) from None
    return AutoConfig.from_pretrained(str(where), trust_remote_code=trust_remote_code), identity


@dataclass
class Plan:
    layers: list[int]
    num_blocks: int
    width: int
    n_sequences: int | None
    bytes_estimate: int | None
    identity: dict


def samples_file(art: Artifact) -> str:
    """Where a generate artifact keeps the backbone's own samples."""
    return "samples_original.jsonl" if art.file("samples_original.jsonl").exists() else "samples.jsonl"


def given_sequences(art: Artifact, data) -> tuple[int, int] | None:
    """(train, validation) sequences a generate artifact's samples pack into, exactly: a document is its
    prompt, its new tokens and EOS where it stopped early; a split packs seq_len - 1 tokens a sequence.
    None for samples whose prompts were not recorded as ids (counted only once re-tokenized)."""
    import json

    body, totals = data.seq_len - 1, [0, 0]
    rows = [json.loads(line) for line in art.file(samples_file(art)).read_text().splitlines()]
    if any(r.get("prompt") and "prompt_ids" not in r for r in rows):
        return None
    for i, r in enumerate(rows):
        stopped = r["n_tokens"] < art.config["max_new_tokens"]
        totals[int(data_mod.is_validation(i, data.val_fraction, data.seed))] += (
            len(r.get("prompt_ids", [0])) - 1 + r["n_tokens"] + stopped
        )
    return totals[0] // body, totals[1] // body


def check_generated(data, store: ArtifactStore) -> None:
    """Before any model loads: a mix's generate: source that holds fewer sequences of a split than the
    mix asks of it (the same rule and line as packing, data.pack)."""
    wanted = data_mod.wanted_counts(data)
    if wanted[0] is None or len(data.sources) == 1:
        return
    asks = [data_mod.allot(w, data.shares) for w in wanted]
    for i, spec in enumerate(data.sources):
        if not data_mod.is_generated(spec):
            continue
        art = store.resolve(spec.removeprefix(data_mod.GENERATED), "generate")
        have = given_sequences(art, data) if art.complete else None
        for which in (0, 1) if have else ():
            if have[which] < asks[which][i]:
                raise DihalError(
                    f"dataset '{spec}' gives {have[which]} {data_mod.SPLIT_NAMES[which]} sequences but the mix asks "
                    f"{asks[which][i]} of it; lower --max-sequences or its share (--mix, --own-text)"
                )


def plan(cfg: ExtractConfig, *, dry_run: bool = False) -> Plan:
    """Everything a real run checks before loading weights; the dry run is exactly this, but for data it
    would need the network for while offline (HF_HUB_OFFLINE=1), as for a hub model not yet cached."""
    data_mod.check(cfg.data, reach=not (dry_run and hub.offline()))
    try:
        config, identity = model_config(cfg.model, cfg.trust_remote_code)
    except DihalError:
        if locate(cfg.model)[1]["source"] != "hub":
            raise
        # a hub model not cached here: flags checked, the layer range waits for the real run
        return Plan([], 0, 0, cfg.data.max_sequences, None, {"name": cfg.model, "source": "hub (config not cached)"})
    num_blocks = config.num_hidden_layers
    layers = parse_layers(cfg.layers, num_blocks, none_ok=True)
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos and cfg.data.seq_len > max_pos:
        raise DihalError(
            f"--seq-len {cfg.data.seq_len} exceeds the model's context of {max_pos} tokens; use a smaller --seq-len"
        )
    n = cfg.data.max_sequences
    est = disk_estimate(cfg, n, config.hidden_size, layers) if n else None
    return Plan(layers, num_blocks, config.hidden_size, n, est, identity)


def check_planned(data, *, validation: int = 1, tokens: int | None = None, why: str = "", fix: str = "") -> None:
    """What an extract of `data` will hold is known before it is made (at most --max-sequences, split by
    the rule): a stage that will read it fails now, not after the extraction, when it will not find
    `validation` held-out sequences or `tokens` train positions (positions 1..seq_len-1)."""
    train, val = data_mod.wanted_counts(data)
    if train is None:  # every sequence of the corpus: known only once read
        return
    if val < validation:
        raise DihalError(
            f"{why}: --max-sequences {data.max_sequences} at --val-fraction {data.val_fraction:g} holds {val} "
            f"held-out sequences and {validation} are needed; raise --max-sequences or --val-fraction{fix}"
        )
    if tokens is not None and tokens > train * (data.seq_len - 1):
        raise DihalError(
            f"--tokens {tokens} asked for, but --max-sequences {data.max_sequences} gives at most "
            f"{train * (data.seq_len - 1)} train positions; lower --tokens or extract more sequences"
        )


def disk_estimate(cfg: ExtractConfig, n_seq: int, width: int, layers: list[int]) -> int:
    """hidden_states.estimate_bytes for this extract (auto counted as float16, what it picks when the
    layers' positions >= 1 fit); under --keep pool the layers held whole (layer 0, if extracted) come first."""
    dtypes = ["float32" if cfg.store_dtype == "float32" else "float16"] * len(layers)
    d = cfg.data
    whole = whole_layers(cfg, layers)
    held = None if whole is None else len(whole)
    return hs.estimate_bytes(n_seq, d.seq_len, width, dtypes, cfg.batch_size, cfg.score_pool, d.val_fraction, held)


def check_float16(layer: int, values: torch.Tensor, chosen: str) -> None:
    """values: positions >= 1 (position 0 is kept apart in float32)."""
    peak = float(values.abs().max())
    if not np.isfinite(peak) or peak > FLOAT16_MAX:
        why = " (auto chose float16 from the first batch)" if chosen == "auto" else ""
        raise DihalError(
            f"layer {layer} holds values up to {peak:.3g}, beyond float16's range{why}; "
            "rerun with --store-dtype float32"
        )


def check_finite(states: dict[int, torch.Tensor], loaded: LoadedModel) -> dict[int, torch.Tensor]:
    """Every captured layer finite, in any dtype (a float16 backbone stops at its block already,
    stages/lm/models.py guard_float16); nothing non-finite is ever stored."""
    for layer, values in states.items():
        if not torch.isfinite(values).all():
            raise not_finite(layer, loaded.identity["name"], loaded.identity["dtype"])
    return states


MAX_SCALE_EXP = 16  # auto: a float16 layer is stored divided by at most 2^16, else float32


def choose_storage(states: dict[int, torch.Tensor], store_dtype: str) -> tuple[dict[int, str], dict[int, float]]:
    """Per layer (dtype, scale) from the first batch. Asked for float16 or float32: that, unscaled.
    Under auto: float16, divided by the smallest power of two 2^k that brings the first batch's
    positions >= 1 under 65504 / 4 (k = 0 for most layers). A power of two changes only the
    exponent, so the layer keeps float16's 11 significant bits; readers multiply back. float32
    only where no such k <= MAX_SCALE_EXP exists (a non-finite state). Position 0, the start
    token's state, is kept apart in float32 whatever its size."""
    if store_dtype != "auto":
        return {layer: store_dtype for layer in states}, {layer: 1.0 for layer in states}
    dtypes, scales = {}, {}
    for layer, v in states.items():
        peak = float(v[:, 1:].abs().max()) * AUTO_HEADROOM
        k = max(0, math.ceil(math.log2(peak / FLOAT16_MAX))) if np.isfinite(peak) and peak > 0 else 0
        fits = np.isfinite(peak) and k <= MAX_SCALE_EXP
        dtypes[layer], scales[layer] = ("float16", float(2**k)) if fits else ("float32", 1.0)
    return dtypes, scales


def run(
    cfg: ExtractConfig,
    store: ArtifactStore,
    *,
    force: bool = False,
    check_disk: bool = True,
    progress: Progress | None = None,
    loaded: LoadedModel | None = None,
) -> Artifact:
    """Extract, resuming a partial artifact of the same config; returns the complete artifact. Under
    torchrun every rank loads the model and writes its chunks; rank 0 owns the artifact."""
    progress = progress or NullProgress()
    cfg = resolve_sources(cfg, store)

    def checks() -> None:
        plan(cfg) if loaded is None else data_mod.check(cfg.data)
        check_generated(cfg.data, store)

    def work(art: Artifact) -> None:
        _extract(cfg, store, art, loaded, check_disk, progress)

    hashed = data_mod.hashed_data(cfg.data)  # once: a Dolma spec's shard list is read to hash it
    config, parents, paths = resolved_config(cfg, hashed), source_parents(cfg), hashed[2]  # paths: for the record
    job = Job(
        STAGE,
        CACHE_VERSION,
        config,
        parents,
        work,
        checks,
        seed=cfg.data.seed,
        device=cfg.device,
        extra={"data_paths": paths} if paths else {},
        every_rank=True,
    )
    return store.run_stage(job, force=force, progress=progress, group=dist.group())


def _extract(cfg: ExtractConfig, store, art: Artifact, loaded, check_disk: bool, progress: Progress) -> None:
    rank, world = dist.world()
    loaded = loaded or load_model(cfg.model, cfg.device, cfg.dtype, cfg.revision, cfg.trust_remote_code)
    layers = parse_layers(cfg.layers, loaded.num_blocks, none_ok=True)
    if rank == 0:  # one rank reads the data (a Dolma stream once, not once per GPU) and hands it on
        generated = generated_documents(cfg.data, store, loaded)
        packed = data_mod.pack(cfg.data, loaded.tokenizer, loaded.max_positions, generated)
    packed = dist.from_rank0(packed if rank == 0 else None, world)
    n_seq, seq_len = packed.input_ids.shape[0], cfg.data.seq_len
    zarr_path = art.path / "hidden.zarr"
    if rank == 0:  # rank 0 owns the artifact: its manifest, its group, the disk check
        earlier = art.previous.get("dataset_fingerprint")
        if earlier is not None and earlier != packed.fingerprint:
            raise DihalError(
                f"the data of extract {art.id} changed since it started (fingerprint {earlier[:12]}, now "
                f"{packed.fingerprint[:12]}); restore it, or rerun with --force to extract it anew"
            )
        est = disk_estimate(cfg, n_seq, loaded.width, layers)
        written = dir_size(art.path)
        progress.log(
            f"plan: {n_seq} sequences x {seq_len} tokens, {len(layers)} layers, "
            f"about {est / 2**20:.1f} MiB on disk under {store.root}"
            + (f" ({written / 2**20:.1f} MiB written already)" if written else "")
        )
        free = shutil.disk_usage(store.root).free
        if check_disk and max(est - written, 0) > free:
            raise DihalError(
                f"extraction needs about {_size(max(est - written, 0))} more but {store.root} has {_size(free)} "
                "free; free space, lower --max-sequences or pass --skip-disk-check"
            )
        art.manifest.update(
            model=loaded.identity,
            dataset_fingerprint=packed.fingerprint,
            n_documents=packed.n_documents,
            world_size=world,
            document_end=packed.document_end,
            **({"sources": packed.sources} if packed.sources else {}),
            **({"dolma": packed.dolma} if packed.dolma else {}),
        )
        art.manifest["environment"]["device"] = str(loaded.device)
        art.save_manifest()
        if not (zarr_path / "zarr.json").exists():
            first = torch.from_numpy(packed.input_ids[: cfg.batch_size].astype(np.int64)).to(loaded.device)
            dtypes, scales = {}, {}  # --layers none: token ids alone, and no forward pass
            if layers:
                with torch.no_grad(), capture_layers(loaded.model, layers) as captured:
                    first_states = check_finite(run_capture(loaded.model, captured, first), loaded)
                    dtypes, scales = choose_storage(first_states, cfg.store_dtype)
            building = zarr_path.with_name("hidden.zarr.tmp")  # renamed once split and pool are in
            shutil.rmtree(building, ignore_errors=True)
            group = hs.create(
                building,
                layers,
                n_seq,
                seq_len,
                loaded.width,
                dtypes,
                cfg.batch_size,
                {"num_blocks": loaded.num_blocks, "model": loaded.identity["name"], "start_token": packed.start_token},
                scales,
                whole_layers(cfg, layers),
            )
            group["split"][:] = packed.split
            if packed.source is not None:  # a mix: which source each sequence came from
                np.save(art.file("source.npy"), packed.source)
            if cfg.score_pool and layers:
                hs.create_pool(group, layers, loaded.width, dtypes, cfg.score_pool, cfg.data.seed, scales)
            os.replace(building, zarr_path)
    dist.barrier_all(world)
    group = hs.open_for_writing(zarr_path)
    try:
        _extract_chunks(loaded, group, packed.input_ids, layers, cfg, rank, world, progress)
    finally:
        dist.barrier_all(world)
    if rank == 0:
        dtypes, scales = hs.kept_storage(group)
        art.manifest["metrics"] = {
            "n_sequences": int(n_seq),
            "n_train": int((packed.split == 0).sum()),
            "n_validation": int((packed.split == 1).sum()),
            "layers": layers,
            "seq_len": seq_len,
            "width": loaded.width,
            "num_blocks": loaded.num_blocks,
            "store_dtypes": dtypes,
            "store_scales": {k: v for k, v in scales.items() if v != 1.0},
            **({"kept": "layer 0 whole, the others at the score's pool alone"} if cfg.keep == "pool" else {}),
            "start_token": packed.start_token,
        }


def whole_layers(cfg: ExtractConfig, layers: list[int]) -> list[int] | None:
    """The layers held at every position: all (None) but under --keep pool, where only layer 0 is (r2_token and
    r2_context read the positions before each of theirs in it; the rest is read at the pool alone)."""
    return None if cfg.keep == "layers" else [layer for layer in layers if layer == 0]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def resolve_sources(cfg: ExtractConfig, store: ArtifactStore) -> ExtractConfig:
    """cfg with each generate:<ref> (an id prefix, latest) written with the artifact's full id."""
    if not any(data_mod.is_generated(s) for s in cfg.data.sources):
        return cfg
    full = lambda s: data_mod.GENERATED + store.resolve(s.removeprefix(data_mod.GENERATED), "generate").id
    specs = [full(s) if data_mod.is_generated(s) else s for s in cfg.data.sources]
    return replace(cfg, data=replace(cfg.data, dataset=specs[0], also=tuple(specs[1:])))


def source_parents(cfg: ExtractConfig) -> dict:
    """The generate artifacts among the sources (full ids), as parents; none for text sources, so
    an extract of text keeps its id."""
    ids = [s.removeprefix(data_mod.GENERATED) for s in cfg.data.sources if data_mod.is_generated(s)]
    return {("generate" if i == 0 else f"generate_{i + 1}"): g for i, g in enumerate(ids)}


def artifact_id_for(cfg: ExtractConfig) -> str:
    """The id, or, in a dry run offline, what it waits for: a Dolma URL list that is read online."""
    unread = [s for s in cfg.data.sources if dolma.is_dolma(s) and dolma.needs_network(s)]
    if unread and hub.offline():
        return f"? (it hashes the shard list of {unread[0]}, read online)"
    return Job(STAGE, CACHE_VERSION, resolved_config(cfg), source_parents(cfg)).id


def _extract_chunks(
    loaded: LoadedModel,
    group,
    input_ids: np.ndarray,
    layers: list[int],
    cfg: ExtractConfig,
    rank: int,
    world: int,
    progress: Progress,
) -> None:
    seq_len = cfg.data.seq_len
    chunks = hs.chunk_ranges(input_ids.shape[0], cfg.batch_size)
    done = hs.committed_chunks(group)
    dtypes, scales = hs.kept_storage(group)
    whole = set(hs.stored_layers(group))
    mine = [i for i in range(len(chunks)) if i % world == rank and not done[i]]
    total_tokens = sum((chunks[i][1] - chunks[i][0]) * seq_len for i in mine)
    if done.any():
        progress.log(f"resuming: {int(done.sum())} of {len(chunks)} chunks already committed")
    progress.start("extract", total_tokens, "tok")
    device = loaded.device
    # one chunk is written (and committed) on a background thread while the next is computed;
    # progress advances once a chunk is committed
    capture = capture_layers(loaded.model, layers) if layers else contextlib.nullcontext({})
    with torch.no_grad(), capture as captured, ThreadPoolExecutor(1) as writer:
        pending = None
        for index in mine:
            start, stop = chunks[index]
            ids = torch.from_numpy(input_ids[start:stop].astype(np.int64)).to(device)
            mask = torch.ones_like(ids)
            states = check_finite(run_capture(loaded.model, captured, ids, mask), loaded) if layers else {}
            arrays, pool, samples, starts = {}, hs.pool_rows(group, index, start), {}, {}
            for layer in layers:
                values = states[layer].to("cpu", torch.float32).numpy()
                if dtypes[layer] == "float16":  # position 0 goes apart, exact; the rest, scaled, must fit
                    if layer in whole:
                        starts[layer] = values[:, 0].copy()
                    values = values / scales[layer]
                    check_float16(layer, torch.from_numpy(values[:, 1:]), cfg.store_dtype)
                    values[:, 0] = np.clip(values[:, 0], -FLOAT16_MAX, FLOAT16_MAX)
                if pool is not None:  # positions >= 1: as a whole layer's stored values, bit for bit
                    samples[layer] = values[pool[0], pool[1]].astype(dtypes[layer])
                if layer in whole:
                    arrays[layer] = values.astype(dtypes[layer])
            if pending is not None:
                progress.advance(pending.result())
            pending = writer.submit(
                _write,
                group,
                index,
                start,
                arrays,
                input_ids[start:stop],
                mask.cpu().numpy().astype(np.int8),
                samples,
                starts,
                (stop - start) * seq_len,
            )
        if pending is not None:
            progress.advance(pending.result())
    progress.stop()


def _write(group, index, start, arrays, ids, mask, samples, starts, tokens: int) -> int:
    hs.write_chunk(group, index, start, arrays, ids, mask, samples, starts)
    return tokens
