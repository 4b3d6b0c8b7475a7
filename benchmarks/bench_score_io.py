"""What the score reads per layer: the extract's pool against the layer itself (issue 10, item 8).
Same positions both ways (a 4096-position sample of the pool), every layer of an extract.

python benchmarks/bench_score_io.py EXTRACT_DIR     # writes benchmarks/results/score_io.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, save  # noqa: E402
from dihal.artifacts import hidden_states as hs  # noqa: E402


def main() -> None:
    group = hs.open_group(Path(sys.argv[1]) / "hidden.zarr")
    layers = hs.stored_layers(group)[1:-1]
    seqs, positions, _ = hs.read_pool(group, layers[0])
    pick = np.sort(np.random.default_rng([0, 0]).choice(seqs.size, size=4096, replace=False))
    with Timer() as pool:
        for layer in layers:
            from_pool = hs.read_pool(group, layer)[2][pick]
    with Timer() as direct:
        for layer in layers:
            from_layer = hs.read_positions(group, layer, seqs[pick], positions[pick])
    assert np.array_equal(from_pool, from_layer)  # the same states (last layer checked)
    array, pool_array = group[f"layers/{layers[0]}"], group[f"sample/{layers[0]}"]
    touched = np.unique(seqs[pick] // array.chunks[0]).size
    layer_bytes = touched * array.chunks[0] * array.shape[1] * array.shape[2] * array.dtype.itemsize
    save(
        "score_io",
        {
            "extract": sys.argv[1],
            "layers": len(layers),
            "positions": 4096,
            "pool": int(seqs.size),
            "shape": list(array.shape),
            "pool_read_seconds": round(pool.seconds, 2),
            "layer_read_seconds": round(direct.seconds, 2),
            "speedup": round(direct.seconds / pool.seconds, 1),
            "bytes_per_layer_pool": int(np.prod(pool_array.shape) * pool_array.dtype.itemsize),
            "bytes_per_layer_chunks_touched": int(layer_bytes),
        },
    )


if __name__ == "__main__":
    main()
