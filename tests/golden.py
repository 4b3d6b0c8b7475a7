"""Golden outputs: what each computing stage writes for one fixed tiny input, recorded with the stage's
CACHE_VERSION, so that a change to the computation that leaves the version (and so the ids) alone fails
tests/test_golden.py.

    DIHAL_GOLDEN=update python -m pytest -m slow tests/test_golden.py    records them anew (after a bump)

A stage's view is the numbers its files hold that do not depend on the machine's speed: arrays,
weights, token ids, the numeric columns of its tables (timings left out), its training losses. The chain runs
on one thread, so that its sums have one order whatever the machine's core count: run twice on one machine,
it writes the same bytes. Another CPU rounds differently (other kernels: AVX2 or AVX-512, MKL's Intel or AMD
path), so every value is compared on its own, within the tolerance below; none may move past it, however few.

The tolerance (issue 63) is chosen from the spread measured between the kernel sets x86 CPUs pick,
benchmarks/golden_spread.py (results in benchmarks/results/golden_spread.json):

- integers (token ids, counts, splits) and ids: exactly;
- float32 results: |got - recorded| <= GOLDEN_RTOL * |recorded| + GOLDEN_ATOL * (the array's largest |value|):
  1e-5 relative, and 1e-5 of the array's scale for values that are small only beside their neighbours (a weight
  near zero). The largest move measured between AVX2 and AVX-512 kernels is 0.67 of it (a sweep's S);
- values stored in float16 (an extract's layers): one float16 unit in the last place (a value on a rounding
  boundary lands on either side of it);
- the weights of the decoder and the autoencoder (FEW_STEP_WEIGHTS), trained three AdamW steps from their
  initialisation: 1e-4 of each array's scale (FEW_STEP_ATOL). AdamW's first steps move a weight by about the
  learning rate whatever its gradient's size, so a gradient that is rounding noise (in these cross-attending
  decoders, hundreds of entries) takes a step of a sign the kernels decide: 1.5e-5 at a scale of 0.25 measured,
  3.1x the 1e-5 rule and 0.58 of this one. Their losses and latents keep the 1e-5 rule. The same rule holds
  for any trained part made by two ranks against one process (RANK_SPLIT, tests/test_paper_scale.py): the
  gradient is summed in another order there (each rank's share, then the all-reduce), and a bridge's 3 steps
  moved one adaLN weight of 1,536 by 1.75e-7, 1.3x the 1e-5 rule;
- a KL divergence: GOLDEN_KL_ATOL absolute, since it is a difference of float32 log-probabilities of order 10, so
  its error is float32's resolution there (2.4e-7 measured), whatever its own size.

Two kinds of values are left out of a view, because only rounding sets them: an attention key bias
(`kv.bias`'s key half) has a zero gradient in exact arithmetic, as softmax ignores a shift shared by every key,
so AdamW turns its rounding noise into steps of the learning rate (a 7e-4 move between kernel sets);
and SSE-only kernels (ATEN_CPU_CAPABILITY=default, CPUs without AVX2) move trained weights 10x further than
AVX2 does, so they are not among the machines this tolerance serves (the spread file has their figures).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parent / "golden"
GOLDEN_RTOL = 1e-5  # of the value itself
GOLDEN_ATOL = 1e-5  # of the largest |value| of the value's array
GOLDEN_KL_ATOL = 1e-6  # a KL's absolute tolerance: float32's resolution of the log-probabilities it subtracts
# the two cross-attending decoders, three AdamW steps each: their weights to 1e-4 of each array's scale (below)
FEW_STEP_WEIGHTS = {"decoder", "autoencoder"}
FEW_STEP_ATOL = 1e-4
RANK_SPLIT = "ranks:"  # a record name "ranks:<stage>": a trained part of two ranks against one process's
KL = re.compile(r"(^|[._])kl$")
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


def without_key_bias(name: str, value: np.ndarray) -> np.ndarray:
    """A cross-decoder attention's kv.bias without its key half: softmax ignores a shift that every key shares,
    so that half has a zero gradient in exact arithmetic and holds only rounding, which AdamW scales up to steps
    of the learning rate (the module's docstring). The denoiser's qkv.bias is rotated with its keys, so its key
    part has a real gradient and stays."""
    return value[value.shape[0] // 2 :] if name.endswith("kv.bias") and not name.endswith("qkv.bias") else value


def part_view(art) -> dict[str, np.ndarray]:
    """A trained part: its EMA weights, its normalisation statistics and its logged losses."""
    from dihal.artifacts import files

    weights = files.load_tensors(art.file("weights_ema.safetensors")).items()
    out = {f"w.{k}": without_key_bias(k, v.float().numpy()) for k, v in weights}
    out |= {f"s.{k}": v.float().numpy() for k, v in files.load_tensors(art.file("stats.safetensors")).items()}
    log = files.read_jsonl(art.file("metrics.jsonl"))
    out["train_loss"] = np.array([r["train_loss"] for r in log])
    out["val_loss"] = np.array([r["val_loss"] for r in log if "val_loss" in r])
    if art.file("latents.safetensors").exists():
        out |= {f"z.{k}": v.float().numpy() for k, v in files.load_tensors(art.file("latents.safetensors")).items()}
    return out


def extract_view(art) -> dict[str, np.ndarray]:
    """An extract's arrays as stored (a float16 layer stays float16, with its exact position 0 beside it)."""
    from dihal.artifacts import hidden_states as hs

    group = hs.open_group(art)
    out = {}
    for layer in hs.stored_layers(group):
        out[f"layers/{layer}"] = np.asarray(group[f"layers/{layer}"][:])
        out[f"sample/{layer}"] = np.asarray(group[f"sample/{layer}"][:])
        if f"pos0/{layer}" in group:
            out[f"pos0/{layer}"] = np.asarray(group[f"pos0/{layer}"][:])
    for name in ("input_ids", "attention_mask", "split", "sample_seq", "sample_pos"):
        if name in group:  # an extract of token ids alone (--layers none) has no pool
            out[name] = np.asarray(group[name][:])
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


def tolerance(key: str, recorded: np.ndarray, record: str = "") -> np.ndarray:
    """How far each recorded float of array `key` of record `record` may move on another machine (the module's
    docstring)."""
    b = np.abs(np.asarray(recorded, dtype=np.float64))
    if recorded.dtype == np.float16:
        return np.spacing(np.abs(recorded)).astype(np.float64)  # one float16 unit in the last place
    finite = np.isfinite(b)
    scale = float(b[finite].max()) if finite.any() else 0.0
    few_steps = record in FEW_STEP_WEIGHTS or record.startswith(RANK_SPLIT)
    atol = FEW_STEP_ATOL if few_steps and key.startswith("w.") else GOLDEN_ATOL
    allowed = GOLDEN_RTOL * b + atol * scale
    return np.maximum(allowed, GOLDEN_KL_ATOL) if KL.search(key) else allowed


def differences(got: dict[str, np.ndarray], want: dict[str, np.ndarray], record: str = "") -> list[str]:
    """What differs between two views: arrays missing on either side, other shapes or dtypes, any other
    integer (a token id, a count), and any float beyond its tolerance (tolerance()), each array named with how
    many of its values moved past it and by how much, at worst, against what it allowed there."""
    problems = [f"{k} is new" for k in sorted(set(got) - set(want))]
    problems += [f"{k} is gone" for k in sorted(set(want) - set(got))]
    for key in sorted(set(got) & set(want)):
        a, b = np.asarray(got[key]), np.asarray(want[key])
        if a.shape != b.shape:
            problems.append(f"{key}: shape {a.shape}, recorded {b.shape}")
        elif a.dtype.kind in "iub" or b.dtype.kind in "iub":
            if not np.array_equal(a, b):
                problems.append(f"{key}: {int((a != b).sum())} of {a.size} values differ")
        elif (a.dtype == np.float16) != (b.dtype == np.float16):
            problems.append(f"{key}: dtype {a.dtype}, recorded {b.dtype}")
        else:
            allowed = tolerance(key, b, record)
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            with np.errstate(invalid="ignore"):
                same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))  # infinities and NaN: the same, or past
                moved = np.where(same, 0.0, np.abs(a64 - b64))
            past = ~same & ~(moved <= allowed)
            if past.any():
                i = int(np.argmax(np.where(past, np.nan_to_num(moved, nan=np.inf) / np.maximum(allowed, 1e-300), -1)))
                problems.append(
                    f"{key}: {int(past.sum())} of {a.size} values moved past the tolerance (at worst by "
                    f"{moved.flat[i]:.3g}, {allowed.flat[i]:.3g} allowed there)"
                )
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
