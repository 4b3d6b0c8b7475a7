"""Hidden states on disk: one Zarr v3 group per extract artifact (`<artifact>/hidden.zarr`).

    layers/<l>       (n_seq, seq_len, D) float16|float32 (chosen per layer), chunked by blocks of sequences
                     a float16 layer whose states reach float16's range is stored divided by a power
                     of two (array attribute `scale`, 2^k; exponent only, so float16's precision is
                     kept) and every reader multiplies back, so auto needs float32 almost never
    pos0/<l>         (n_seq, D) float32       position 0 (the start token, the attention sink) of a float16
                                              layer, kept exactly: its state can exceed float16's range
                                              (24,926 in smollm2-135m) where every other position fits.
                                              Every reader below puts it back, so a float16 layer reads as
                                              float32 with position 0 unchanged. Extracts made before
                                              pos0 existed have none and read as stored.
    input_ids        (n_seq, seq_len) int32
    attention_mask   (n_seq, seq_len) int8
    split            (n_seq,) int8        0 = train, 1 = validation
    committed        (n_chunks,) bool     one file per chunk: set after the chunk's data is written
    sample/<l>       (n_chunks, K, D)     the score's position pool: the states at sample_seq/sample_pos,
    sample_seq/_pos  (n_chunks, K) int32  K positions per chunk (-1 pads), one Zarr chunk per extract chunk

An extract of --keep pool holds layers/0 (and pos0/0) alone of the layers and every other layer only in
sample/<l>, whose array then carries the layer's `scale` (attribute `kept: pool`); `stored_layers` are the
layers held whole, `pooled_layers` those in the pool.

The pool makes scoring read O(pool x D) per layer instead of the whole layer: a train-split
position p >= 1 of chunk i is in it with probability quota_i / valid_i, quotas proportional to
each chunk's valid positions (so every position has the same chance, up to rounding).

Group attributes carry the layer convention (METHOD §0) and the chunk size.
A chunk whose `committed` flag is set is complete; resume skips it.

Reading a complete extract goes through `open_group(artifact)`: every chunk file is checked against
the sha256 the manifest recorded for it before its bytes are used (once per process, so a training
run hashes a chunk once, not once per epoch), and a recorded chunk that is missing is an error,
never the array's fill value.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zarr
from zarr.core.buffer.cpu import NDBuffer
from zarr.storage import LocalStore, WrapperStore

from dihal.artifacts import store as store_mod
from dihal.artifacts.errors import DihalError

LAYER_CONVENTION = (
    "layers/<l> is the residual stream after l blocks, before the final norm: "
    "l=0 is the input to block 1 (scaled token embeddings), l=L the pre-norm output of the last block"
)
SPLITS = {"train": 0, "validation": 1}


def create(
    path: Path,
    layers: list[int],
    n_seq: int,
    seq_len: int,
    width: int,
    dtypes: dict[int, str],
    chunk_seqs: int,
    attrs: dict,
    scales: dict[int, float] | None = None,
    whole: list[int] | None = None,
) -> zarr.Group:
    """Create the group (or reopen it unchanged when it already exists, for resume). `whole`: the layers
    held at every position (None: all of them; the others go to the score's pool alone, create_pool)."""
    if (path / "zarr.json").exists():
        return zarr.open_group(str(path), mode="r+")
    group = zarr.open_group(str(path), mode="w")
    group.require_group("layers")  # empty in an extract of token ids alone (--layers none)
    for layer in layers if whole is None else whole:  # uncompressed: float16 shrinks ~10% under zstd, 2x the time
        group.create_array(
            f"layers/{layer}",
            shape=(n_seq, seq_len, width),
            chunks=(chunk_seqs, seq_len, width),
            dtype=dtypes[layer],
            fill_value=0,
            compressors=None,
        )
        if (scales or {}).get(layer, 1.0) != 1.0:
            group[f"layers/{layer}"].attrs["scale"] = scales[layer]
        if dtypes[layer] == "float16":
            group.create_array(
                f"pos0/{layer}", shape=(n_seq, width), chunks=(chunk_seqs, width), dtype="float32", compressors=None
            )
    group.create_array("input_ids", shape=(n_seq, seq_len), chunks=(chunk_seqs, seq_len), dtype="int32", fill_value=0)
    group.create_array(
        "attention_mask", shape=(n_seq, seq_len), chunks=(chunk_seqs, seq_len), dtype="int8", fill_value=0
    )
    group.create_array("split", shape=(n_seq,), chunks=(max(n_seq, 1),), dtype="int8", fill_value=0)
    n_chunks = -(-n_seq // chunk_seqs)
    group.create_array("committed", shape=(n_chunks,), chunks=(1,), dtype="bool", fill_value=False)
    group.attrs.update({"layer_convention": LAYER_CONVENTION, "layers": layers, "chunk_seqs": chunk_seqs, **attrs})
    if whole is not None:
        group.attrs["kept"] = "pool"
    return group


ITEMSIZE = {"float16": 2, "float32": 4}


def estimate_bytes(
    n_seq: int,
    seq_len: int,
    width: int,
    dtypes: list[str],
    chunk_seqs: int,
    pool: int,
    val_fraction: float,
    whole: int | None = None,
) -> int:
    """What an extract of these settings writes (the layers, their position-0 arrays, ids, mask and the
    score's pool), the one estimate that `dihal extract`'s plan, its disk check and
    scripts/estimate.py use. Under --store-dtype auto pass float16 for every layer (what auto picks
    unless a layer's positions >= 1 come near float16's range). whole: how many of the layers (the first)
    are held at every position (None: all; --keep pool: layer 0's one, the rest in the pool alone)."""
    held = dtypes if whole is None else dtypes[:whole]
    per_seq = sum(seq_len * width * ITEMSIZE[d] + (width * 4 if d == "float16" else 0) for d in held)
    per_seq += seq_len * (4 + 1) + 1  # input_ids int32, attention_mask int8, split int8
    n_chunks = -(-n_seq // chunk_seqs)
    train_positions = n_seq * (1 - val_fraction) * (seq_len - 1)
    # create_pool: quotas proportional to each chunk's train positions, padded to the fullest chunk's
    # (one of train sequences only), plus the positions' (sequence, position) int32 pairs
    per_chunk = min(pool, train_positions) / max(n_chunks, 1) / max(1 - val_fraction, 1e-9)
    k = min(int(-(-per_chunk // 1)), chunk_seqs * (seq_len - 1)) if pool and dtypes else 0  # none: no layer
    pool_bytes = n_chunks * k * (width * sum(ITEMSIZE[d] for d in dtypes) + 8)
    return int(n_seq * per_seq + pool_bytes)


def create_pool(
    group: zarr.Group,
    layers: list[int],
    width: int,
    dtypes: dict[int, str],
    pool: int,
    seed: int,
    scales: dict[int, float] | None = None,
) -> None:
    """Choose the score's pool of train positions (>= 1) per extract chunk and create its arrays; a layer
    held in the pool alone (--keep pool) carries its scale on its pool's array."""
    split, n_seq, seq_len = np.asarray(group["split"][:]), *group["input_ids"].shape
    chunk = int(group.attrs["chunk_seqs"])
    ranges = chunk_ranges(n_seq, chunk)
    valid = np.array([int((split[a:b] == SPLITS["train"]).sum()) * (seq_len - 1) for a, b in ranges])
    quota = np.minimum(np.round(pool * valid / max(valid.sum(), 1)).astype(int), valid)
    k = max(int(quota.max(initial=0)), 1)
    seqs, positions = np.full((len(ranges), k), -1, np.int32), np.full((len(ranges), k), -1, np.int32)
    for i, (a, b) in enumerate(ranges):
        train = np.flatnonzero(split[a:b] == SPLITS["train"]) + a
        pick = np.sort(np.random.default_rng([seed, i, 7]).choice(valid[i], size=quota[i], replace=False))
        seqs[i, : quota[i]], positions[i, : quota[i]] = train[pick // (seq_len - 1)], pick % (seq_len - 1) + 1
    group.create_array("sample_seq", data=seqs, chunks=seqs.shape)
    group.create_array("sample_pos", data=positions, chunks=positions.shape)
    for layer in layers:
        group.create_array(
            f"sample/{layer}",
            shape=(len(ranges), k, width),
            chunks=(1, k, width),
            dtype=dtypes[layer],
            fill_value=0,
            compressors=None,
        )
        if layer not in stored_layers(group) and (scales or {}).get(layer, 1.0) != 1.0:
            group[f"sample/{layer}"].attrs["scale"] = scales[layer]
    group.attrs["sample_pool"] = int(quota.sum())


def pool_rows(group: zarr.Group, chunk_index: int, start: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(sequence offsets within the chunk, positions) of the pool rows of one extract chunk."""
    if "sample_seq" not in group:
        return None
    seqs, positions = np.asarray(group["sample_seq"][chunk_index]), np.asarray(group["sample_pos"][chunk_index])
    keep = seqs >= 0
    return seqs[keep] - start, positions[keep]


def read_pool(group: zarr.Group, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The whole pool of one layer: (sequences, positions, states), padding dropped."""
    seqs, positions = np.asarray(group["sample_seq"][:]), np.asarray(group["sample_pos"][:])
    keep = seqs >= 0
    return seqs[keep], positions[keep], _unscaled(group, layer, np.asarray(group[f"sample/{layer}"][:])[keep])


class VerifiedStore(WrapperStore):
    """A read-only Zarr store over a complete extract's group whose every read is checked against the
    checksums its manifest recorded: altered bytes, a missing recorded chunk and an unrecorded file
    are one-line errors naming `dihal runs verify`."""

    def __init__(self, store: LocalStore, recorded: dict[str, dict], where: str):
        super().__init__(store)
        self._recorded, self._where = recorded, where

    def _with_store(self, store):
        return type(self)(store, self._recorded, self._where)

    def _error(self, key: str, what: str) -> DihalError:
        return DihalError(
            f"{Path(self._store.root) / key} {what} ({self._where}); `dihal runs verify` lists what else is, "
            "rerun the extract with --force to make it anew"
        )

    async def get(self, key, prototype=None, byte_range=None):
        entry = self._recorded.get(key)
        if entry is None:  # never written (a chunk of fill values), unless it is there unrecorded
            found = await self._store.get(key, prototype, byte_range)
            if found is not None:
                raise self._error(key, "is not among the files recorded at completion")
            return None
        path = Path(self._store.root) / key
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise self._error(key, "is missing: a chunk recorded at completion, never read as zeros") from None
        seen = store_mod.file_state(path, st)
        if store_mod._VERIFIED.get(seen) != entry["sha256"]:
            whole = await self._store.get(key, prototype, None)
            data = whole.to_bytes() if whole is not None else b""
            digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())  # hashlib frees the GIL
            if len(data) != entry["bytes"] or digest != entry["sha256"]:
                raise self._error(key, "does not match the checksum recorded at completion (corrupt or edited)")
            store_mod._VERIFIED[seen] = digest
            if byte_range is None:
                return whole
        return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(self, prototype, key_ranges):
        return await asyncio.gather(*(self.get(key, prototype, byte_range) for key, byte_range in key_ranges))


ZARR = "hidden.zarr"


def open_group(extract) -> zarr.Group:
    """An extract artifact's group for reading; of a complete extract, every chunk read is verified
    against its manifest (an extract being written, or one recorded before checksums, reads as stored)."""
    path = extract.path / ZARR
    files = extract.manifest.get("files")
    if not extract.complete or files is None:
        return zarr.open_group(str(path), mode="r")
    prefix = ZARR + "/"
    recorded = {name[len(prefix) :]: entry for name, entry in files.items() if name.startswith(prefix)}
    if "zarr.json" not in recorded:
        raise DihalError(f"extract {extract.id} recorded no {ZARR} at completion; rerun the extract with --force")
    verified = VerifiedStore(LocalStore(path, read_only=True), recorded, f"extract {extract.id}")
    return zarr.open_group(store=verified, mode="r")


def open_for_writing(path: Path) -> zarr.Group:
    return zarr.open_group(str(path), mode="r+")


def chunk_ranges(n_seq: int, chunk_seqs: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_seqs, n_seq)) for s in range(0, n_seq, chunk_seqs)]


def write_chunk(
    group: zarr.Group,
    chunk_index: int,
    start: int,
    states: dict[int, np.ndarray],
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    samples: dict[int, np.ndarray] | None = None,
    starts: dict[int, np.ndarray] | None = None,
) -> None:
    """One chunk's arrays; `starts` holds position 0 of the float16 layers in float32 (pos0/<l>)."""
    stop = start + input_ids.shape[0]
    for layer, values in states.items():
        group[f"layers/{layer}"][start:stop] = values
    for layer, rows in (starts or {}).items():
        group[f"pos0/{layer}"][start:stop] = rows
    for layer, rows in (samples or {}).items():
        group[f"sample/{layer}"][chunk_index, : rows.shape[0]] = rows
    group["input_ids"][start:stop] = input_ids
    group["attention_mask"][start:stop] = attention_mask
    group["committed"][chunk_index] = True  # last: marks the chunk complete


def committed_chunks(group: zarr.Group) -> np.ndarray:
    return np.asarray(group["committed"][:], dtype=bool)


def layer_scales(group: zarr.Group) -> dict[int, float]:
    """Per layer, the power of two its float16 array was divided by (1.0: none)."""
    return {layer: float(group[f"layers/{layer}"].attrs.get("scale", 1.0)) for layer in stored_layers(group)}


def _held(group: zarr.Group, layer: int) -> zarr.Array:
    """The array that carries a layer's dtype and scale: layers/<l>, or sample/<l> of a layer in the pool alone."""
    try:
        return group[f"layers/{layer}"]
    except KeyError:
        return group[f"sample/{layer}"]


def _unscaled(group: zarr.Group, layer: int, stored: np.ndarray) -> np.ndarray:
    """Stored values of a layer (or of its pool) in the layer's own units."""
    scale = float(_held(group, layer).attrs.get("scale", 1.0))
    return stored if scale == 1.0 else stored.astype(np.float32) * np.float32(scale)


def kept_storage(group: zarr.Group) -> tuple[dict[int, str], dict[int, float]]:
    """(dtype, scale) of every layer the extract holds, whole or in the pool alone."""
    layers = sorted(set(stored_layers(group)) | set(pooled_layers(group)))
    arrays = {layer: _held(group, layer) for layer in layers}
    return {k: str(a.dtype) for k, a in arrays.items()}, {
        k: float(a.attrs.get("scale", 1.0)) for k, a in arrays.items()
    }


def layer_dtypes(group: zarr.Group) -> dict[int, str]:
    return {layer: str(group[f"layers/{layer}"].dtype) for layer in stored_layers(group)}


def stored_layers(group: zarr.Group) -> list[int]:
    """The layers held at every position."""
    return sorted(int(k) for k in group["layers"].array_keys())


def pooled_layers(group: zarr.Group) -> list[int]:
    """The layers held at the score's pool of positions (all of an extract's, or none without a pool)."""
    return sorted(int(k) for k in group["sample"].array_keys()) if "sample" in group else []


def pool_only(group: zarr.Group) -> bool:
    """An extract of --keep pool: its layers above 0 are held at the score's pool alone."""
    return group.attrs.get("kept") == "pool"


def open_with_layers(extract, needed, why: str = "") -> zarr.Group:
    """An extract artifact's group, after checking that it holds every layer in `needed`: a missing
    one is an error naming it and the `--layers` that would hold them all."""
    group = open_group(extract)
    stored = stored_layers(group)
    needed = sorted(set(needed))
    if missing := [layer for layer in needed if layer not in stored]:
        if missing[0] in pooled_layers(group) and pool_only(group):
            raise DihalError(
                f"extract {extract.id} holds layer {missing[0]} at the score's pool of positions alone (--keep pool)"
                f"{why}; train with --states model, or extract with --keep layers"
            )
        raise DihalError(
            f"extract {extract.id} lacks layer {missing[0]} (it holds {stored}){why}; "
            f"extract with --layers {','.join(map(str, needed))}"
        )
    return group


def split_indices(group: zarr.Group, split: str) -> np.ndarray:
    return np.flatnonzero(np.asarray(group["split"][:]) == SPLITS[split])


def _pos0(group: zarr.Group, layer: int):
    """The float32 position-0 array of a float16 layer, or None (float32 layers, older extracts)."""
    try:
        return group[f"pos0/{layer}"]
    except KeyError:
        return None


def with_pos0(group: zarr.Group, layer: int, states: np.ndarray, seq_idx: np.ndarray) -> np.ndarray:
    """states (n, seq_len, D) of sequences seq_idx as stored, with position 0 put back exactly
    (float32) where the extract kept it apart."""
    states = _unscaled(group, layer, states)
    rows = pos0_rows(group, layer, seq_idx)
    if rows is None:
        return states
    out = states.astype(np.float32)
    out[:, 0] = rows
    return out


def read_block(group: zarr.Group, layer: int, start: int, stop: int) -> np.ndarray:
    """Sequences start..stop-1 of a layer (position 0 exact)."""
    states = np.asarray(group[f"layers/{layer}"][start:stop])
    return with_pos0(group, layer, states, np.arange(start, stop))


def read_positions(
    group: zarr.Group, layer: int, seq_idx: np.ndarray, pos_idx: np.ndarray, max_bytes: int = 256 << 20
) -> np.ndarray:
    """Hidden states at (seq, pos) pairs: (len(seq_idx), width). Reads only the chunks that hold
    them, as contiguous slices of at most max_bytes (slices read twice as fast as fancy indexing)."""
    array = group[f"layers/{layer}"]
    out = np.empty((len(seq_idx), array.shape[2]), dtype=array.dtype)
    order = np.argsort(seq_idx, kind="stable")
    seqs, positions = np.asarray(seq_idx)[order], np.asarray(pos_idx)[order]
    seq_bytes = array.shape[1] * array.shape[2] * array.dtype.itemsize
    for start, stop in _chunk_runs(seqs, array.chunks[0], array.shape[0], max_bytes // seq_bytes):
        lo, hi = np.searchsorted(seqs, [start, stop])
        out[order[lo:hi]] = array[start:stop][seqs[lo:hi] - start, positions[lo:hi]]
    out = _unscaled(group, layer, out)
    pos0, first = _pos0(group, layer), np.flatnonzero(np.asarray(pos_idx) == 0)
    if pos0 is not None:  # a float16 layer reads as float32, position 0 exact
        out = out.astype(np.float32)
        if first.size:
            out[first] = np.asarray(pos0.oindex[np.asarray(seq_idx)[first]])
    return out


def _chunk_runs(sorted_seqs: np.ndarray, chunk_seqs: int, n_seqs: int, max_seqs: int) -> list[tuple[int, int]]:
    """(start, stop) sequence ranges covering the chunks that hold sorted_seqs: consecutive chunks
    merged, each range at most max(max_seqs, one chunk) sequences."""
    chunks = np.unique(sorted_seqs // chunk_seqs)
    per_run = max(1, max_seqs // chunk_seqs)
    runs = []
    for run in np.split(chunks, np.flatnonzero(np.diff(chunks) != 1) + 1):
        for first in range(0, run.size, per_run):
            piece = run[first : first + per_run]
            runs.append((int(piece[0]) * chunk_seqs, min((int(piece[-1]) + 1) * chunk_seqs, n_seqs)))
    return runs


def contiguous_runs(group: zarr.Group, layer: int, seq_idx: np.ndarray, max_bytes: int) -> list[np.ndarray]:
    """sorted seq_idx split into runs of consecutive sequences of at most max_bytes of one layer each."""
    array = group[f"layers/{layer}"]
    per_run = max(1, max_bytes // (array.shape[1] * array.shape[2] * array.dtype.itemsize))
    seq_idx = np.asarray(seq_idx)
    runs = np.split(seq_idx, np.flatnonzero(np.diff(seq_idx) != 1) + 1) if seq_idx.size else []
    return [run[i : i + per_run] for run in runs for i in range(0, run.size, per_run)]


def read_sequences(group: zarr.Group, layer: int, seq_idx: np.ndarray) -> np.ndarray:
    """Whole sequences of a layer (position 0 exact)."""
    return with_pos0(group, layer, read_stored(group, layer, seq_idx), seq_idx)


READ_THREADS = 4  # chunk runs of one read in flight together (page-cache copies and disk reads overlap)


def read_stored(
    group: zarr.Group, layer: int, seq_idx: np.ndarray, max_bytes: int = 256 << 20, out: np.ndarray | None = None
) -> np.ndarray:
    """Whole sequences of a layer as stored (its dtype, before its scale; position 0 as stored), in the order
    asked. Read as contiguous slices over the runs of chunks that hold them, each at most max_bytes (or one
    chunk): zarr's oindex over the same rows is 5.9x slower at the paper's shape (benchmarks/bench_store_read.py).
    The values are the same bytes either way. out: an array of the result's shape and dtype to read into."""
    array = group[f"layers/{layer}"]
    seq_idx = np.asarray(seq_idx, dtype=np.int64)
    out = np.empty((seq_idx.size, *array.shape[1:]), dtype=array.dtype) if out is None else out
    order = np.argsort(seq_idx, kind="stable")
    seqs = seq_idx[order]
    seq_bytes = array.shape[1] * array.shape[2] * array.dtype.itemsize

    def read(run: tuple[int, int]) -> None:
        start, stop = run
        lo, hi = np.searchsorted(seqs, [start, stop])
        asked = hi - lo == stop - start and (seqs[lo:hi] == np.arange(start, stop)).all()
        if asked and (order[lo:hi] == np.arange(lo, hi)).all():  # the run as asked, in order: read in place
            array.get_basic_selection(slice(start, stop), out=NDBuffer.from_numpy_array(out[lo:hi]))
        else:
            out[order[lo:hi]] = array[start:stop][seqs[lo:hi] - start]

    runs = _chunk_runs(seqs, array.chunks[0], array.shape[0], max_bytes // seq_bytes)
    if len(runs) > 1:  # runs read together, as zarr reads the chunks of one slice (each run writes its own rows)
        with ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(read, runs))
    elif runs:
        read(runs[0])
    return out


def token_ids(group: zarr.Group, seq_idx: np.ndarray) -> np.ndarray:
    """(len(seq_idx), seq_len) token ids of sequences seq_idx, in the order asked."""
    return np.asarray(group["input_ids"].oindex[np.asarray(seq_idx)])


def pos0_rows(group: zarr.Group, layer: int, seq_idx: np.ndarray) -> np.ndarray | None:
    """Position 0 of sequences seq_idx exactly (float32), where the extract kept it apart from a float16 layer."""
    pos0 = _pos0(group, layer)
    return None if pos0 is None else np.asarray(pos0.oindex[np.asarray(seq_idx)])
