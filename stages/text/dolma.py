"""Dolma as it is published (docs/guide.md, "Dolma"): a version is a list of shard URLs, each a gzipped
JSON-lines file of one source (algebraic-stack, c4, arxiv, ...) whose records carry `text` beside fields
that differ from source to source.

    dolma:v1_7               the URL list urls/v1_7.txt of the hub dataset allenai/dolma
    dolma:LIST.txt           a URL list of your own: a local file or an http(s) address, one shard a line
    dolma:GLOB               shards already downloaded (*.json.gz, *.jsonl.gz, *.json.zst, ...)

The mix: a shard's source is its folder (or, when every shard shares one folder, its name without the
number). From each source `--dolma-shards` shards (default 1) are chosen by the seed; a source's
documents are drawn in proportion to its share of the list's shards (shards are of similar size, so this
is its share of Dolma), through datasets' `interleave_datasets`, and pass a seeded shuffle buffer of
`--shuffle-buffer` documents. Each shard is its own datasets json stream of which only the text field is
kept, so the sources' other fields never have to agree. The chosen shards are recorded in the manifest.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from dihal.artifacts.errors import DihalError
from dihal.stages.runtime import hub

PREFIX = "dolma:"
HUB_REPO = "allenai/dolma"  # its urls/<version>.txt lists the shards of each published version
VERSION = re.compile(r"^v\d+(_\d+)*(_sample)?$")
COMPRESSED = (".gz", ".zst", ".bz2", ".xz")
SOURCE_COLUMN = "dolma_source"


def is_dolma(spec: str) -> bool:
    return spec.startswith(PREFIX)


def needs_network(spec: str) -> bool:
    """Whether reading the spec's shard list needs the network (a hub version, an http list)."""
    what = spec.removeprefix(PREFIX)
    return bool(VERSION.match(what)) or what.startswith(("http://", "https://"))


@dataclass(frozen=True)
class Shard:
    location: str  # a URL or a local path
    source: str
    weight: float  # the probability a document is drawn from this shard


def shard_list(spec: str) -> list[str]:
    """Every shard the spec names, in the list's own order."""
    what = spec.removeprefix(PREFIX)
    if VERSION.match(what):
        return _read_list(_hub_list(what), spec)
    if what.startswith(("http://", "https://")) or what.endswith(".txt"):
        return _read_list(what, spec)
    found = sorted(glob.glob(str(Path(what).expanduser() / "*") if Path(what).is_dir() else what))
    shards = [p for p in found if Path(p).is_file() and _is_shard(p)]
    if not shards:
        raise DihalError(
            f"dataset '{spec}' names no shard: give dolma:v1_7 (its URL list on the hub), a URL list "
            "(dolma:urls.txt), or downloaded shards (dolma:'/data/dolma/*.json.gz')"
        )
    return shards


def _is_shard(name: str) -> bool:
    stem = name[: -len(s)] if (s := next((c for c in COMPRESSED if name.endswith(c)), "")) else name
    return stem.endswith((".json", ".jsonl"))


def _hub_list(version: str) -> str:
    """The local copy of allenai/dolma's urls/<version>.txt (downloaded once, then from the HF cache, which
    is all an unreachable hub leaves)."""
    from huggingface_hub import hf_hub_download

    try:
        where = {"local_files_only": True} if not hub.reachable() else {}
        return hf_hub_download(HUB_REPO, f"urls/{version}.txt", repo_type="dataset", **where)
    except Exception as exc:  # noqa: BLE001 - offline, unknown version, gated: one line for the user
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise DihalError(
            f"cannot read the URL list of Dolma {version} from the hub dataset {HUB_REPO} ({reason}); check the "
            "version (urls/<version>.txt there), or download the shards and pass dolma:'DIR/*.json.gz'"
        ) from None


def _read_list(where: str, spec: str) -> list[str]:
    import fsspec

    try:
        with fsspec.open(where, "rt") as fh:
            urls = [line.strip() for line in fh if line.strip() and not line.startswith("#")]
    except Exception as exc:  # noqa: BLE001 - a missing file, a refused connection: one line
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise DihalError(
            f"cannot read the URL list of dataset '{spec}' ({reason}); check the path or address"
        ) from None
    bad = [u for u in urls if not _is_shard(PurePosixPath(u.split("?")[0]).name)]
    if not urls or bad:
        raise DihalError(
            f"the URL list of dataset '{spec}' "
            + (f"holds '{bad[0]}', not a .json(l)[.gz|.zst] shard" if bad else "is empty")
            + "; give one shard URL a line"
        )
    return urls


def source_of(locations: list[str]) -> list[str]:
    """Each shard's source: its folder, or its name without the shard number where all share one folder."""
    paths = [PurePosixPath(loc.split("?")[0]) for loc in locations]
    if len({p.parent for p in paths}) > 1:
        return [p.parent.name for p in paths]
    return [re.sub(r"[-_.]*\d+$", "", p.name.split(".")[0]) or p.name for p in paths]


def choose(locations: list[str], per_source: int, seed: int) -> list[Shard]:
    """per_source shards of each source, chosen by the seed; weights by each source's share of the list."""
    sources = source_of(locations)
    names = sorted(set(sources))
    rng = np.random.default_rng([seed, 45])
    chosen = []
    for name in names:
        mine = [loc for loc, s in zip(locations, sources) if s == name]
        take = sorted(rng.choice(len(mine), size=min(per_source, len(mine)), replace=False))
        share = len(mine) / len(locations)
        chosen += [Shard(mine[i], name, share / len(take)) for i in take]
    return chosen


def shards(spec: str, per_source: int, seed: int) -> list[Shard]:
    return choose(shard_list(spec), per_source, seed)


def _stream(shard: Shard, text_field: str, spec: str):
    """One shard as a datasets stream of {text, source}: only the text field is kept."""
    import datasets

    if shard.location.endswith(".zst"):
        try:
            import zstandard  # noqa: F401 - what datasets reads .zst with
        except ImportError:
            raise DihalError(f"dataset '{spec}' has .zst shards; install zstandard (pip install zstandard)") from None
    try:
        stream = datasets.load_dataset("json", data_files=[shard.location], split="train", streaming=True)
    except Exception as exc:  # noqa: BLE001 - unreachable, not JSON lines: one line naming the shard
        raise DihalError(f"cannot read shard {shard.location} of dataset '{spec}' ({_reason(exc)})") from None
    fields = list(stream.features or {})
    if stream.features is not None and text_field not in fields:
        raise DihalError(
            f"shard {shard.location} of dataset '{spec}' has no text field '{text_field}' (fields: "
            f"{', '.join(fields)}); name the right one with --text-field"
        )
    features = datasets.Features({text_field: datasets.Value("string"), SOURCE_COLUMN: datasets.Value("string")})
    return stream.select_columns([text_field]).map(lambda _: {SOURCE_COLUMN: shard.source}, features=features)


def documents(spec: str, chosen: list[Shard], text_field: str, buffer: int, seed: int, read: dict) -> Iterator[str]:
    """The chosen shards' texts, interleaved by weight and shuffled through a buffer; read[source] counts
    the documents read from each source."""
    import datasets

    streams = [_stream(s, text_field, spec) for s in chosen]
    weights = [s.weight for s in chosen]
    mixed = datasets.interleave_datasets(
        streams, probabilities=[w / sum(weights) for w in weights], seed=seed, stopping_strategy="all_exhausted"
    )
    if buffer > 1:
        mixed = mixed.shuffle(seed=seed, buffer_size=buffer)
    try:
        for index, row in enumerate(mixed):
            value = row[text_field]
            if value is not None and not isinstance(value, str):
                raise DihalError(
                    f"record {index} of dataset '{spec}' has a {type(value).__name__} in field '{text_field}', "
                    "not a string; name another field with --text-field"
                )
            read[row[SOURCE_COLUMN]] = read.get(row[SOURCE_COLUMN], 0) + 1
            if value:
                yield value
    except DihalError:
        raise
    except Exception as exc:  # noqa: BLE001 - a shard cut off mid-stream, a malformed line
        raise DihalError(f"reading dataset '{spec}' failed ({_reason(exc)}); rerun to resume") from None


def check(spec: str, chosen: list[Shard], text_field: str) -> None:
    """Before any model loads: the first chosen shard opens and has the text field."""
    _stream(chosen[0], text_field, spec)


def _reason(exc: BaseException) -> str:
    cause = exc
    while cause.__cause__ is not None or cause.__context__ is not None:
        nxt = cause.__cause__ or cause.__context__
        if nxt is None or not str(nxt):
            break
        cause = nxt
    return ((str(cause).splitlines() or [type(cause).__name__])[0] or type(cause).__name__)[:200]
