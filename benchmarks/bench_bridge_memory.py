"""Peak memory of `dihal train-bridge` as the train split grows (issue 10): a synthetic extract of
D = 4096 (an 8B model's width), float16, layers 0 and 1, 1k -> 8k -> 32k sequences of 16 tokens.
The bridge streams its batches and normalizer from the store, so the peak should stay flat.

python benchmarks/bench_bridge_memory.py      # writes benchmarks/results/bridge_memory.json
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, save  # noqa: E402
from dihal.artifacts import hidden_states as hs  # noqa: E402
from dihal.artifacts.store import ArtifactStore  # noqa: E402

WIDTH, SEQ_LEN, CHUNK, N_VAL = 4096, 16, 8, 64
SIZES = (1024, 8192, 32768)
PEAK = (
    "import sys, runpy; from pathlib import Path\n"
    "try:\n    sys.argv = ['dihal'] + sys.argv[1:]; runpy.run_module('dihal.cli', run_name='__main__')\n"
    "finally:\n    hwm = [l for l in Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM')]\n"
    "    print('PEAK_KIB', hwm[0].split()[1], file=sys.stderr)\n"
)


def synthetic_extract(root: Path, n_train: int) -> str:
    """An extract artifact as `dihal extract` writes it, filled with a repeated random pattern."""
    store = ArtifactStore(root)
    n = n_train + N_VAL
    art = store.begin("extract", {"synthetic": n_train, "width": WIDTH}, {})
    group = hs.create(
        art.path / "hidden.zarr",
        [0, 1],
        n,
        SEQ_LEN,
        WIDTH,
        {0: "float16", 1: "float16"},
        CHUNK,
        {"num_blocks": 2, "model": "synthetic"},
    )
    rng = np.random.default_rng(0)
    block = {layer: rng.normal(0, 1 + layer, size=(CHUNK, SEQ_LEN, WIDTH)).astype(np.float16) for layer in (0, 1)}
    ids = np.ones((CHUNK, SEQ_LEN), dtype=np.int32)
    ids[:, 1:] = rng.integers(2, 1000, size=(CHUNK, SEQ_LEN - 1))
    for index, (start, stop) in enumerate(hs.chunk_ranges(n, CHUNK)):
        states = {layer: (block[layer][: stop - start] + np.float16(index % 7)) for layer in (0, 1)}
        hs.write_chunk(group, index, start, states, ids[: stop - start], np.ones_like(ids[: stop - start], np.int8))
    split = np.zeros(n, dtype=np.int8)
    split[n_train:] = 1
    group["split"][:] = split
    art.manifest["metrics"] = {"n_sequences": n, "n_train": n_train, "layers": [0, 1]}
    art.finish()
    return art.id


def main() -> None:
    rows = []
    for n_train in SIZES:
        with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
            with Timer() as made:
                ex_id = synthetic_extract(Path(tmp), n_train)
            args = [
                "train-bridge",
                "--layer",
                "1",
                "--extract",
                ex_id,
                "--protocol",
                "cpu-small",
                "--train-steps",
                "20",
                "--batch-size",
                "8",
                "--width",
                "64",
                "--depth",
                "1",
                "--heads",
                "2",
                "--device",
                "cpu",
                "--root",
                tmp,
            ]
            with Timer() as ran:
                proc = subprocess.run(
                    [sys.executable, "-c", PEAK, *args],
                    capture_output=True,
                    text=True,
                    cwd=Path(__file__).resolve().parents[1],
                )
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            peak = int(proc.stderr.rsplit("PEAK_KIB", 1)[1].split()[0]) / 1024
            size = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file()) / 2**30
            rows.append(
                {
                    "train_sequences": n_train,
                    "store_gib": round(size, 2),
                    "peak_rss_mib": round(peak),
                    "train_bridge_seconds": round(ran.seconds, 1),
                    "make_extract_seconds": round(made.seconds, 1),
                }
            )
            print(rows[-1], flush=True)
            shutil.rmtree(tmp, ignore_errors=True)
    save(
        "bridge_memory",
        {
            "width": WIDTH,
            "seq_len": SEQ_LEN,
            "rows": rows,
            "peak_ratio_largest_to_smallest": rows[-1]["peak_rss_mib"] / rows[0]["peak_rss_mib"],
        },
    )


if __name__ == "__main__":
    main()
