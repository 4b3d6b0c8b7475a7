"""What a stage reads from its parents' manifests, read in one place.

An extract holds its model and data settings as its config; every artifact made from an extract
(bridge, prior, decoder, generate, evaluate) carries a copy of that config as `extract_config` in
its manifest. `origin(art)` reads either, so no stage digs through manifests on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from dihal.artifacts.store import Artifact


@dataclass(frozen=True)
class Origin:
    """The backbone and the packing an artifact descends from."""

    model: str | None
    revision: str | None
    seq_len: int | None


def origin(art: Artifact) -> Origin:
    ex = art.config if art.stage == "extract" else (art.manifest.get("extract_config") or {})
    seq_len = (ex.get("data") or {}).get("seq_len")
    return Origin(ex.get("model"), ex.get("revision"), int(seq_len) if seq_len is not None else None)


def same_model(a: dict | None, b: dict | None) -> bool:
    """Two manifests' model identities (stages/lm/models.py locate) name the same weights and tokenizer."""
    a, b = a or {}, b or {}
    return all(a.get(k) == b.get(k) for k in ("source", "name", "file_sha256", "path", "revision"))


def trained_on(store, art: Artifact) -> set[str]:
    """The generate artifacts whose samples the extract behind `art` (or `art` itself) packed."""
    extract = art if art.stage == "extract" else store.load("extract", art.manifest["parents"]["extract"])
    return {v for k, v in extract.manifest.get("parents", {}).items() if k.startswith("generate")}


def backbone_for(art: Artifact, device: str, dtype: str, trust_remote_code: bool = False):
    """The backbone an artifact descends from, loaded. Whether its code may run is this command's
    flag, never the (untrusted) artifact's record."""
    from dihal.stages.lm.models import load_model

    o = origin(art)
    return load_model(o.model, device, dtype, o.revision, trust_remote_code)
