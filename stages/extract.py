"""`dihal extract`: per-layer hidden states -> one chunked Zarr v3 group per artifact.

Work is split into chunks of `batch_size` sequences; each chunk is one forward pass and one
committed write, so an interrupted run resumes at the first uncommitted chunk and ends with
the same bytes as an uninterrupted one. Under torchrun, rank r takes chunks r, r+W, r+2W, ...
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
import shutil
from dataclasses import asdict, dataclass

import numpy as np
import torch

from artifacts import hidden_states as hs
from artifacts.errors import DihalError
from artifacts.store import Artifact, ArtifactStore, artifact_id
from stages.text import data as data_mod
from stages.lm.capture import capture_layers, run_capture
from stages.lm.models import LoadedModel, load_model, locate
from stages.runtime.progress import NullProgress, Progress

STAGE = "extract"
FLOAT16_MAX = 65504.0


@dataclass(frozen=True)
class ExtractConfig:
    model: str = "smollm2-135m"
    revision: str | None = None
    dataset: str = "pydoc"
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    seq_len: int = 64
    val_fraction: float = 0.1
    max_sequences: int | None = None
    layers: str = "all"
    store_dtype: str = "float16"
    batch_size: int = 8
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0

    def data_config(self) -> data_mod.DataConfig:
        return data_mod.DataConfig(self.dataset, self.dataset_config, self.split, self.text_field, self.seq_len,
                                   self.val_fraction, self.max_sequences, self.seed)


def parse_layers(spec: str, num_blocks: int) -> list[int]:
    """'all' | '0-4' | '0,3,7' (mixed allowed: '0,2-4') -> sorted indices in 0..L."""
    if spec == "all":
        return list(range(num_blocks + 1))
    layers: set[int] = set()
    try:
        for part in spec.split(","):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-"))
                layers.update(range(lo, hi + 1))
            else:
                layers.add(int(part))
    except ValueError:
        raise DihalError(f"cannot read --layers '{spec}'; use all, a range like 0-4, or a list like 0,3,7") from None
    bad = sorted(x for x in layers if not 0 <= x <= num_blocks)
    if bad or not layers:
        raise DihalError(f"layer {bad[0] if bad else spec} is out of range: this model has layers 0..{num_blocks} "
                         f"({num_blocks} blocks)")
    return sorted(layers)


def resolved_config(cfg: ExtractConfig) -> dict:
    """What the artifact id hashes: the flags plus what makes the inputs unique."""
    resolved = asdict(cfg)
    if cfg.dataset == "pydoc":
        resolved["pydoc_python"] = data_mod.python_version_tag()
    return resolved


def model_config(spec: str):
    """The backbone's config only (no weights), for validation and dry runs."""
    from transformers import AutoConfig

    where, identity = locate(spec)
    if identity["source"] == "hub":
        try:
            return AutoConfig.from_pretrained(where, local_files_only=True), identity
        except OSError:
            load_model(spec)  # raises the offline message or downloads
    return AutoConfig.from_pretrained(str(where)), identity


@dataclass
class Plan:
    layers: list[int]
    num_blocks: int
    width: int
    n_sequences: int | None
    bytes_estimate: int | None
    identity: dict


def plan(cfg: ExtractConfig) -> Plan:
    if cfg.store_dtype not in ("float16", "float32"):
        raise DihalError("--store-dtype must be float16 or float32")
    if cfg.batch_size < 1:
        raise DihalError("--batch-size must be at least 1")
    try:
        config, identity = model_config(cfg.model)
    except DihalError:
        if locate(cfg.model)[1]["source"] != "hub":
            raise
        # offline dry run of a hub model: flags checked, the layer range waits for the real run
        return Plan([], 0, 0, cfg.max_sequences, None, {"name": cfg.model, "source": "hub (offline: config not checked)"})
    num_blocks = config.num_hidden_layers
    layers = parse_layers(cfg.layers, num_blocks)
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos and cfg.seq_len > max_pos:
        raise DihalError(f"--seq-len {cfg.seq_len} exceeds the model's context of {max_pos} tokens; use a smaller --seq-len")
    if cfg.dataset != "pydoc" and data_mod.is_local_spec(cfg.dataset) and not data_mod._local_files(cfg.dataset):
        raise DihalError(f"dataset file '{cfg.dataset}' does not exist; check the path")
    n = cfg.max_sequences
    est = estimate_bytes(n, cfg.seq_len, config.hidden_size, len(layers), cfg.store_dtype) if n else None
    return Plan(layers, num_blocks, config.hidden_size, n, est, identity)


def estimate_bytes(n_seq: int, seq_len: int, width: int, n_layers: int, store_dtype: str) -> int:
    itemsize = 2 if store_dtype == "float16" else 4
    return n_seq * seq_len * (width * n_layers * itemsize + 5)


def _dist_info() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _rank_device(device: str, rank: int) -> str:
    if device.startswith("cuda") and ":" not in device and _dist_info()[1] > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    return device


def check_float16(layer: int, values: torch.Tensor) -> None:
    peak = float(values.abs().max())
    if not np.isfinite(peak) or peak > FLOAT16_MAX:
        raise DihalError(f"layer {layer} holds values up to {peak:.3g}, beyond float16's range; "
                         "rerun with --store-dtype float32")


def run(cfg: ExtractConfig, store: ArtifactStore, *, force: bool = False, check_disk: bool = True,
        progress: Progress | None = None, loaded: LoadedModel | None = None) -> Artifact:
    """Extract, resuming a partial artifact of the same config; returns the complete artifact."""
    progress = progress or NullProgress()
    config = resolved_config(cfg)
    if cached := store.cached(STAGE, config, {}, force=force):
        return cached
    rank, world = _dist_info()
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    loaded = loaded or load_model(cfg.model, _rank_device(cfg.device, rank), cfg.dtype, cfg.revision)
    layers = parse_layers(cfg.layers, loaded.num_blocks)
    packed = data_mod.pack(cfg.data_config(), loaded.tokenizer, loaded.max_positions)
    n_seq = packed.input_ids.shape[0]
    est = estimate_bytes(n_seq, cfg.seq_len, loaded.width, len(layers), cfg.store_dtype)
    progress.log(f"plan: {n_seq} sequences x {cfg.seq_len} tokens, {len(layers)} layers, "
                 f"about {est / 2**20:.1f} MiB on disk under {store.root}")
    if check_disk and not force:
        store.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(store.root).free
        if est > free:
            raise DihalError(f"extraction needs about {est / 2**30:.2f} GiB but {store.root} has {free / 2**30:.2f} GiB free; "
                             "lower --max-sequences or pass --force")
    art_id = artifact_id(STAGE, config, {})
    zarr_path = store.root / STAGE / art_id / "hidden.zarr"
    with contextlib.ExitStack() as held:
        if rank == 0:  # rank 0 owns the artifact (and its lock) for the whole extraction
            held.enter_context(store.lock(STAGE, art_id))
            store.begin(STAGE, config, {}, seed=cfg.seed, device=str(loaded.device), force=force,
                        extra={"model": loaded.identity, "dataset_fingerprint": packed.fingerprint,
                               "n_documents": packed.n_documents, "world_size": world})
            group = hs.create(zarr_path, layers, n_seq, cfg.seq_len, loaded.width, cfg.store_dtype, cfg.batch_size,
                              {"num_blocks": loaded.num_blocks, "model": loaded.identity["name"]})
            if not hs.committed_chunks(group).any():
                group["split"][:] = packed.split
        _barrier(world)
        if rank != 0:
            group = hs.open_for_writing(zarr_path)
        try:
            _extract_chunks(loaded, group, packed.input_ids, layers, cfg, rank, world, progress)
        except DihalError as exc:  # committed chunks stay; a rerun resumes after the fix
            if rank == 0:
                store.load(STAGE, art_id).fail(str(exc))
            raise
        _barrier(world)
        art = store.load(STAGE, art_id)
        if rank == 0:
            art.manifest["metrics"] = {
                "n_sequences": int(n_seq), "n_train": int((packed.split == 0).sum()),
                "n_validation": int((packed.split == 1).sum()), "layers": layers, "seq_len": cfg.seq_len,
                "width": loaded.width, "num_blocks": loaded.num_blocks}
            art.finish()
    return art


def artifact_id_for(cfg: ExtractConfig) -> str:
    return artifact_id(STAGE, resolved_config(cfg), {})


def _fault_injection(index: int, mine: list[int]) -> None:
    """Tests kill the process for real after N committed chunks (DIHAL_FAULT_AFTER_CHUNKS)."""
    after = os.environ.get("DIHAL_FAULT_AFTER_CHUNKS")
    if after is not None and mine.index(index) + 1 == int(after):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _extract_chunks(loaded: LoadedModel, group, input_ids: np.ndarray, layers: list[int], cfg: ExtractConfig,
                    rank: int, world: int, progress: Progress) -> None:
    chunks = hs.chunk_ranges(input_ids.shape[0], cfg.batch_size)
    done = hs.committed_chunks(group)
    mine = [i for i in range(len(chunks)) if i % world == rank and not done[i]]
    total_tokens = sum((chunks[i][1] - chunks[i][0]) * cfg.seq_len for i in mine)
    if done.any():
        progress.log(f"resuming: {int(done.sum())} of {len(chunks)} chunks already committed")
    progress.start("extract", total_tokens, "tok")
    device = loaded.device
    # one chunk is written (and committed) on a background thread while the next is computed
    with torch.no_grad(), capture_layers(loaded.model, layers) as captured, ThreadPoolExecutor(1) as writer:
        pending = None
        for index in mine:
            start, stop = chunks[index]
            ids = torch.from_numpy(input_ids[start:stop].astype(np.int64)).to(device)
            mask = torch.ones_like(ids)
            states = run_capture(loaded.model, captured, ids, mask)
            arrays = {}
            for layer in layers:
                values = states[layer]
                if cfg.store_dtype == "float16":
                    check_float16(layer, values)
                arrays[layer] = values.to("cpu", torch.float32).numpy().astype(cfg.store_dtype)
            if pending is not None:
                pending.result()
                _fault_injection(mine[mine.index(index) - 1], mine)
            pending = writer.submit(hs.write_chunk, group, index, start, arrays, input_ids[start:stop],
                                    mask.cpu().numpy().astype(np.int8))
            progress.advance((stop - start) * cfg.seq_len)
        if pending is not None:
            pending.result()
    progress.stop()
