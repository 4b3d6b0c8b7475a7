"""Weights, training state and tables inside an artifact directory.

    weights.safetensors / weights_ema.safetensors   bridge network (raw and EMA)
    stats.safetensors                                normalization statistics and position-0 state
    state.safetensors                                resumable training state (atomic replace): tensors,
                                                     plus the plain fields (step, log, optimizer settings)
                                                     as JSON in the file's header metadata
    metrics.jsonl                                    one JSON object per logged step

Nothing here unpickles: an artifact store is shared and untrusted (docs/security.md), and a
pickle can run code when loaded. A `state.pt` (pickle) found where a checkpoint should be is
refused, never opened.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dihal.artifacts.errors import DihalError

STATE_FILE = "state.safetensors"
PICKLE_STATE_FILE = "state.pt"  # what older versions wrote; refused, never loaded
_STATE_KEY = "dihal_state"


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """Write through a temporary file and an atomic rename. A write that fails (a full disk) is an
    OSError with the system's errno, as every other write's is, and leaves no temporary file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
            str(tmp),
            metadata={k: str(v) for k, v in (metadata or {}).items()},
        )
    except SafetensorError as exc:
        tmp.unlink(missing_ok=True)
        code = re.search(r"os error (\d+)", str(exc))
        raise OSError(int(code.group(1)) if code else errno.EIO, str(exc), str(path)) from None
    os.replace(tmp, path)


def load_tensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    return load_file(str(path), device=str(device))


def save_state(directory: Path, state: dict) -> None:
    """Resume state: every tensor (however nested) in one safetensors file, the rest as JSON in its
    header. Only dicts, lists, tuples, str, int, float, bool, None and tensors are accepted."""
    tensors: dict[str, torch.Tensor] = {}
    plain = _split(state, tensors, "")
    save_tensors(directory / STATE_FILE, tensors, {_STATE_KEY: json.dumps(plain)})


def load_state(directory: Path) -> dict | None:
    """The resume state written by save_state, or None when there is none. Reads no pickle."""
    if (directory / PICKLE_STATE_FILE).exists():
        raise DihalError(
            f"{directory / PICKLE_STATE_FILE} is a pickled checkpoint, which dihal never loads (it could "
            "run code); delete it to restart this training from step 0"
        )
    path = directory / STATE_FILE
    if not path.exists():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        return _join(json.loads(meta[_STATE_KEY]), tensors)
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as exc:
        raise DihalError(
            f"resume checkpoint {path} is unreadable ({type(exc).__name__}); delete it to restart "
            "this training from step 0"
        ) from None


def _split(obj, tensors: dict, key: str):
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {
            "__items__": [
                [_split(k, tensors, f"{key}/k{i}"), _split(v, tensors, f"{key}/{i}")]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    if isinstance(obj, (list, tuple)):
        return {
            "__tuple__" if isinstance(obj, tuple) else "__list__": [
                _split(v, tensors, f"{key}/{i}") for i, v in enumerate(obj)
            ]
        }
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"resume state holds a {type(obj).__name__} at '{key}'; only plain types and tensors are saved")


def _join(obj, tensors: dict):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj:
            return {_join(k, tensors): _join(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(_join(v, tensors) for v in obj["__tuple__"])
        if "__list__" in obj:
            return [_join(v, tensors) for v in obj["__list__"]]
        raise ValueError("unknown entry in resume state")
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise ValueError("unknown entry in resume state")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
