"""A layer's normalization statistics, computed once per extract and layer (METHOD §2, issue 64).

Every trained part normalizes its target per dimension by the moments of its layer over the extract's training
split (stages/diffusion/normalizer.py): a comparison's bridges and DiHAL-direct prior at l*, over every seed and
budget, and its priors, decoders and autoencoder at layer 0 all need the same few. Each was one pass over the
training split (with --states model, a forward pass of the backbone's first l blocks). Here it is one artifact,
a child of the extract, made once and read back through the store's checksums by every part that needs it.

    moments.safetensors   mean and m2 (float64, per dimension), n (positions counted), pos0 (the sum of the
                          position-0 states over the sequences)

The pass is the one Normalizer.fit made (the same blocks, in the same order, merged in float64), so every part
normalizes exactly as before and no part's bytes move.
"""

from __future__ import annotations

import numpy as np
import torch

from dihal.artifacts import files
from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import Artifact, ArtifactStore, Job
from dihal.stages.configs import MomentsConfig
from dihal.stages.diffusion.normalizer import RunningMoments, target_moments
from dihal.stages.runtime import dist

STAGE = "moments"
CACHE_VERSION = 1  # bump whenever the stored moments' bytes change


def config_for(layer: int, start: int, states: str = "store", device: str = "cpu", precision: str = "float32"):
    """The moments a part of this layer, start and source reads: a stored layer's whatever trains on it; computed
    states' per device type and precision."""
    if states == "store":
        return MomentsConfig(layer=layer, start=start)
    return MomentsConfig(layer=layer, start=start, states=states, device=dist.device_type(device), precision=precision)


def run(cfg: MomentsConfig, extract: Artifact, store: ArtifactStore, group=None, model_states=None) -> Artifact:
    """The moments artifact of `cfg` over `extract`'s training split, made once (under torchrun by rank 0 while
    the others wait for it). model_states() -> ModelStates of cfg.layer, called only when computed states are
    to be computed."""
    group = group if group is not None else hs.open_group(extract)

    def work(art: Artifact) -> None:
        seqs = hs.split_indices(group, "train")
        states = model_states() if cfg.states == "model" else None
        moments, pos0 = target_moments(group, cfg.layer, seqs, cfg.start, states=states)
        tensors = {
            "mean": torch.from_numpy(moments.mean),
            "m2": torch.from_numpy(moments.m2),
            "n": torch.tensor([moments.n], dtype=torch.int64),
            "pos0": torch.from_numpy(pos0),
        }
        files.save_tensors(art.file("moments.safetensors"), tensors)
        art.manifest["metrics"] = {"positions": int(moments.n), "sequences": len(seqs), "width": len(pos0)}

    job = Job(STAGE, CACHE_VERSION, cfg.hashed(), {"extract": extract.id}, work, extra={"layer": cfg.layer})
    return store.run_stage(job, group=dist.group())


def load(art: Artifact) -> tuple[RunningMoments, np.ndarray]:
    """(the layer's RunningMoments, the sum of its position-0 states), as target_moments returns them, read through
    the artifact's checksums."""
    t = files.load_tensors(art.file("moments.safetensors"))
    moments = RunningMoments(t["mean"].shape[0])
    moments.n, moments.mean, moments.m2 = int(t["n"][0]), t["mean"].numpy(), t["m2"].numpy()
    return moments, t["pos0"].numpy()


def of(extract: Artifact, store: ArtifactStore, group, cfg: MomentsConfig, model_states=None):
    """What Normalizer.fit(target=...) takes: the stored moments of cfg, made first where they are not yet."""
    return load(run(cfg, extract, store, group, model_states))
