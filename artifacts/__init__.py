"""Where every byte lives: the artifact store (store.py), hidden-state Zarr groups
(hidden_states.py), weights and tables (files.py)."""

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, artifact_id

__all__ = ["Artifact", "ArtifactStore", "DihalError", "artifact_id"]
