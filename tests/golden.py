"""Golden outputs: what each computing stage writes for one fixed tiny input, recorded with the stage's
CACHE_VERSION, so that a change to the computation that leaves the version (and so the ids) alone fails
tests/test_golden.py.

    DIHAL_GOLDEN=update python -m pytest -m slow tests/test_golden.py    records them anew (after a bump)

A stage's view is the numbers its files hold that do not depend on the machine's speed: arrays,
weights, token ids, the numeric columns of its tables (timings left out), its training losses. The chain runs
on one thread, so that its sums have one order whatever the machine's core count: run twice, it writes
the same bytes. Another CPU may still round differently, and a few values amplify any rounding: an
attention key bias has a zero gradient but for rounding, which AdamW scales up to steps of the learning
rate. So floats compare within a relative tolerance (GOLDEN_RTOL), and a view fails when more than
GOLDEN_SHARE of its floats move past it. Measured on this chain: two threads against one move up to 0.5% of a
trained part's view past 1e-4 (a decoder's key biases) and 2-3 values of the small fidelity and score
tables; AdamW's beta2 0.99 -> 0.999 moves 10-58% of every trained part's view.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parent / "golden"
GOLDEN_RTOL = 1e-4
GOLDEN_SHARE = 0.005  # floats that may move past GOLDEN_RTOL: the chaotic few (see the module's docstring)
VERSION_KEY = "__cache_version__"
LINEAGE_KEY = "__lineage__"  # what the record was computed from (lineage()): another lineage, another computation
TIMING = re.compile(r"(^|_)(ms|seconds|wall|time|secs)(_|$)|per_s|ms_per|per_sample_ms|elapsed")


def updating() -> bool:
    return os.environ.get("DIHAL_GOLDEN") == "update"


def table_view(path: Path, prefix: str = "") -> dict[str, np.ndarray]:
    """The numeric columns of a CSV table, timings left out."""
    import pandas as pd

    frame = pd.read_csv(path)
    out = {}
    for column in frame.columns:
        if TIMING.search(str(column)) or not pd.api.types.is_numeric_dtype(frame[column]):
            continue
        out[f"{prefix}{column}"] = frame[column].to_numpy(dtype=np.float64)
    return out


def samples_view(path: Path, prefix: str = "") -> dict[str, np.ndarray]:
    """Every sample's token ids, padded with -1."""
    rows = [json.loads(line)["token_ids"] for line in path.read_text().splitlines()]
    width = max((len(r) for r in rows), default=0)
    ids = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return {f"{prefix}token_ids": ids}


def part_view(art) -> dict[str, np.ndarray]:
    """A trained part: its EMA weights, its normalisation statistics and its logged losses."""
    from dihal.artifacts import files

    out = {f"w.{k}": v.float().numpy() for k, v in files.load_tensors(art.file("weights_ema.safetensors")).items()}
    out |= {f"s.{k}": v.float().numpy() for k, v in files.load_tensors(art.file("stats.safetensors")).items()}
    log = files.read_jsonl(art.file("metrics.jsonl"))
    out["train_loss"] = np.array([r["train_loss"] for r in log])
    out["val_loss"] = np.array([r["val_loss"] for r in log if "val_loss" in r])
    if art.file("latents.safetensors").exists():
        out |= {f"z.{k}": v.float().numpy() for k, v in files.load_tensors(art.file("latents.safetensors")).items()}
    return out


def extract_view(art) -> dict[str, np.ndarray]:
    from dihal.artifacts import hidden_states as hs

    group = hs.open_group(art)
    out = {
        f"layers/{layer}": hs.read_block(group, layer, 0, group["input_ids"].shape[0])
        for layer in hs.stored_layers(group)
    }
    for name in ("input_ids", "attention_mask", "split", "sample_seq", "sample_pos"):
        out[name] = np.asarray(group[name][:])
    for layer in hs.stored_layers(group):
        out[f"sample/{layer}"] = np.asarray(group[f"sample/{layer}"][:], dtype=np.float32)
    return out


def evaluate_view(art) -> dict[str, np.ndarray]:
    kind = art.config["kind"]
    if kind == "fidelity":
        return table_view(art.file("fidelity.csv")) | table_view(art.file("fidelity_by_position.csv"), "pos.")
    if kind == "samples":
        return table_view(art.file("generation.csv")) | table_view(art.file("per_sample.csv"), "each.")
    return table_view(art.file("lm_eval.csv"))


def generate_view(art) -> dict[str, np.ndarray]:
    out = samples_view(art.file("samples.jsonl"))
    if art.file("samples_original.jsonl").exists():
        out |= samples_view(art.file("samples_original.jsonl"), "original.")
    return out


def view(art) -> dict[str, np.ndarray]:
    """The stage's golden view of a complete artifact."""
    stage = art.stage
    if stage == "extract":
        return extract_view(art)
    if stage == "score":
        return table_view(art.file("table.csv"))
    if stage in ("bridge", "prior", "decoder", "autoencoder"):
        return part_view(art)
    if stage == "evaluate":
        return evaluate_view(art)
    if stage == "generate":
        return generate_view(art)
    if stage == "sweep":
        return table_view(art.file("sweep.csv")) | table_view(art.file("variants.csv"), "variants.")
    if stage == "confirm":
        return table_view(art.file("confirm_runs.csv"))
    if stage == "compare":
        return table_view(art.file("summary.csv")) | table_view(art.file("samples.csv"), "samples.")
    raise ValueError(stage)


def differences(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> list[str]:
    """What differs between two views: arrays missing on either side, other shapes, any other integer (a
    token id, a count), and floats beyond GOLDEN_RTOL in more than GOLDEN_SHARE of the view's values."""
    problems = [f"{k} is new" for k in sorted(set(got) - set(want))]
    problems += [f"{k} is gone" for k in sorted(set(want) - set(got))]
    moved: list[tuple[str, int, int, float]] = []
    values = 0
    for key in sorted(set(got) & set(want)):
        a, b = np.asarray(got[key]), np.asarray(want[key])
        if a.shape != b.shape:
            problems.append(f"{key}: shape {a.shape}, recorded {b.shape}")
        elif a.dtype.kind in "iub" or b.dtype.kind in "iub":
            if not np.array_equal(a, b):
                problems.append(f"{key}: {int((a != b).sum())} of {a.size} values differ")
        else:
            finite = np.isfinite(b)
            scale = float(np.abs(b[finite]).max()) if finite.any() else 1.0
            close = np.isclose(a, b, rtol=GOLDEN_RTOL, atol=GOLDEN_RTOL * 1e-2 * max(scale, 1e-12), equal_nan=True)
            values += a.size
            if not close.all():
                moved.append((key, int((~close).sum()), a.size, float(np.nanmax(np.abs(a - b)))))
    if sum(m[1] for m in moved) > GOLDEN_SHARE * values:
        problems += [f"{k}: {n} of {size} values differ (at most by {worst:.3g})" for k, n, size, worst in moved]
    return problems


def _local(value):
    """A config with every absolute path cut to its last part."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return Path(value).name if isinstance(value, str) and value.startswith("/") else value


# what an id hashes of this machine rather than of the chain's configs: the tiny models' digests (their files are
# rebuilt each session and record the transformers version that wrote them) and the installed harness's version
MACHINE_KEYS = ("model_sha256", "evaluator_sha256", "harness")


def lineage(art, store) -> str:
    """The configs of the artifact and of every ancestor, as one string: what its id names, less the
    absolute paths (the chain's tiny models lie in a fresh temporary folder each session, and a local
    model's path is in its extract's id) and MACHINE_KEYS (the view compares what they compute). A default
    that moves changes it; a code change does not."""
    configs, todo = set(), [art]
    while todo:
        a = todo.pop()
        config = {k: v for k, v in a.config.items() if k not in MACHINE_KEYS}
        configs.add(json.dumps({"stage": a.stage, "config": _local(config)}, sort_keys=True, default=str))
        todo += [store.load(stage, pid) for stage, pid in (a.manifest.get("parents") or {}).items()]
    return "\n".join(sorted(configs))


def read(name: str) -> tuple[int | None, str | None, dict[str, np.ndarray]]:
    """(CACHE_VERSION, lineage, view) of a record; the lineage is None in a record made before it was kept."""
    path = GOLDEN / f"{name}.npz"
    if not path.exists():
        return None, None, {}
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    recorded = str(arrays.pop(LINEAGE_KEY)) if LINEAGE_KEY in arrays else None
    return int(arrays.pop(VERSION_KEY)), recorded, arrays


def write(name: str, version: int, computed_from: str, arrays: dict[str, np.ndarray]) -> None:
    GOLDEN.mkdir(exist_ok=True)
    keys = {VERSION_KEY: np.array(version), LINEAGE_KEY: np.array(computed_from)}
    np.savez_compressed(GOLDEN / f"{name}.npz", **keys, **arrays)
