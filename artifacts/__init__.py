"""Where every byte lives: the artifact store (store.py), hidden-state Zarr groups
(hidden_states.py), weights and tables (files.py)."""

from artifacts.errors import DihalError
from artifacts.store import Artifact, ArtifactStore, artifact_id

__all__ = ["Artifact", "ArtifactStore", "DihalError", "artifact_id"]
