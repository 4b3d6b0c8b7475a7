"""How far the golden chain's numbers move between CPUs (issue 63): the chain of tests/test_golden.py made
once per kernel set torch can pick on this machine (ATEN_CPU_CAPABILITY: default = SSE-era kernels, avx2,
avx512, as other CPUs pick them), each in a fresh process, compared value by value with the committed
records. The largest relative and absolute moves per record and array go to
benchmarks/results/golden_spread.json; tests/golden.py's tolerances are chosen from them.

    python benchmarks/golden_spread.py            # every capability this CPU has
    python benchmarks/golden_spread.py --make DIR # (internal) make the chain into DIR under this process's env
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "golden_spread.json"
CAPABILITIES = ("default", "avx2", "avx512")
# MKL's code paths (MKL_CBWR), which differ between Intel and AMD CPUs of one instruction set
MKL_PATHS = ("AVX2", "AVX512")


def make(folder: Path) -> None:
    import torch

    from tests import conftest
    from tests.test_golden import make_chain

    models = folder / "models"
    dirs = {}
    for kind in ("llama", "gemma3", "qwen3"):
        model, tok = conftest.build_tiny(kind)
        dirs[kind] = models / f"tiny-{kind}0"
        model.save_pretrained(dirs[kind])
        tok.save_pretrained(dirs[kind])
    torch.set_num_threads(1)
    os.environ["DIHAL_ROOT"] = str(folder / "runs")
    make_chain(dirs)


def views(folder: Path) -> dict:
    from dihal.artifacts.store import ArtifactStore
    from tests import golden
    from tests.test_golden import STAGES

    store = ArtifactStore(folder / "runs")
    return {name: golden.view(find(store)) for name, (_, find) in STAGES.items()}


def spread(got: dict, want: dict, record: str) -> dict:
    """Per array that moved: its largest absolute and relative move, how many values moved, and the largest
    move as a share of what tests/golden.py's tolerance allows there (over 1: the golden test fails)."""
    import numpy as np

    from tests import golden

    out = {}
    for key in sorted(set(got) & set(want)):
        if np.asarray(want[key]).dtype.kind in "iub":
            if not np.array_equal(got[key], want[key]):
                out[key] = {"integers_differ": int((np.asarray(got[key]) != np.asarray(want[key])).sum())}
            continue
        allowed = golden.tolerance(key, np.asarray(want[key]), record)
        a, b = np.asarray(got[key], dtype=np.float64), np.asarray(want[key], dtype=np.float64)
        if a.shape != b.shape:
            out[key] = {"shape": [list(a.shape), list(b.shape)]}
            continue
        diff = np.abs(a - b)
        finite = np.isfinite(diff)
        if not finite.any() or not diff[finite].any():
            continue
        rel = diff[finite] / np.maximum(np.abs(b[finite]), 1e-30)
        out[key] = {
            "max_abs": float(diff[finite].max()),
            "max_rel": float(rel.max()),
            "moved": int((diff[finite] > 0).sum()),
            "size": int(a.size),
            "array_scale": float(np.abs(b[finite]).max()),
            "share_of_tolerance": float((diff[finite] / np.maximum(allowed[finite], 1e-300)).max()),
        }
    return out


def main() -> None:
    if sys.argv[1:2] == ["--make"]:
        make(Path(sys.argv[2]))
        return
    import numpy as np
    import torch

    from tests import golden

    have = torch.backends.cpu.get_cpu_capability().lower()
    report = {"cpu": _cpu(), "torch": torch.__version__, "this_cpu_picks": have, "runs": {}}
    kernels = CAPABILITIES[: CAPABILITIES.index(have) + 1 if have in CAPABILITIES else len(CAPABILITIES)]
    settings = {f"aten={k}": {"ATEN_CPU_CAPABILITY": k} for k in kernels}
    settings |= {f"aten=avx2,mkl={m}": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": m} for m in MKL_PATHS}
    for capability, extra in settings.items():
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, **extra, "DIHAL_CACHE": str(Path(tmp) / "cache")}
            proc = subprocess.run([sys.executable, __file__, "--make", tmp], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(proc.stdout[-2000:] + proc.stderr[-3000:])
            made = views(Path(tmp))
        run = {}
        for name, got in made.items():
            _, _, want = golden.read(name)
            moved = spread(got, want, name)
            if moved:
                run[name] = moved
        report["runs"][capability] = run
        worst = {
            n: max(v.get("share_of_tolerance", np.inf if "integers_differ" in v else 0) for v in r.values())
            for n, r in run.items()
        }
        report["worst_share_of_tolerance"] = report.get("worst_share_of_tolerance", {}) | {capability: worst}
        print(capability, json.dumps({n: round(w, 3) for n, w in worst.items()}))
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
