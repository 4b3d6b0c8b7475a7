"""What a stage reads from its parents' manifests, read in one place.

An extract holds its model and data settings as its config; every artifact made from an extract
(bridge, prior, decoder, generate, evaluate) carries a copy of that config as `extract_config` in
its manifest. `origin(art)` reads either, so no stage digs through manifests on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact


@dataclass(frozen=True)
class Origin:
    """The backbone and the packing an artifact descends from."""

    model: str | None
    revision: str | None
    seq_len: int | None
    weights: str | None = None  # the extract's model_sha256: a local model's files (or a changed builtin's GGUF)


def origin(art: Artifact) -> Origin:
    ex = art.config if art.stage == "extract" else (art.manifest.get("extract_config") or {})
    seq_len = (ex.get("data") or {}).get("seq_len")
    return Origin(
        ex.get("model"), ex.get("revision"), int(seq_len) if seq_len is not None else None, ex.get("model_sha256")
    )


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

    o = check_weights(art)
    return load_model(o.model, device, dtype, o.revision, trust_remote_code)


def check_weights(art: Artifact) -> Origin:
    """art's origin, once the model it names is the one its extract read: a local model's files (or a
    builtin's GGUF) against the extract's model_sha256, before any stage loads it to work with art (an
    extract made before model_sha256 was recorded cannot be checked, and is not)."""
    from dihal.stages.lm.models import BUILTINS, weights_digest

    o = origin(art)
    if (o.weights is not None or o.model in BUILTINS) and weights_digest(o.model) != o.weights:
        raise DihalError(
            f"the model {o.model} is not the one {art.stage} {art.id} descends from (its files changed since "
            "the extract read them); restore it, or extract and train anew from the model as it is now"
        )
    return o


def scored_extract(score_art: Artifact, extract: Artifact, store, computed: bool) -> Artifact:
    """The extract a score read: `extract` itself, or, where the parts compute their states (--states model:
    computed), any extract of the same backbone (every layer of a few sequences for the score, the token ids of
    many for the parts: issue 64's disk plan). Anything else is one line."""
    made_from = score_art.manifest.get("parents", {}).get("extract")
    if made_from == extract.id:
        return extract
    scored = store.resolve(made_from, "extract") if computed and made_from else None
    if scored is None or not same_model(scored.manifest.get("model"), extract.manifest.get("model")):
        raise DihalError(
            f"score {score_art.id} was made from extract {made_from}, not {extract.id}; pass a --score of this "
            "extract (with --states model, of an extract of the same backbone) or leave --score out to score it now"
        )
    return scored
