"""Text sources and packing (docs/method.md section 0).

`--dataset` is the builtin `pydoc`, local .txt/.jsonl/.json/.parquet files or globs, or a hub
id (streamed). Documents go to train or validation by a hash of their index (deterministic,
by document); each split is tokenized and packed into sequences of exactly seq_len tokens,
each starting with the start token (BOS; for tokenizers without one, such as Qwen's, the
document separator <|endoftext|>, else EOS), documents joined by EOS.

Local data is checked whole before any work starts (`check`): a missing, empty, malformed or
undecodable file, a record whose text is not a string, or no text at all is one `error:` line.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import inspect
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dihal.artifacts.errors import DihalError
from dihal.stages.configs import DataConfig

# stdlib modules whose docstrings join pydoc_data.topics in the builtin corpus, in this order
PYDOC_MODULES = (
    "abc argparse array ast asyncio base64 bisect calendar collections contextlib copy csv dataclasses "
    "datetime decimal difflib enum fractions functools glob gzip hashlib heapq hmac html http.client "
    "inspect io ipaddress itertools json logging math operator os pathlib pickle pprint queue random re "
    "sched secrets shlex shutil socket sqlite3 statistics string struct subprocess tarfile tempfile "
    "textwrap threading time timeit tokenize traceback types typing unittest urllib.parse uuid warnings "
    "weakref zipfile zlib"
).split()
LOCAL_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
GENERATED = "generate:"
SPLIT_NAMES = ("training", "validation")


def pydoc_documents() -> Iterator[str]:
    """English prose shipped with CPython: help topics, then stdlib docstrings, fixed order."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]
    for name in PYDOC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if module.__doc__:
            yield inspect.cleandoc(module.__doc__)
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield from _long_docs([obj] + _methods(obj))


def _methods(cls) -> list:
    if not inspect.isclass(cls):
        return []
    return [
        member for name, member in sorted(vars(cls).items()) if not name.startswith("_") and inspect.isfunction(member)
    ]


def _long_docs(objects: list) -> Iterator[str]:
    for obj in objects:
        doc = inspect.getdoc(obj)
        if doc and len(doc) > 200:
            yield doc


def _local_files(spec: str) -> list[Path]:
    paths = sorted(Path(p) for p in glob.glob(spec)) if any(c in spec for c in "*?[") else [Path(spec)]
    return [p for p in paths if p.is_file()]


def is_local_spec(spec: str) -> bool:
    return Path(spec).suffix in LOCAL_SUFFIXES or any(c in spec for c in "*?[") or Path(spec).exists()


def _open_local(spec: str, text_field: str):
    """The local files as one datasets.Dataset and the name of their text field, or a one-line error."""
    files = _local_files(spec)
    if not files:
        raise DihalError(
            f"dataset file '{spec}' does not exist; give an existing .txt/.jsonl/.json/.parquet path or glob"
        )
    suffixes = {p.suffix for p in files}
    if len(suffixes) != 1 or next(iter(suffixes)) not in LOCAL_SUFFIXES:
        raise DihalError(f"dataset '{spec}' must match files of one kind: {', '.join(LOCAL_SUFFIXES)}")
    empty = [p for p in files if p.stat().st_size == 0]
    if empty:
        raise DihalError(f"dataset file '{empty[0]}' is empty; give a file with text in it")
    builder = LOCAL_SUFFIXES[files[0].suffix]
    if builder == "text":
        for path in files:  # datasets would only say "an error occurred"; name the file and the byte
            try:
                path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DihalError(
                    f"dataset file '{path}' is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                    f"offset {exc.start}); re-encode it as UTF-8"
                ) from None
    import logging

    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)  # its parse failures come back as our one line
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        dataset = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", **kwargs)
    except Exception as exc:  # noqa: BLE001 - datasets wraps every parse failure; report the parser's words
        cause = exc
        while isinstance(cause, datasets.exceptions.DatasetsError) and (cause.__cause__ or cause.__context__):
            cause = cause.__cause__ or cause.__context__
        reason = (str(cause).splitlines() or [type(cause).__name__])[0][:200]
        raise DihalError(f"cannot read dataset '{spec}' as {builder} ({reason}); fix the file") from None
    field = "text" if builder == "text" else text_field
    if field not in dataset.column_names:
        raise DihalError(
            f"dataset '{spec}' has no text field '{field}' (fields: {', '.join(dataset.column_names)}); "
            "name the right one with --text-field"
        )
    return dataset, field


def one_source(cfg: DataConfig, spec: str) -> DataConfig:
    """cfg with `spec` as its only dataset (what one source of a mix is read with)."""
    return replace(cfg, dataset=spec, also=(), mix=())


def is_generated(spec: str) -> bool:
    """generate:<ID>: the token ids of a generate artifact's samples (the extract stage reads them)."""
    return spec.startswith(GENERATED)


_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256, for this process


def content_digests(cfg: DataConfig) -> dict[str, str]:
    """{spec: sha256 over the names and bytes of its files} for every local source: what an extract id
    hashes, so an edited file makes another id (a file's size and mtime only skip re-reading it in
    one process; its content decides)."""
    from dihal.artifacts.store import file_sha256

    out = {}
    for spec in cfg.sources:
        if spec == "pydoc" or is_generated(spec) or not is_local_spec(spec):
            continue
        digest, found = hashlib.sha256(), _local_files(spec)
        if not found:  # check() says so in one line
            continue
        for path in found:
            st = path.stat()
            key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
            if key not in _DIGESTS:
                _DIGESTS[key] = file_sha256(path)
            digest.update(f"{path.name}\0{_DIGESTS[key]}\n".encode())
        out[spec] = digest.hexdigest()
    return out


def check(cfg: DataConfig) -> None:
    """Local data: every record's text is a string and at least one is non-empty. Builtins, hub
    streams and generate artifacts are checked as they are read."""
    for spec in cfg.sources:
        if spec == "pydoc" or is_generated(spec) or not is_local_spec(spec):
            continue
        dataset, field = _open_local(spec, cfg.text_field)
        non_empty = 0
        for index, value in enumerate(dataset[field]):
            if not isinstance(value, str):
                what = "no" if value is None else f"a {type(value).__name__} in"
                raise DihalError(
                    f"record {index} of dataset '{spec}' has {what} field '{field}', not a string; "
                    "fix the record or name another field with --text-field"
                )
            non_empty += bool(value.strip())
        if not non_empty:
            raise DihalError(f"dataset '{spec}' holds no non-empty text in field '{field}'; give text to extract")


def local_documents(spec: str, text_field: str) -> Iterator[str]:
    dataset, field = _open_local(spec, text_field)
    for row in dataset:
        if row[field]:
            yield row[field]


def hub_documents(cfg: DataConfig) -> Iterator[str]:
    import datasets

    try:
        stream = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split, streaming=True)
        first = next(iter(stream))
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, gated: all one message for the user
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise DihalError(
            f"cannot stream dataset '{cfg.dataset}' from the hub ({reason}); offline use needs the builtin 'pydoc' "
            "or local .txt/.jsonl/.parquet files"
        ) from None
    if cfg.text_field not in first:
        raise DihalError(
            f"dataset '{cfg.dataset}' has no text field '{cfg.text_field}' "
            f"(fields: {', '.join(first)}); name the right one with --text-field"
        )
    for index, row in enumerate(stream):
        value = row[cfg.text_field]
        if value is not None and not isinstance(value, str):
            raise DihalError(
                f"record {index} of dataset '{cfg.dataset}' has a {type(value).__name__} in field "
                f"'{cfg.text_field}', not a string; name another field with --text-field"
            )
        if value:
            yield value


def documents(cfg: DataConfig) -> Iterator[str]:
    """The texts of cfg's (one) dataset."""
    if is_generated(cfg.dataset):
        raise DihalError(f"dataset '{cfg.dataset}' holds token ids, not text; only `dihal extract` reads it")
    if cfg.dataset == "pydoc":
        return pydoc_documents()
    if is_local_spec(cfg.dataset):
        return local_documents(cfg.dataset, cfg.text_field)
    if cfg.dataset.count("/") > 1 or cfg.dataset.startswith((".", "/")):
        raise DihalError(f"dataset file '{cfg.dataset}' does not exist; check the path")
    return hub_documents(cfg)


def is_validation(doc_index: int, val_fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{doc_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


@dataclass
class PackedData:
    input_ids: np.ndarray  # (n_seq, seq_len) int32
    split: np.ndarray  # (n_seq,) int8, 0 train / 1 validation
    fingerprint: str
    n_documents: int
    n_tokens: int
    start_token: dict  # {"id": ..., "token": ..., "kind": "bos" | "<|endoftext|>" | "eos"}
    source: np.ndarray | None = None  # (n_seq,) int8: which of cfg.sources each sequence is from
    sources: list[dict] | None = None  # per source: spec, share, train and validation sequences


def start_token(tokenizer) -> tuple[int, str]:
    """(id, which) of the token every sequence starts with: BOS, else the document separator
    <|endoftext|> (Qwen2/Qwen3 have no BOS), else EOS."""
    if tokenizer.bos_token_id is not None:
        return int(tokenizer.bos_token_id), "bos"
    separator = tokenizer.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tokenizer.get_vocab() else None
    if separator is not None:
        return int(separator), "<|endoftext|>"
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id), "eos"
    raise DihalError(
        "the tokenizer has no BOS, no <|endoftext|> and no EOS token to start sequences with; "
        "use a tokenizer that has one"
    )


class _Packer:
    def __init__(self, seq_len: int, bos: int):
        self.body = seq_len - 1
        self.bos = bos
        self.buffer: list[int] = []
        self.sequences: list[list[int]] = []

    def add(self, ids: list[int]) -> None:
        self.buffer.extend(ids)
        while len(self.buffer) >= self.body:
            head, self.buffer = self.buffer[: self.body], self.buffer[self.body :]
            self.sequences.append([self.bos] + head)


def allot(total: int, shares: tuple[float, ...]) -> list[int]:
    """total split by shares, largest remainder first (the counts sum to total)."""
    exact = [total * s for s in shares]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(shares)), key=lambda i: counts[i] - exact[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


def wanted_counts(cfg: DataConfig) -> tuple[int | None, int | None]:
    """(train, validation) sequences --max-sequences asks for, or (None, None) for all."""
    if cfg.max_sequences is None:
        return None, None
    n_val = round(cfg.max_sequences * cfg.val_fraction) if cfg.val_fraction > 0 else 0
    if cfg.val_fraction > 0 and cfg.max_sequences > 1:
        n_val = max(1, n_val)
    return cfg.max_sequences - n_val, n_val


def _pack_source(cfg: DataConfig, docs, ids_of, bos: int, wanted: tuple, digest) -> tuple[list, list, int, int]:
    """(train, validation, documents, tokens) of one source, each split packed into seq_len
    sequences after the start token; a document is tokenized (ids_of) and hashed into digest only
    when its split takes it, and reading stops once `wanted` are filled."""
    packers = {0: _Packer(cfg.seq_len, bos), 1: _Packer(cfg.seq_len, bos)}
    n_docs = n_tokens = 0
    for doc_index, doc in enumerate(docs):
        which = 1 if is_validation(doc_index, cfg.val_fraction, cfg.seed) else 0
        if wanted[which] is not None and len(packers[which].sequences) >= wanted[which]:
            if all(len(packers[s].sequences) >= wanted[s] for s in (0, 1)):
                break
            continue
        ids, raw = ids_of(doc)
        packers[which].add(ids)
        digest.update(raw)
        n_docs, n_tokens = n_docs + 1, n_tokens + len(ids)
    train, val = packers[0].sequences, packers[1].sequences
    if wanted[0] is not None:
        train, val = train[: wanted[0]], val[: wanted[1]]
    return train, val, n_docs, n_tokens


def pack(
    cfg: DataConfig, tokenizer, max_positions: int | None = None, generated: dict[str, list[list[int]]] | None = None
) -> PackedData:
    """Tokenize and pack documents (each source's own, its splits by document); stops early once
    max_sequences are filled. `generated`: the documents (token ids, as written) of each generate:
    source. With a mix, each split takes each source's share of its sequences (the first ones of
    each source), in an order shuffled by cfg.seed."""
    if max_positions and cfg.seq_len > max_positions:
        raise DihalError(
            f"--seq-len {cfg.seq_len} exceeds the model's context of {max_positions} tokens; use a smaller --seq-len"
        )
    (bos, start_kind), eos = start_token(tokenizer), tokenizer.eos_token_id

    def text_ids(text: str) -> tuple[list[int], bytes]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids + ([eos] if eos is not None else []), text.encode()

    def given_ids(ids: list[int]) -> tuple[list[int], bytes]:
        return list(ids), np.asarray(ids, dtype=np.int64).tobytes()

    wanted = wanted_counts(cfg)
    per_split = [allot(w, cfg.shares) if w is not None else [None] * len(cfg.shares) for w in wanted]
    digest, packed = hashlib.sha256(), []
    for i, spec in enumerate(cfg.sources):
        docs, ids_of = (
            ((generated or {})[spec], given_ids) if is_generated(spec) else (documents(one_source(cfg, spec)), text_ids)
        )
        train, val, n_docs, n_tokens = _pack_source(cfg, docs, ids_of, bos, (per_split[0][i], per_split[1][i]), digest)
        if not train:
            raise DihalError(
                f"dataset '{spec}' gave no full training sequence of {cfg.seq_len} tokens; "
                "use more text or a smaller --seq-len"
            )
        packed.append((train, val, n_docs, n_tokens))
    start = {"id": bos, "token": tokenizer.convert_ids_to_tokens(bos), "kind": start_kind}
    if len(packed) == 1:
        train, val, n_docs, n_tokens = packed[0]
        ids = np.asarray(train + val, dtype=np.int32).reshape(-1, cfg.seq_len)
        split = np.asarray([0] * len(train) + [1] * len(val), dtype=np.int8)
        return PackedData(ids, split, digest.hexdigest()[:16], n_docs, n_tokens, start)
    rows, splits, origin = [], [], []
    for which in (0, 1):
        have = [len(p[which]) for p in packed]
        if wanted[which] is not None:
            counts = per_split[which]
            short = next((i for i, (h, c) in enumerate(zip(have, counts)) if h < c), None)
            if short is not None:
                raise DihalError(
                    f"dataset '{cfg.sources[short]}' gives {have[short]} {SPLIT_NAMES[which]} sequences but the mix "
                    f"asks {counts[short]} of it; lower --max-sequences or its share (--mix, --own-text)"
                )
        else:  # as many as the scarcest source allows at its share
            counts = allot(min(math.floor(h / s + 1e-9) for h, s in zip(have, cfg.shares)), cfg.shares)
        chosen = [(i, seq) for i, p in enumerate(packed) for seq in p[which][: counts[i]]]
        order = np.random.default_rng([cfg.seed, which]).permutation(len(chosen))
        rows += [chosen[k][1] for k in order]
        origin += [chosen[k][0] for k in order]
        splits += [which] * len(chosen)
        per_split[which] = counts
    sources = [
        {"dataset": spec, "share": share, "train": per_split[0][i], "validation": per_split[1][i]}
        for i, (spec, share) in enumerate(zip(cfg.sources, cfg.shares))
    ]
    return PackedData(
        np.asarray(rows, dtype=np.int32).reshape(-1, cfg.seq_len),
        np.asarray(splits, dtype=np.int8),
        digest.hexdigest()[:16],
        sum(p[2] for p in packed),
        sum(p[3] for p in packed),
        start,
        np.asarray(origin, dtype=np.int8),
        sources,
    )


def python_version_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"
