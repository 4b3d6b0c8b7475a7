"""`dihal evaluate`: bridge fidelity (--bridge) or generation quality (--samples), METHOD.md section 3."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch

from artifacts import hidden_states as hs
from artifacts.errors import DihalError
from artifacts.store import Artifact, ArtifactStore, artifact_id
from stages.bridge import Bridge
from stages.fidelity import evaluate_fidelity
from stages.models import LoadedModel, load_model

STAGE = "evaluate"


@dataclass(frozen=True)
class FidelityConfig:
    steps: tuple[int, ...] = (1, 4, 8, 16)
    limit: int = 64  # held-out sequences
    batch_size: int = 16
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"


def parse_steps(spec: str) -> tuple[int, ...]:
    try:
        steps = tuple(sorted({int(s) for s in spec.split(",") if s.strip()}))
    except ValueError:
        raise DihalError(f"cannot read --steps '{spec}'; use a comma list like 4,8,16") from None
    if not steps or min(steps) < 1:
        raise DihalError("--steps must list positive integers")
    return steps


def backbone_for(bridge_art: Artifact, device: str, dtype: str) -> LoadedModel:
    ex = bridge_art.manifest["extract_config"]
    return load_model(ex["model"], device, dtype, ex.get("revision"))


def validation_ids(store: ArtifactStore, bridge_art: Artifact, limit: int) -> torch.Tensor:
    extract = store.load("extract", bridge_art.manifest["parents"]["extract"])
    group = hs.open_group(extract.path / "hidden.zarr")
    seqs = hs.split_indices(group, "validation")[:limit]
    if seqs.size == 0:
        raise DihalError(f"extract {extract.id} has no validation sequences to evaluate on")
    return torch.from_numpy(np.asarray(group["input_ids"].oindex[seqs]).astype(np.int64))


def run_fidelity(cfg: FidelityConfig, bridge_art: Artifact, store: ArtifactStore, *, force: bool = False,
                 loaded: LoadedModel | None = None) -> Artifact:
    config, parents = {"kind": "fidelity", **asdict(cfg)}, {"bridge": bridge_art.id}
    cached = store.cached(STAGE, config, parents)
    if cached and not force:
        return cached
    with store.lock(STAGE, artifact_id(STAGE, config, parents)):
        art = store.begin(STAGE, config, parents, seed=cfg.seed, device=cfg.device, force=force,
                          extra={"model": bridge_art.manifest.get("model")})
        loaded = loaded or backbone_for(bridge_art, cfg.device, cfg.dtype)
        bridge = Bridge.load(bridge_art, cfg.device)
        ids = validation_ids(store, bridge_art, cfg.limit)
        results = evaluate_fidelity(loaded.model, bridge, ids, list(cfg.steps), cfg.batch_size, cfg.seed)
        rows = [{"steps": s, **m} for s, m in results.items()]
        pd.DataFrame(rows).to_csv(art.file("fidelity.csv"), index=False)
        art.file("results.json").write_text(json.dumps({"layer": bridge.layer, "n_sequences": int(ids.shape[0]),
                                                        "fidelity": rows}, indent=2))
        art.manifest["metrics"] = {"layer": bridge.layer, "fidelity": rows}
        art.finish()
    return art
