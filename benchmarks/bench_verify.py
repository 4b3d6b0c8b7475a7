"""What verified reads cost per stage (issue 45): the main job's chain on smollm2-135m (384 sequences of
64 tokens, every layer; a 300-step bridge at layer 1), each stage timed with every read checked against
the manifest's sha256 ("on", what dihal does) and with the checks patched out ("off"), in fresh
processes and empty stores, the two modes alternating. Also the bytes each stage hashed to verify.

python benchmarks/bench_verify.py            # writes benchmarks/results/verify.json and verify.md
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, save  # noqa: E402

STAGES = [
    ("extract", ["extract", "--model", "smollm2-135m", "--max-sequences", "384", "--device", "cpu"]),
    ("score", ["score", "--extract", "latest"]),
    (
        "train-bridge",
        ["train-bridge", "--layer", "1", "--extract", "latest", "--train-steps", "300", "--device", "cpu"],
    ),
    ("evaluate", ["evaluate", "--bridge", "latest", "--sample-steps", "8", "--device", "cpu"]),
    (
        "generate",
        ["generate", "--bridge", "latest", "--num-samples", "16", "--max-new-tokens", "48", "--device", "cpu"],
    ),
]

CHILD = r"""
import json, sys, time
from dihal.artifacts import hidden_states as hs, store as st
mode, root, stages = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
hashed = {"bytes": 0, "seconds": 0.0}
real_check, real_get = st.check_file, hs.VerifiedStore.get
def counted_check(path, entry, where):
    seen = st.file_state(path, path.stat())
    hashed["bytes"] += entry["bytes"] if st._VERIFIED.get(seen) != entry["sha256"] else 0
    start = time.perf_counter()
    try:
        return real_check(path, entry, where)
    finally:
        hashed["seconds"] += time.perf_counter() - start
async def counted_get(self, key, prototype=None, byte_range=None):
    entry = self._recorded.get(key)
    if entry is not None:
        p = __import__("pathlib").Path(self._store.root) / key
        if st._VERIFIED.get(st.file_state(p, p.stat())) != entry["sha256"]:
            hashed["bytes"] += entry["bytes"]
            start = time.perf_counter()  # its first read, hashed: an upper bound on what checking it costs
            try:
                return await real_get(self, key, prototype, byte_range)
            finally:
                hashed["seconds"] += time.perf_counter() - start
    return await real_get(self, key, prototype, byte_range)
async def plain_get(self, key, prototype=None, byte_range=None):
    return await self._store.get(key, prototype, byte_range)
if mode == "on":
    st.check_file, hs.VerifiedStore.get = counted_check, counted_get
else:
    st.check_file, hs.VerifiedStore.get = (lambda *a: None), plain_get
from dihal.cli.main import app
out = {}
for name, args in stages:
    hashed["bytes"], hashed["seconds"] = 0, 0.0
    start = time.perf_counter()
    try:
        app([*args, "--root", root], prog_name="dihal", standalone_mode=False)
    except SystemExit as exc:
        assert not exc.code, (name, exc.code)
    out[name] = {"seconds": time.perf_counter() - start, "hashed_mib": hashed["bytes"] / 2**20,
                 "verify_s": hashed["seconds"]}
print("RESULT " + json.dumps(out))
"""


def run(mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(Path(tmp) / "runs"), json.dumps(STAGES)],
            capture_output=True,
            text=True,
            check=True,
        )
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    start = time.time()
    off, on = run("off"), run("on")  # one pair: the whole chain each, cold stores
    rows = []
    for name, _ in STAGES:
        a, b = on[name]["seconds"], off[name]["seconds"]
        rows.append(
            {
                "stage": name,
                "verified_s": round(a, 2),
                "unverified_s": round(b, 2),
                "ratio": round(a / b, 3),
                "hashed_mib": round(on[name]["hashed_mib"], 1),
                "verify_s": round(on[name]["verify_s"], 2),
                "verify_share": round(on[name]["verify_s"] / a, 4),
            }
        )
    save("verify", {"rows": rows, "wall_s": round(time.time() - start)})
    lines = [
        "# Verified reads: what they cost (benchmarks/bench_verify.py)",
        "",
        "smollm2-135m, the main job's sizes, one run of each mode in a fresh process and store (the",
        "stages' own times include their model loads). ratio = verified / unverified wall time, one pair, so",
        "it carries the machine's run-to-run noise (a few percent: extract and generate hash nothing they",
        "read); hashed MiB = bytes a stage read from complete artifacts and checked first (once per",
        "process); verify s = time inside those checks (a file's hash; a chunk's first read and hash, an",
        "upper bound), measured in the verified run, and its share of the stage's wall time.",
        "",
        "| stage | verified s | unverified s | ratio | hashed MiB | verify s | share |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {r['stage']} | {r['verified_s']} | {r['unverified_s']} | {r['ratio']} | {r['hashed_mib']} | "
            f"{r['verify_s']} | {100 * r['verify_share']:.1f}% |"
            for r in rows
        ],
        "",
    ]
    (RESULTS / "verify.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
