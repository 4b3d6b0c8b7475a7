"""Wall time of one 1x prior per recipe of docs/results/prior.md (issue 52), on 2 cores with nothing else running.

One extract of the comparison's shape (smollm2-135m, pydoc, --seq-len 32, layer 0), then, per recipe, a fresh
`dihal train-prior` of compare-cpu's 200 steps at batch 16 (scripts/reproduce_compare.sh's), each in its own
process and store folder, so nothing is reused: the command's wall time (model load, the table for the
cross-entropy, checkpoints and validation included) and the training loop's seconds per step (the manifest's
tokens/s). Recipes in one run, in order, so their ratios to the plain prior's are the figures to quote.

    python benchmarks/bench_prior_recipes.py [--recipes plain,ce,...]   # writes benchmarks/results/prior_recipes.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import HERE, save  # noqa: E402
from scripts.prior_curve import BASE_STEPS, BATCH, VARIANTS  # noqa: E402

ROOT = HERE / ".runs" / "prior-recipes"
DEFAULT = "plain,sc,shift,ce,sc+shift,sc+ce,shift+ce,sc+shift+ce,ce-low,wide,wide+ce,wide+ce-low"


def dihal(*args: str, root: Path) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dihal.cli", *args, "--root", str(root)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"error: dihal {' '.join(args)} failed:\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    return time.perf_counter() - start, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default=DEFAULT)
    a = ap.parse_args()
    extract = ["extract", "--model", "smollm2-135m", "--dataset", "pydoc", "--seq-len", "32", "--layers", "0"]
    dihal(*extract, "--device", "cpu", root=ROOT)
    cases = {}
    for recipe in a.recipes.split(","):
        scratch = ROOT / "prior"
        shutil.rmtree(scratch, ignore_errors=True)  # every recipe trains from nothing
        args = ["train-prior", "--batch-size", str(BATCH), "--train-steps", str(BASE_STEPS), "--device", "cpu"]
        seconds, _ = dihal(*args, *VARIANTS[recipe], root=ROOT)
        manifest = json.loads(next(scratch.glob("*/manifest.json")).read_text())
        m = manifest["metrics"]
        per_step = m["tokens_seen"] / m["train_tokens_per_s"] / m["steps"]
        cases[recipe] = {
            "flags": " ".join(VARIANTS[recipe]),
            "command_s": round(seconds, 1),
            "s_per_step": round(per_step, 4),
            "parameters": m["parameters"],
        }
        print(recipe, cases[recipe], flush=True)
    plain = cases.get("plain", {}).get("s_per_step")
    for case in cases.values():
        case["per_step_vs_plain"] = round(case["s_per_step"] / plain, 2) if plain else None
    save("prior_recipes", {"steps": BASE_STEPS, "batch": BATCH, "cases": cases})


if __name__ == "__main__":
    main()
