"""Text sources and packing (METHOD §0).

`--dataset` is the builtin `pydoc`, local .txt/.jsonl/.json/.parquet files or globs (JSON lines also
gzipped or zstd-compressed, as Dolma's shards are), Dolma as published (`dolma:v1_7`, text/dolma.py),
or a hub id (streamed). Documents go to train or validation by a hash of their index (deterministic,
by document); each split is tokenized and packed into sequences of exactly seq_len tokens,
each starting with the start token (BOS; for tokenizers without one, such as Qwen's, the
document separator <|endoftext|>, else EOS), documents joined by the document end (EOS, or the
pretraining end-of-document token where EOS ends a chat turn: stages/lm/tokens.py).

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from dihal.artifacts.errors import DihalError
from dihal.stages.configs import DataConfig
from dihal.stages.lm.tokens import document_end, start_token
from dihal.stages.text import dolma

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
COMPRESSED = {".gz": None, ".zst": "zstandard"}  # a JSON-lines file may be compressed (module datasets needs)
SCRIPT_ONLY = {"allenai/dolma": "dolma:v1_7"}  # hub datasets that are a loading script; what to pass instead
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


def suffix_of(path: Path | str) -> str:
    """A local file's kind: .txt/.jsonl/.json/.parquet, seen through .gz or .zst for JSON lines."""
    suffixes = Path(path).suffixes
    if len(suffixes) >= 2 and suffixes[-1] in COMPRESSED and suffixes[-2] in (".json", ".jsonl"):
        return suffixes[-2]
    return Path(path).suffix


def is_local_spec(spec: str) -> bool:
    if dolma.is_dolma(spec):
        return False
    return suffix_of(spec) in LOCAL_SUFFIXES or any(c in spec for c in "*?[") or Path(spec).exists()


def _open_local(spec: str, text_field: str):
    """The local files' text field as one datasets.Dataset and its name, or a one-line error. Each file is
    read on its own and only its text field kept, so files whose other fields differ (Dolma's sources'
    `metadata`) read together."""
    files = _local_files(spec)
    if not files and Path(spec).is_dir():
        raise DihalError(f"dataset '{spec}' is a folder; give its files, e.g. '{Path(spec) / '*.jsonl'}'")
    if not files:
        raise DihalError(
            f"dataset file '{spec}' does not exist; give an existing .txt/.jsonl/.json/.parquet path or glob "
            "(JSON lines may be .gz or .zst)"
        )
    kinds = {suffix_of(p) for p in files}
    if len(kinds) != 1 or next(iter(kinds)) not in LOCAL_SUFFIXES:
        raise DihalError(
            f"dataset '{spec}' must match files of one kind: {', '.join(LOCAL_SUFFIXES)} (JSON lines may be .gz or "
            ".zst)"
        )
    empty = [p for p in files if p.stat().st_size == 0]
    if empty:
        raise DihalError(f"dataset file '{empty[0]}' is empty; give a file with text in it")
    for module in {COMPRESSED.get(p.suffix) for p in files} - {None}:
        if importlib.util.find_spec(module) is None:
            raise DihalError(f"dataset '{spec}' has {module}-compressed files; install {module} (pip install {module})")
    builder = LOCAL_SUFFIXES[suffix_of(files[0])]
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
    field = "text" if builder == "text" else text_field
    parts = []
    for path in files:
        try:
            part = datasets.load_dataset(builder, data_files=[str(path)], split="train", **kwargs)
        except Exception as exc:  # noqa: BLE001 - datasets wraps every parse failure; report the parser's words
            cause = exc
            while isinstance(cause, datasets.exceptions.DatasetsError) and (cause.__cause__ or cause.__context__):
                cause = cause.__cause__ or cause.__context__
            reason = (str(cause).splitlines() or [type(cause).__name__])[0][:200]
            where = f"'{spec}'" if len(files) == 1 else f"file '{path}' of '{spec}'"
            raise DihalError(f"cannot read dataset {where} as {builder} ({reason}); fix the file") from None
        if field not in part.column_names:
            raise DihalError(
                f"dataset '{spec if len(files) == 1 else path}' has no text field '{field}' (fields: "
                f"{', '.join(part.column_names)}); name the right one with --text-field"
            )
        parts.append(part.select_columns([field]))
    return (parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)), field


def one_source(cfg: DataConfig, spec: str) -> DataConfig:
    """cfg with `spec` as its only dataset (what one source of a mix is read with)."""
    return replace(cfg, dataset=spec, also=(), mix=())


def is_generated(spec: str) -> bool:
    """generate:<ID>: the token ids of a generate artifact's samples (the extract stage reads them)."""
    return spec.startswith(GENERATED)


def content_digests(cfg: DataConfig) -> dict[str, str]:
    """{spec: sha256 over the names and bytes of its files} for every local source, and for Dolma over the
    chosen shards (a URL by its address, a downloaded shard by its bytes): what an extract id hashes, so an
    edited file makes another id (a file is read once per change of it: stages/runtime/digests.py)."""
    from dihal.stages.lm.models import cache_dir
    from dihal.stages.runtime.digests import file_digest

    out = {}
    for spec in cfg.sources:
        if dolma.is_dolma(spec):
            found = [s.location for s in dolma.shards(spec, cfg.dolma_shards, cfg.seed)]
        elif spec == "pydoc" or is_generated(spec) or not is_local_spec(spec):
            continue
        else:
            found = _local_files(spec)
        if not found:  # check() says so in one line
            continue
        digest = hashlib.sha256()
        for where in found:
            if isinstance(where, str) and where.startswith(("http://", "https://")):
                digest.update(f"{where}\n".encode())
                continue
            path = Path(where)
            digest.update(f"{path.name}\0{file_digest(path, cache_dir())}\n".encode())
        out[spec] = digest.hexdigest()
    return out


def hashed_data(cfg: DataConfig) -> tuple[dict, dict[str, str], dict[str, str]]:
    """(the data config as an id hashes it, {source: sha256} of its local and Dolma sources, {source: the
    absolute path given} of its local ones). A local source is named by what it reads, not by how its path
    was spelled: the path's last part and its files' digest (corpus.txt@1a2b3c4d5e6f), so that ./corpus.txt,
    d/../corpus.txt and /abs/corpus.txt are one extract, and one source to evaluate's unseen-document check.
    A Dolma source keeps its spec: its mix weighs the sources by the whole shard list, not only the chosen
    shards the digest reads."""
    digests = content_digests(cfg)
    names = {s: f"{Path(s).name}@{d[:12]}" for s, d in digests.items() if not dolma.is_dolma(s)}
    data = cfg.hashed()
    data["dataset"] = names.get(cfg.dataset, cfg.dataset)
    if "also" in data:
        data["also"] = [names.get(s, s) for s in cfg.also]
    paths = {name: str(Path(s).expanduser().absolute()) for s, name in names.items()}
    return data, {names.get(s, s): d for s, d in digests.items()}, paths


def hashed_source(cfg: DataConfig) -> tuple[str, dict]:
    """(the name an id gives a one-source data config's dataset, the keys it adds beside it) for a stage that
    reads a source outside an extract (evaluate --dataset, generate --prompts-from, train-prior --data
    corpus:SPEC): a local file by its content as hashed_data names it, with its digest, and pydoc with the
    Python version that wrote it."""
    data, digests, _ = hashed_data(cfg)
    extra = {"data_sha256": digests} if digests else {}
    if cfg.dataset == "pydoc":
        extra["pydoc_python"] = python_version_tag()
    return data["dataset"], extra


def check(cfg: DataConfig, *, reach: bool = True) -> None:
    """Before any model loads. Local data: every record's text is a string and at least one is non-empty.
    Dolma: its shard list reads and the first chosen shard opens with the text field. A hub dataset: it is
    not a loading script, and its stream opens with the text field. reach=False (a dry run offline) leaves
    what needs the network unchecked. pydoc and generate artifacts are checked as they are read."""
    for spec in cfg.sources:
        if spec == "pydoc" or is_generated(spec):
            continue
        if dolma.is_dolma(spec):
            listed = dolma.shard_list(spec) if reach or not dolma.needs_network(spec) else None
            if listed is not None and (reach or not any(loc.startswith("http") for loc in listed)):
                dolma.check(spec, dolma.choose(listed, cfg.dolma_shards, cfg.seed), cfg.text_field)
            continue
        if not is_local_spec(spec):
            if spec in SCRIPT_ONLY or reach:
                hub_stream(one_source(cfg, spec))
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


def hub_stream(cfg: DataConfig):
    """(stream, first record) of a hub dataset, or one line: a loading script (which datasets >= 4 cannot
    run), offline, unknown, gated, or without the text field."""
    if cfg.dataset in SCRIPT_ONLY:
        raise DihalError(
            f"dataset '{cfg.dataset}' is a loading script on the hub, which datasets 4 and later cannot run; "
            f"pass --dataset {SCRIPT_ONLY[cfg.dataset]} (its shards as published) or downloaded shards"
        )
    import datasets

    try:
        stream = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split, streaming=True)
        first = next(iter(stream))
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, gated: all one message for the user
        reason = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        if "scripts are no longer supported" in reason:
            raise DihalError(
                f"dataset '{cfg.dataset}' is a loading script on the hub, which datasets 4 and later cannot run; "
                "pass its data files (local files, or a dolma: source for Dolma)"
            ) from None
        raise DihalError(
            f"cannot stream dataset '{cfg.dataset}' from the hub ({reason}); offline use needs the builtin 'pydoc' "
            "or local .txt/.jsonl/.parquet files"
        ) from None
    if cfg.text_field not in first:
        raise DihalError(
            f"dataset '{cfg.dataset}' has no text field '{cfg.text_field}' "
            f"(fields: {', '.join(first)}); name the right one with --text-field"
        )
    return stream, first


def hub_documents(cfg: DataConfig) -> Iterator[str]:
    stream, _ = hub_stream(cfg)
    for index, row in enumerate(stream):
        value = row[cfg.text_field]
        if value is not None and not isinstance(value, str):
            raise DihalError(
                f"record {index} of dataset '{cfg.dataset}' has a {type(value).__name__} in field "
                f"'{cfg.text_field}', not a string; name another field with --text-field"
            )
        if value:
            yield value


def documents(cfg: DataConfig, read: dict | None = None) -> Iterator[str]:
    """The texts of cfg's (one) dataset; for Dolma, read[source] counts the documents read of each."""
    if is_generated(cfg.dataset):
        raise DihalError(f"dataset '{cfg.dataset}' holds token ids, not text; only `dihal extract` reads it")
    if cfg.dataset == "pydoc":
        return pydoc_documents()
    if dolma.is_dolma(cfg.dataset):
        chosen = dolma.shards(cfg.dataset, cfg.dolma_shards, cfg.seed)
        return dolma.documents(
            cfg.dataset, chosen, cfg.text_field, cfg.shuffle_buffer, cfg.seed, {} if read is None else read
        )
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
    document_end: dict | None = None  # the token documents are joined by (lm/tokens.py)
    dolma: dict | None = None  # per dolma: source, its chosen shards and the documents read of each of its sources


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
    (bos, start_kind), end = start_token(tokenizer), document_end(tokenizer)

    def text_ids(text: str) -> tuple[list[int], bytes]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids + ([end["id"]] if end is not None else []), text.encode()

    def given_ids(ids: list[int]) -> tuple[list[int], bytes]:
        return list(ids), np.asarray(ids, dtype=np.int64).tobytes()

    wanted = wanted_counts(cfg)
    per_split = [allot(w, cfg.shares) if w is not None else [None] * len(cfg.shares) for w in wanted]
    digest, packed, read = hashlib.sha256(), [], {}
    for i, spec in enumerate(cfg.sources):
        if is_generated(spec):
            docs, ids_of = (generated or {})[spec], given_ids
        else:
            read[spec] = {}
            docs, ids_of = documents(one_source(cfg, spec), read[spec]), text_ids
        train, val, n_docs, n_tokens = _pack_source(cfg, docs, ids_of, bos, (per_split[0][i], per_split[1][i]), digest)
        if not train:
            raise DihalError(
                f"dataset '{spec}' gave no full training sequence of {cfg.seq_len} tokens; "
                "use more text or a smaller --seq-len"
            )
        packed.append((train, val, n_docs, n_tokens))
    start = {"id": bos, "token": tokenizer.convert_ids_to_tokens(bos), "kind": start_kind}
    shards = {
        spec: {
            "shards": [asdict(s) for s in dolma.shards(spec, cfg.dolma_shards, cfg.seed)],
            "documents_read": dict(sorted(read[spec].items())),
        }
        for spec in cfg.sources
        if dolma.is_dolma(spec)
    }
    told = {"document_end": end, "dolma": shards or None}
    if len(packed) == 1:
        train, val, n_docs, n_tokens = packed[0]
        ids = np.asarray(train + val, dtype=np.int32).reshape(-1, cfg.seq_len)
        split = np.asarray([0] * len(train) + [1] * len(val), dtype=np.int8)
        return PackedData(ids, split, digest.hexdigest()[:16], n_docs, n_tokens, start, **told)
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
        **told,
    )


def python_version_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"
