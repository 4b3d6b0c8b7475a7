"""How fast a trainer's reads come out of an extract's layout (issue 47's GPU run found bridge training bound
by them): zarr's `oindex` over whole chunks, scattered or contiguous, against one contiguous slice of the same
number of rows, on an uncompressed float16 array chunked as artifacts/hidden_states.py writes it (8 sequences
per chunk), here with smollm2-135m's width (64 x 576) and the paper's (128 x 4096). Also the host's float16 ->
float32 conversion of one batch, which the bridge's loss does before moving it to the device. One run, best of 3.

    python benchmarks/bench_store_read.py        # writes benchmarks/results/store_read.json
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import zarr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, save  # noqa: E402

CHUNK, ROWS, REPEATS = 8, 256, 3


def rate(fn) -> float:
    """MB/s of the best of REPEATS calls."""
    best, nbytes = float("inf"), 0
    for _ in range(REPEATS):
        with Timer() as t:
            nbytes = fn().nbytes
        best = min(best, t.seconds)
    return round(nbytes / best / 1e6, 1)


def shape_row(n: int, seq: int, width: int, tmp: Path) -> dict:
    arr = zarr.create_array(
        tmp / f"{seq}x{width}.zarr",
        shape=(n, seq, width),
        chunks=(CHUNK, seq, width),
        dtype="float16",
        compressors=None,
    )
    rng = np.random.default_rng(0)
    for s in range(0, n, 64):
        arr[s : s + 64] = rng.standard_normal((min(64, n - s), seq, width)).astype(np.float16)
    chunks = rng.permutation(n // CHUNK)[: ROWS // CHUNK]  # whole chunks in a permuted order: the Loader's reads
    whole = np.sort((chunks[:, None] * CHUNK + np.arange(CHUNK)).ravel())
    scattered = np.sort(rng.choice(n, ROWS, replace=False))
    batch = rng.standard_normal((64, seq - 1, width)).astype(np.float16)
    with Timer() as t:
        batch.astype(np.float32)
    return {
        "shape": [n, seq, width],
        "oindex_whole_chunks_mb_s": rate(lambda: arr.oindex[whole]),
        "oindex_scattered_rows_mb_s": rate(lambda: arr.oindex[scattered]),
        "oindex_contiguous_mb_s": rate(lambda: arr.oindex[np.arange(ROWS)]),
        "slice_contiguous_mb_s": rate(lambda: arr[0:ROWS]),
        "float32_conversion_s_per_batch_of_64": round(t.seconds, 4),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = [shape_row(1024, 64, 576, Path(tmp)), shape_row(512, 128, 4096, Path(tmp))]
    save("store_read", {"rows_read": ROWS, "chunk_sequences": CHUNK, "zarr": zarr.__version__, "rows": rows})


if __name__ == "__main__":
    main()
