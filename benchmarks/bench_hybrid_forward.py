"""The hybrid's teacher-forced forward (dihal.load_hybrid, stages/hybrid_lm.py) against the original
backbone's, one batch of 16 x 64 tokens, on each builtin, CPU, one run (issue 38).

    python benchmarks/bench_hybrid_forward.py ROOT:BRIDGE_ID [ROOT:BRIDGE_ID ...]
                                                   # writes benchmarks/results/hybrid_forward.json
A bridge's 8 Euler steps each run its denoiser over the sequence, so the hybrid's forward costs the
denoiser 8 times plus blocks l+1..L; the original runs all L blocks once. Both give float32 logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dihal  # noqa: E402
from benchmarks.common import Timer, save  # noqa: E402

BATCH, TOKENS, REPEATS = 16, 64, 3


def best(fn) -> float:
    """The fastest of REPEATS calls after a warm-up, in seconds."""
    fn()
    times = []
    for _ in range(REPEATS):
        with Timer() as t, torch.no_grad():
            fn()
        times.append(t.seconds)
    return min(times)


def main() -> None:
    result = {"batch": BATCH, "tokens": TOKENS, "repeats": REPEATS, "models": {}}
    for spec in sys.argv[1:]:
        root, _, bridge = spec.rpartition(":")
        hybrid = dihal.load_hybrid(bridge, root=root)
        ids = torch.randint(0, hybrid.config.vocab_size, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
        ids[:, 0] = hybrid.start_id
        hyb = best(lambda h=hybrid, x=ids: h(input_ids=x))
        orig = best(lambda h=hybrid, x=ids: h.backbone(input_ids=x).logits.float())
        name = hybrid.loaded.identity["name"]
        result["models"][name] = {
            "bridge": hybrid.config.bridge,
            "layer": hybrid.config.layer,
            "steps": hybrid.config.steps,
            "hybrid_s": hyb,
            "original_s": orig,
            "hybrid_tok_per_s": BATCH * TOKENS / hyb,
            "original_tok_per_s": BATCH * TOKENS / orig,
            "hybrid_over_original_time": hyb / orig,
        }
    save("hybrid_forward", result)


if __name__ == "__main__":
    main()
