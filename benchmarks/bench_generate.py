"""Per-token latency of hybrid AR generation against the backbone's own generation (issue 5)
and bridge training tokens/s (issue 4), smollm2-135m on CPU, one run.

    python benchmarks/bench_generate.py [BRIDGE_ID]   # writes benchmarks/results/generate.json
Without BRIDGE_ID a 3-step bridge of the cpu-small architecture at layer 3 is trained first
(latency does not depend on what the weights learned).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, save, store  # noqa: E402
from dihal.stages import extract as ex  # noqa: E402
from dihal.stages import generate as gen  # noqa: E402
from dihal.stages import train_bridge as bstage  # noqa: E402
from dihal.stages.lm.models import load_model  # noqa: E402
from dihal.stages.parts.bridge import Bridge  # noqa: E402
from dihal.stages.text.data import DataConfig  # noqa: E402

NEW_TOKENS, BATCH, REPEATS = 48, 1, 2


def main() -> None:
    s = store()
    loaded = load_model("smollm2-135m", "cpu", "float32")
    if len(sys.argv) > 1:
        art = s.resolve(sys.argv[1], "bridge")
    else:
        extract = ex.run(
            ex.ExtractConfig(layers="0,3", data=DataConfig(max_sequences=400, seq_len=64)), s, loaded=loaded
        )
        art = bstage.run(bstage.BridgeConfig.from_protocol("cpu-small", layer=3, steps=30, eval_every=30), extract, s)
    bridge = Bridge.load(art)
    suffix = gen.suffix_model(loaded.model, bridge.layer)
    prefix = torch.tensor([gen.prompt_ids(loaded.tokenizer, "The")] * BATCH)
    cfg = gen.GenerateConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.95)

    def per_token_ms(fn) -> float:
        fn()  # warm-up
        best = float("inf")
        for _ in range(REPEATS):
            with Timer() as t:
                fn()
            best = min(best, t.seconds)
        return 1000 * best / NEW_TOKENS

    g = lambda: torch.Generator().manual_seed(0)
    result = {
        "backbone_loop_ms": per_token_ms(lambda: gen.generate_original(loaded, prefix, cfg, g())),
        "backbone_hf_generate_ms": per_token_ms(
            lambda: loaded.model.generate(
                prefix, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True, top_p=0.95
            )
        ),
    }
    for steps in (4, 8, 16):
        c = replace(cfg, sample_steps=steps)
        result[f"hybrid_{steps}_steps_ms"] = per_token_ms(
            lambda c=c: gen.generate_hybrid(loaded, bridge, suffix, prefix, c, g())
        )
    result["hybrid_8_steps_uncached_ms"] = per_token_ms(
        lambda: gen.generate_hybrid(loaded, bridge, suffix, prefix, replace(cfg, sample_steps=8, cache=False), g())
    )
    result["ratio_8_steps_vs_backbone_hf_generate"] = result["hybrid_8_steps_ms"] / result["backbone_hf_generate_ms"]
    result["bridge_train_tokens_per_s"] = art.manifest["metrics"]["train_tokens_per_s"]
    save(
        "generate",
        {
            "model": "smollm2-135m",
            "layer": bridge.layer,
            "bridge": art.id,
            "batch": BATCH,
            "new_tokens": NEW_TOKENS,
            "per_token_latency": result,
        },
    )


if __name__ == "__main__":
    main()
