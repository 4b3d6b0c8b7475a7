"""dihal's Python API (docs/api.md): the artifact store, a score's table and a trained hybrid, by id,
unique id prefix or `latest` as the CLI takes them. Every artifact is made by the CLI or by a stage's
run(); nothing here computes a stage a second way.

    open_store(root)                  -> Store
    Store.runs(stage=None)            -> DataFrame, one row per artifact (`dihal runs list`)
    Store.load(ref, stage=None)       -> Loaded: the artifact, its manifest and its files' paths
    score_table(score, root=)         -> DataFrame: a score artifact's per-layer table (table.csv)
    load_hybrid(bridge, root=, device=, dtype=, steps=, seed=)
                                      -> the hybrid as a transformers causal LM (stages/hybrid_lm.py)
    export(bridge, out, root=, push_to_hub=, private=)
                                      -> a bridge as a package that leaves its store (stages/export.py)
    from_pretrained(folder_or_hub_id, base_model=, device=, dtype=, check_base=)
                                      -> an exported bridge's hybrid, with no store
    import_bridge(folder_or_hub_id, root=, base_model=)
                                      -> the package as a bridge artifact in a store, under its own id
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore


def _root(root) -> str | os.PathLike:
    """The CLI's --root: the argument, else $DIHAL_ROOT, else runs."""
    return root or os.environ.get("DIHAL_ROOT") or "runs"


@dataclass(frozen=True)
class Loaded:
    """One artifact: artifact.stage, artifact.id, its manifest and config, and every file it holds."""

    artifact: Artifact

    @property
    def id(self) -> str:
        return self.artifact.id

    @property
    def stage(self) -> str:
        return self.artifact.stage

    @property
    def manifest(self) -> dict:
        return self.artifact.manifest

    @property
    def config(self) -> dict:
        return self.artifact.config

    @property
    def path(self) -> Path:
        return self.artifact.path

    def file(self, name: str) -> Path:
        """The path of one of its files, once its bytes match the checksum recorded at completion (a one-line
        DihalError otherwise): how to read a file of a complete artifact."""
        return self.artifact.file(name)

    @property
    def paths(self) -> dict[str, Path]:
        """{name relative to the artifact: path} for every file but the manifest (unchecked; `file` checks)."""
        return {
            p.relative_to(self.path).as_posix(): p
            for p in sorted(self.path.rglob("*"))
            if p.is_file() and p.name != "manifest.json"
        }

    def __repr__(self) -> str:
        return f"Loaded({self.stage}/{self.id}, {self.artifact.status}, {len(self.paths)} files)"


class Store:
    """An artifact store (the CLI's --root)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.store = ArtifactStore(_root(root))

    @property
    def root(self) -> Path:
        return self.store.root

    def runs(self, stage: str | None = None) -> pd.DataFrame:
        """One row per artifact, oldest first: stage, id, status, created, wall seconds, size, parents and
        the config's keys that `dihal runs list` shows (model, layer, layers, protocol, mode)."""
        rows = []
        for art in self.store.all(stage):
            cfg = art.config
            rows.append(
                {
                    "stage": art.stage,
                    "id": art.id,
                    "status": art.status,
                    "created": pd.Timestamp(art.manifest["created"]) if art.manifest.get("created") else pd.NaT,
                    "seconds": art.wall_seconds,
                    "size_bytes": art.manifest.get("size_bytes"),
                    "parents": dict(art.manifest.get("parents", {})),
                    **{k: cfg.get(k) for k in ("model", "layer", "layers", "protocol", "mode")},
                }
            )
        columns = ["stage", "id", "status", "created", "seconds", "size_bytes", "parents"]
        frame = pd.DataFrame(rows, columns=[*columns, "model", "layer", "layers", "protocol", "mode"])
        return frame.astype({"layer": "Int64", "size_bytes": "Int64"})  # whole numbers, <NA> where a stage has none

    def load(self, ref: str, stage: str | None = None) -> Loaded:
        return Loaded(self.store.resolve(ref, stage))

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r}, {len(self.store.all())} artifacts)"


def open_store(root: str | os.PathLike | None = None) -> Store:
    """The store under root (the CLI's --root: else $DIHAL_ROOT, else runs); DihalError when there is none."""
    root = _root(root)
    if not Path(root).is_dir():
        raise DihalError(f"no artifact store at {root}; run a `dihal` command with --root {root} first")
    return Store(root)


def _artifact(ref: str | Loaded | Artifact, stage: str, root) -> Artifact:
    """ref as an artifact of `stage`: a Loaded, an Artifact, or an id/prefix/latest in the store at root."""
    art = ref.artifact if isinstance(ref, Loaded) else ref
    if not isinstance(art, Artifact):
        store = ArtifactStore(_root(root))
        found = [a for a in store.all() if a.id.startswith(str(art))] if art != "latest" else []
        if len(found) == 1 and found[0].stage != stage:
            raise DihalError(f"{found[0].stage}/{found[0].id} is not a {stage} artifact; give a {stage} id")
        art = store.resolve(str(art), stage)
    if art.stage != stage:
        raise DihalError(f"{art.stage}/{art.id} is not a {stage} artifact; give a {stage} id")
    if not art.complete:
        raise DihalError(f"{stage}/{art.id} is {art.status}; finish it with the command that made it")
    return art


def score_table(score: str | Loaded | Artifact = "latest", root: str | os.PathLike | None = None) -> pd.DataFrame:
    """A score artifact's per-layer table (METHOD §1): one row per layer, every proxy."""
    return pd.read_csv(_artifact(score, "score", root).file("table.csv"))


def load_hybrid(
    bridge: str | Loaded | Artifact = "latest",
    *,
    root: str | os.PathLike | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    steps: int | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
):
    """The bridge's hybrid (its backbone loaded as its extract was made) as a transformers causal LM,
    stages/hybrid_lm.py: teacher-forced forward(input_ids, attention_mask) and generate."""
    from dihal.stages.hybrid_lm import STEPS, HybridForCausalLM

    art = _artifact(bridge, "bridge", root)
    return HybridForCausalLM.from_bridge(art, device, dtype, steps or STEPS, seed, trust_remote_code)


def export(
    bridge: str | Loaded | Artifact = "latest",
    out: str | os.PathLike = "bridge",
    *,
    root: str | os.PathLike | None = None,
    steps: int | None = None,
    seed: int = 0,
    push_to_hub: str | None = None,
    private: bool = False,
    trust_remote_code: bool = False,
) -> Path:
    """`dihal export`: the bridge alone as a package in `out` (docs/sharing.md), uploaded to the hub repo
    `push_to_hub` where given. hybrid.save_pretrained(out) writes the same package."""
    from dihal.artifacts.store import ArtifactStore
    from dihal.stages import export as stage
    from dihal.stages.hybrid_lm import STEPS

    art = _artifact(bridge, "bridge", root)
    path = stage.export_bridge(
        art, Path(out), ArtifactStore(art.root), steps=steps or STEPS, seed=seed, trust_remote_code=trust_remote_code
    )
    if push_to_hub:
        stage.push(path, push_to_hub, private=private)
    return path


def from_pretrained(
    bridge: str | os.PathLike,
    *,
    base_model=None,
    device: str = "cpu",
    dtype: str = "float32",
    check_base: bool = True,
    steps: int | None = None,
    seed: int | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
):
    """An exported bridge's hybrid (a folder or a hub repo id), with no store: its base model from its config,
    or `base_model` (a --model spec, a LoadedModel or (model, tokenizer)), checked by content hash."""
    from dihal.stages.hybrid_lm import HybridForCausalLM

    return HybridForCausalLM.from_pretrained(
        bridge,
        base_model=base_model,
        device=device,
        dtype=dtype,
        check_base=check_base,
        steps=steps,
        seed=seed,
        revision=revision,
        trust_remote_code=trust_remote_code,
    )


def import_bridge(
    bridge: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    base_model: str | None = None,
    revision: str | None = None,
) -> Loaded:
    """`dihal import`: an exported bridge brought into the store at root as the artifact it was exported from."""
    from dihal.artifacts.store import ArtifactStore
    from dihal.stages import export as stage

    package = stage.read(bridge, revision)
    store = ArtifactStore(_root(root))
    return Loaded(stage.import_bridge(package, store, base_model or stage.default_base(package)))
