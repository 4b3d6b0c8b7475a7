"""What dihal's own proxies (r2_token, r2_context) cost `dihal score`, before and after their folds
shared their Grams (issue 49), in one run.

Two extracts: every layer of smollm2-135m (256 sequences x 64 tokens, with its pool; 29 candidate
layers, D = 576), and a random one at D = 4096 (the width of the paper's 8B models; 256 x 64 tokens,
layers 0..4 of structured random states: each layer a random function of the token's embedding and
its predecessor's, plus noise). Three ways, each in a fresh process, alternating, REPEATS times:

    without  the code of commit AFTER with the paper's proxies and the spectrum statistics alone
    before   the code of commit BEFORE (the 5-fold rule with one Gram and one eigenbasis per fit, each
             computed from its own rows), every proxy
    after    the code of commit AFTER (default HEAD: the folds' Grams from the whole's), every proxy

Each commit runs from a git worktree of its own, so the working tree may change while this runs.
The figures are the median seconds, their ratios, and the largest difference between before's and
after's tables in any proxy (the rule and the numbers are meant to be the same).

    python benchmarks/bench_proxies.py [--before COMMIT] [--after COMMIT]   # writes benchmarks/results/proxies.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import HERE, save  # noqa: E402

ROOT = HERE.parent
BEFORE = "bc6e390"  # the last commit whose folds computed their own Grams
REPEATS = {"smollm2-135m": 3, "random D=4096": 1}
WAYS = ("without", "before", "after")
WIDE = dict(n_seq=256, seq_len=64, width=4096, blocks=5, vocab=2000)


def smollm2_extract() -> Path:
    from benchmarks.common import store
    from dihal.stages import extract as ex
    from dihal.stages.configs import DataConfig, ExtractConfig

    return ex.run(ExtractConfig(model="smollm2-135m", data=DataConfig(max_sequences=256)), store()).path


def random_extract() -> Path:
    """Layers 0..blocks-1 of random states at D = 4096: h_0 the embedding of Zipf-distributed tokens,
    h_l = a_l h_0 + b_l (h_0 of the token before) + c_l tanh(h_0 P_l) + noise (float32, no pool)."""
    from dihal.artifacts import hidden_states as hs

    path = HERE / ".runs" / "random-4096" / "hidden.zarr"
    if (path / "zarr.json").exists():
        return path.parent
    n, t, d, blocks = WIDE["n_seq"], WIDE["seq_len"], WIDE["width"], WIDE["blocks"]
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, size=(n, t)) - 1, WIDE["vocab"] - 1).astype(np.int32)
    table = rng.normal(size=(WIDE["vocab"], d)).astype(np.float32)
    h0 = table[ids]
    before = np.concatenate([np.zeros_like(h0[:, :1]), h0[:, :-1]], axis=1)
    group = hs.create(
        path,
        layers=list(range(blocks)),
        n_seq=n,
        seq_len=t,
        width=d,
        dtypes=dict.fromkeys(range(blocks), "float32"),
        chunk_seqs=16,
        attrs={"num_blocks": blocks, "model": "random", "seq_len": t},
    )
    group["layers/0"][:] = h0
    for layer in range(1, blocks):
        mix = rng.normal(size=(d, d)).astype(np.float32) / np.sqrt(d)
        a, b, c = 1.0 / layer, 0.5 * layer / blocks, 0.5
        states = a * h0 + b * before + c * np.tanh(h0.reshape(-1, d) @ mix).reshape(h0.shape)
        group[f"layers/{layer}"][:] = states + rng.normal(scale=0.3, size=states.shape).astype(np.float32)
    group["input_ids"][:] = ids
    group["attention_mask"][:] = 1
    group["split"][:] = (rng.random(n) < 0.1).astype(np.int8)
    group["committed"][:] = True
    return path.parent


def shim(commit: str) -> Path:
    """A directory whose `dihal` package is the tree of `commit` (the layout of pyproject's package-dir)."""
    out = Path(tempfile.mkdtemp(prefix="dihal-before-"))
    tree = out / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True)
    package = out / "path" / "dihal"
    package.mkdir(parents=True)
    for f in (tree / "dihal_cli" / "python").iterdir():
        (package / f.name).symlink_to(f)
    for name, src in (("cli", "dihal_cli"), ("stages", "stages"), ("artifacts", "artifacts")):
        (package / name).symlink_to(tree / src)
    return out


def worker(way: str, extract: str, table: str) -> None:
    """One score of every candidate layer, printed as seconds; its table written to `table`."""
    from types import SimpleNamespace

    from dihal.artifacts import hidden_states as hs
    from dihal.artifacts.store import ArtifactStore
    from dihal.stages import registry
    from dihal.stages import score as sc
    from dihal.stages.configs import ScoreConfig
    from dihal.stages.runtime.progress import NullProgress

    path = Path(extract)
    if (path / "manifest.json").exists():  # a stored extract, read verified as `dihal score` reads it
        group = hs.open_group(ArtifactStore(path.parents[1]).resolve(path.name, "extract"))
    else:
        group = hs.open_group(SimpleNamespace(path=path, manifest={}, complete=False))
    layers = list(range(1, int(group.attrs["num_blocks"])))
    if way == "without":
        for name in [k for k, p in registry.PROXIES.items() if p.embeddings]:
            registry.PROXIES.pop(name)
    start = time.perf_counter()
    result, *_ = sc.score_layers(group, ScoreConfig(), layers, NullProgress())
    seconds = time.perf_counter() - start
    result.to_csv(table, index=False)
    print(json.dumps({"seconds": seconds, "module": sc.__file__}))


def run_way(way: str, extract: Path, table: Path, code: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(code / "path")}
    args = [sys.executable, __file__, "--worker", way, str(extract), str(table)]
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=True, cwd="/")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["module"].startswith(str(code)), result["module"]  # the commit meant
    return result["seconds"]


def largest_difference(a: Path, b: Path) -> dict:
    import pandas as pd

    x, y = pd.read_csv(a).set_index("layer"), pd.read_csv(b).set_index("layer")
    columns = [c for c in x.columns if c in y.columns and x[c].dtype.kind == "f"]
    diff = (x[columns] - y[columns]).abs().max()
    return {"column": str(diff.idxmax()), "value": float(diff.max())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--after", default="HEAD")
    args = parser.parse_args()
    extracts = {"smollm2-135m": smollm2_extract(), "random D=4096": random_extract()}
    after = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.after], capture_output=True, text=True)
    code = {"before": shim(args.before), "after": shim(after.stdout.strip())}
    code["without"] = code["after"]
    out = {"before": args.before, "after": after.stdout.strip(), "cases": {}}
    try:
        for case, extract in extracts.items():
            times = {way: [] for way in WAYS}
            tables = {way: code["after"] / f"{way}.csv" for way in WAYS}
            for _ in range(REPEATS[case]):
                for way in WAYS:
                    times[way].append(run_way(way, extract, tables[way], code[way]))
                    print(case, way, round(times[way][-1], 1), flush=True)
            median = {way: statistics.median(t) for way, t in times.items()}
            layers = len(__import__("pandas").read_csv(tables["after"]))
            out["cases"][case] = {
                "layers": layers,
                "seconds": {way: [round(t, 1) for t in v] for way, v in times.items()},
                "median_seconds": {way: round(v, 1) for way, v in median.items()},
                "ratio_before_to_without": round(median["before"] / median["without"], 3),
                "ratio_after_to_without": round(median["after"] / median["without"], 3),
                "ratio_after_to_before": round(median["after"] / median["before"], 3),
                "largest_proxy_difference_before_after": largest_difference(tables["before"], tables["after"]),
            }
    finally:
        for tree in {code["before"], code["after"]}:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree / "tree")], check=False)
    save("proxies", out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:5])
    else:
        main()
