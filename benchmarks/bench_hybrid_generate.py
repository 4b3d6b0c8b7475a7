"""The hybrid's generation against its backbone's own (issue 65 item 3): new tokens per second of `dihal
generate`'s hybrid loop (stages/generate.generate_hybrid, the bridge's Euler steps cached) and of the
backbone's `transformers` generate, at batch 1, 8 and 32, 16 new tokens after the start token, the same
decoding (sampled, temperature 1, top-p 0.95), smollm2-135m on the CPU, one run, best of 3 after a warm-up.
The hybrid's time per token over the backbone's is the figure: targets at most 1.3x at batch 1 and 1.5x at 32.
(That transformers' own generate on the hybrid writes what this loop writes is tests/test_hybrid_generate.py's.)

    python benchmarks/bench_hybrid_generate.py [ROOT:BRIDGE_ID]   # writes benchmarks/results/hybrid_generate.json
Without a bridge, a 30-step cpu-small bridge at layer 3 is trained first into benchmarks/.runs (speed does not
depend on what the weights learned; its Euler steps are the default's, 8).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_hybrid_forward import best  # noqa: E402  (3 timed calls after a warm-up)
from benchmarks.common import save, store  # noqa: E402
from dihal.artifacts.store import ArtifactStore  # noqa: E402
from dihal.stages import extract as ex  # noqa: E402
from dihal.stages import generate as gen  # noqa: E402
from dihal.stages import train_bridge as bstage  # noqa: E402
from dihal.stages.configs import GenerateConfig  # noqa: E402
from dihal.stages.lm.models import load_model  # noqa: E402
from dihal.stages.parts.bridge import Bridge  # noqa: E402
from dihal.stages.text.data import DataConfig  # noqa: E402

NEW, BATCHES = 16, (1, 8, 32)


def bridge_artifact(loaded):
    if len(sys.argv) > 1:
        root, _, bridge = sys.argv[1].rpartition(":")
        return ArtifactStore(root).resolve(bridge, "bridge")
    s = store()
    extract = ex.run(ex.ExtractConfig(layers="0,3", data=DataConfig(max_sequences=400, seq_len=64)), s, loaded=loaded)
    cfg = bstage.BridgeConfig.from_protocol("cpu-small", layer=3, steps=30, eval_every=30)
    return bstage.run(cfg, extract, s)


def timings(loaded, bridge, batches=BATCHES, new=NEW) -> list[dict]:
    """New tokens per second of the hybrid loop and of the backbone's own generate, per batch, on the backbone's
    device (a GPU's: its own generator, so the bridge's noise and the tokens' draws stay there)."""
    from dihal.stages.runtime import clock

    device = loaded.device
    suffix = gen.suffix_model(loaded.model, bridge.layer)
    cfg = GenerateConfig(max_new_tokens=new, temperature=1.0, top_p=0.95)
    timed = lambda fn: best(lambda: (fn(), clock.now(device)))  # clock.now waits for a GPU's queued work
    rows = []
    for batch in batches:
        prefix = torch.tensor([gen.prompt_ids(loaded.tokenizer, "")] * batch, device=device)
        hybrid_s = timed(
            lambda prefix=prefix: gen.generate_hybrid(
                loaded, bridge, suffix, prefix, cfg, torch.Generator(gen.draw_device(device)).manual_seed(0)
            )
        )
        backbone_s = timed(
            lambda prefix=prefix: loaded.model.generate(
                prefix,
                attention_mask=torch.ones_like(prefix),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                top_p=0.95,
                temperature=1.0,
                top_k=0,
                pad_token_id=loaded.tokenizer.eos_token_id,
            )
        )
        rows.append(
            {
                "batch": batch,
                "hybrid_tokens_per_s": round(batch * new / hybrid_s, 1),
                "backbone_generate_tokens_per_s": round(batch * new / backbone_s, 1),
                "hybrid_over_backbone_time": round(hybrid_s / backbone_s, 3),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    torch.manual_seed(0)
    loaded = load_model("smollm2-135m", "cpu", "float32")
    art = bridge_artifact(loaded)
    bridge = Bridge.load(art)
    rows = timings(loaded, bridge)
    result = {
        "model": "smollm2-135m",
        "bridge": art.id,
        "layer": bridge.layer,
        "sample_steps": GenerateConfig().sample_steps,
        "new_tokens": NEW,
        "decoding": "sampled, temperature 1, top-p 0.95",
        "rows": rows,
        "targets": {"batch 1": "<= 1.3", "batch 32": "<= 1.5"},
    }
    save("hybrid_generate", result)


if __name__ == "__main__":
    main()
