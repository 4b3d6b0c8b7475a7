"""What --keep-weights ema-bfloat16 does to a trained bridge's fidelity (issue 64's disk): the same bridge's
EMA weights as kept in float32 and rounded to bfloat16 (stages/diffusion/trainer.kept), each loaded into the
float32 network, scored teacher forced on its extract's validation split with the same noise (8 Euler steps,
stages/fidelity.evaluate_fidelity).

    DIHAL_ROOT=runs/full-own python benchmarks/bench_kept_weights.py --bridge e68cdb2cc17b
    # writes benchmarks/results/kept_weights.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save  # noqa: E402
from dihal.artifacts.store import ArtifactStore  # noqa: E402
from dihal.stages.diffusion.trainer import kept  # noqa: E402
from dihal.stages.evaluate import validation_ids  # noqa: E402
from dihal.stages.fidelity import evaluate_fidelity  # noqa: E402
from dihal.stages.lineage import backbone_for  # noqa: E402
from dihal.stages.parts.bridge import Bridge  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bridge", required=True)
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    store = ArtifactStore(os.environ.get("DIHAL_ROOT", "runs"))
    art = store.resolve(a.bridge, "bridge")
    extract = store.load("extract", art.manifest["parents"]["extract"])
    loaded = backbone_for(art, "cpu", "float32")
    ids = validation_ids(extract, a.limit)
    bridge = Bridge.load(art, "cpu")
    float32 = {k: v.clone() for k, v in bridge.net.state_dict().items()}
    rows = {}
    for name, weights in (("float32", float32), ("bfloat16", kept(float32, "ema-bfloat16"))):
        bridge.net.load_state_dict(weights)
        totals = evaluate_fidelity(loaded.model, bridge, ids, [a.steps], seed=0)
        rows[name] = {k: round(v, 6) for k, v in totals[a.steps].metrics().items()}
    change = {k: round(rows["bfloat16"][k] / rows["float32"][k] - 1, 6) for k in rows["float32"]}
    save(
        "kept_weights",
        {
            "bridge": art.id,
            "sequences": int(ids.shape[0]),
            "steps": a.steps,
            "fidelity": rows,
            "relative_change": change,
        },
    )


if __name__ == "__main__":
    main()
