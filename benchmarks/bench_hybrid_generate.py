"""transformers' own generate on the hybrid's cache against the hybrid's own loop (stages/generate.py, what
`dihal generate` runs), greedy from the same noise: the same tokens, and new tokens per second of each, for
a batch of 1 and of 8 rows, on CPU, one run (issue 47).

    python benchmarks/bench_hybrid_generate.py ROOT:BRIDGE_ID     # writes benchmarks/results/hybrid_generate.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import GenerationMixin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dihal  # noqa: E402
from benchmarks.common import Timer, save  # noqa: E402
from dihal.stages import generate as gen_stage  # noqa: E402
from dihal.stages.configs import GenerateConfig  # noqa: E402

NEW, REPEATS = 48, 3


def best(fn):
    """(the fastest of REPEATS calls after a warm-up, in seconds; its output)."""
    out = fn()
    times = []
    for _ in range(REPEATS):
        with Timer() as t, torch.no_grad():
            out = fn()
        times.append(t.seconds)
    return min(times), out


def main() -> None:
    root, _, bridge = sys.argv[1].rpartition(":")
    hybrid = dihal.load_hybrid(bridge, root=root)
    result = {"bridge": bridge, "model": hybrid.loaded.identity["name"], "new_tokens": NEW, "rows": []}
    cfg = GenerateConfig(max_new_tokens=NEW, temperature=0.0, sample_steps=hybrid.config.steps)
    for batch in (1, 8):
        prompt = torch.full((batch, 1), hybrid.start_id)
        noise = hybrid.noise_for(NEW)[None].expand(batch, -1, -1)
        theirs_s, theirs = best(
            lambda prompt=prompt: GenerationMixin.generate(
                hybrid, prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None
            )
        )
        ours_s, ours = best(
            lambda prompt=prompt, noise=noise: gen_stage.generate_hybrid(
                hybrid.loaded, hybrid.bridge, hybrid.suffix, prompt, cfg, None, noise
            )
        )
        result["rows"].append(
            {
                "batch": batch,
                "same_tokens": bool(torch.equal(theirs[:, 1:], ours)),
                "transformers_tokens_per_s": round(batch * NEW / theirs_s, 1),
                "own_loop_tokens_per_s": round(batch * NEW / ours_s, 1),
                "ratio": round(theirs_s / ours_s, 3),
            }
        )
    save("hybrid_generate", result)


if __name__ == "__main__":
    main()
