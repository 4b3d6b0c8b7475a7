"""Score speed against a plain reference, memory as n grows, and the ranked tables (issue 3).

    python benchmarks/bench_score.py       # writes benchmarks/results/score.json

All 31 layers of smollm2-135m, n = 4096, D = 576, k = 64: the whole `dihal score` command is timed
in a fresh process (start-up, reads, every layer, tables and plot). The plain reference
(scikit-learn neighbours, one D x D covariance eigendecomposition per point) is timed on the
REF_LAYERS layer(s) in the same run and compared per layer. Peak memory and time of the
neighbourhood search are measured in child processes at n = 4096, 16,384 and 50,000.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import HERE, Timer, peak_rss_mib, save, store  # noqa: E402
from dihal.artifacts import hidden_states as hs  # noqa: E402
from dihal.stages import extract as ex  # noqa: E402
from dihal.stages import score as sc  # noqa: E402
from dihal.stages.runtime.allocator import keep_freed_memory  # noqa: E402
from dihal.stages.runtime.progress import NullProgress  # noqa: E402
from dihal.stages.text.data import DataConfig  # noqa: E402

REF_LAYERS = (3,)
MEMORY_SIZES = (4096, 16384, 50000)


def memory_child(n: int) -> None:
    """One neighbourhood search on synthetic states (D = 576, k = 64): prints seconds and peak RSS."""
    x = torch.randn(n, 576, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    before = peak_rss_mib()
    start = time.perf_counter()
    sc.local_lambda_max(x, 64)
    print(time.perf_counter() - start, before, peak_rss_mib())


def memory_by_n() -> dict:
    out = {}
    for n in MEMORY_SIZES:
        res = subprocess.run([sys.executable, __file__, "--memory", str(n)], capture_output=True, text=True, check=True)
        seconds, before, peak = res.stdout.split()
        out[n] = {
            "seconds": float(seconds),
            "input_mib": n * 576 * 8 / 2**20,
            "peak_rss_mib": float(peak),
            "rss_before_mib": float(before),
        }
    return out


def whole_command(extract_id: str) -> float:
    """`dihal score` over layers 0..30 in a fresh process, as a user runs it."""
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dihal.cli",
            "score",
            "--root",
            str(HERE / ".runs"),
            "--extract",
            extract_id,
            "--candidates",
            "0-30",
            "--force",
            "--json",
        ],
        check=True,
        capture_output=True,
        cwd=HERE.parent,
    )
    return time.perf_counter() - start


def reference_layer(x: np.ndarray, k: int, eps_rel: float, pairs) -> dict:
    from sklearn.neighbors import NearestNeighbors

    _, idx = NearestNeighbors(n_neighbors=k).fit(x).kneighbors(x)
    inv = [1 / lam for lam in (np.linalg.eigvalsh(np.cov(x[i], rowvar=False))[-1] for i in idx) if lam > 0]
    sigma = np.cov(x, rowvar=False)
    p = np.linalg.inv(sigma + eps_rel * np.trace(sigma) / x.shape[1] * np.eye(x.shape[1]))
    v = x[pairs[0]] - x[pairs[1]]
    v = v[(v * v).sum(1) > 0]
    eig = np.linalg.eigvalsh(sigma)
    return {
        "m_curv": float(np.median(inv)),
        "m_mono": float(np.median(np.einsum("ij,jk,ik->i", v, p, v) / (v * v).sum(1))),
        "k_hat": float(eig.sum() / eig[-1]),
    }


def ranked(model: str, normalize: str) -> dict:
    store_dtype = "float32" if model.startswith("gemma") else "float16"  # gemma3's stream exceeds float16
    art = ex.run(
        ex.ExtractConfig(
            model=model, layers="all", data=DataConfig(max_sequences=1200, seq_len=64), store_dtype=store_dtype
        ),
        store(),
    )
    group = hs.open_group(art.path / "hidden.zarr")
    layers = list(range(1, int(group.attrs["num_blocks"])))
    cfg = sc.ScoreConfig(normalize=normalize)
    with Timer() as t:
        table, seq, pos = sc.score_layers(group, cfg, layers, NullProgress())
    return {
        "seconds": t.seconds,
        "n_layers": len(layers),
        "table": table,
        "group": group,
        "seq": seq,
        "pos": pos,
        "extract_id": art.id,
    }


def main() -> None:
    out = {"n": 4096, "k": 64, "threads": torch.get_num_threads()}
    res = ranked("smollm2-135m", "none")
    group, seq, pos = res["group"], res["seq"], res["pos"]
    out["all_31_layers_seconds"] = whole_command(res["extract_id"])
    pairs = sc.sample_pairs(4096, 8192, 0)
    ref_times, our_times, agree = [], [], []
    for layer in REF_LAYERS:
        x = hs.read_positions(group, layer, seq, pos).astype(np.float64)
        with Timer() as t_ref:
            ref = reference_layer(x, 64, 1e-3, pairs)
        with Timer() as t_ours:
            ours = sc.layer_proxies(torch.from_numpy(x), sc.ScoreConfig(), pairs)
        ref_times.append(t_ref.seconds)
        our_times.append(t_ours.seconds)
        agree.append({k: abs(ours[k] - ref[k]) / abs(ref[k]) for k in ref})
    out["reference_seconds_per_layer"] = float(np.mean(ref_times))
    out["ours_seconds_per_layer"] = float(np.mean(our_times))
    out["speedup"] = out["reference_seconds_per_layer"] / out["ours_seconds_per_layer"]
    out["max_relative_difference_vs_reference"] = max(max(a.values()) for a in agree)
    tables = {}
    for model in ("smollm2-135m", "gemma3-270m"):
        for normalize in ("none", "rms"):
            r = ranked(model, normalize)
            t = r["table"].sort_values("rank")
            tables[f"{model}/{normalize}"] = {
                "l_star": int(t.iloc[0]["layer"]),
                "seconds": r["seconds"],
                "top5": t.head(5)[["layer", "S", "m_curv", "m_mono", "k_hat"]].to_dict("records"),
            }
    out["ranked"] = tables
    out["neighbourhood_search_by_n"] = memory_by_n()
    save("score", out)


if __name__ == "__main__":
    keep_freed_memory()  # as `dihal score` does, before any thread starts
    if len(sys.argv) == 3 and sys.argv[1] == "--memory":
        memory_child(int(sys.argv[2]))
    else:
        main()
