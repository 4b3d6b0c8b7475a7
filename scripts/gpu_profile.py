"""The paper's trained parts on a GPU, profiled (issue 64 item 5): where a step's time goes.

On a random-weight model of Llama-3.1-8B's shape (scripts/make_random_model.py, --layers blocks), one extract
of layers 0 and --layer, then --steps steps of each part below, in this process, each under torch.profiler:

    bridge, store    the paper protocol's bridge (184M parameters at D = 4096) reading h_l from the extract
                     (h_0 from the token ids on the device)
    bridge, compiled the store's bridge under --compile (torch.compile; on a GPU, or with --compiled)
    bridge, model    the same bridge, h_l computed by the backbone's first --layer blocks on the device
                     (`--states model`, issue 64 item 2): no layer read but the token ids
    prior            the paper protocol's prior over h_0
    generation       the bridge's hybrid against the backbone's own generate, 16 new tokens at batch 1, 8, 32
                     (benchmarks/bench_hybrid_generate.py's timings, issue 65 item 3)

One line per part: tokens per second past the first 10 steps (warm-up, and --compile's compiling), the model
FLOP utilisation against the device's bf16 dense peak
(6 x parameters + attention's 12 x depth x T x width FLOPs a token; PEAK_BF16 by device name), the share of the
run spent waiting for data (the Loader's wait, stages/diffusion/trainer.py), the peak memory; then the
profiler's 15 costliest kernels.

    on the GPU machine:   bash scripts/gpu_profile.sh            (carry .whl and .gpu, as gpu_smoke.sh)
    rehearsal on a CPU:   DEVICE=cpu bash scripts/gpu_profile.sh (small blocks; no MFU)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_smoke import Failed, Smoke  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}  # dense TFLOP/s, vendor sheets


def peak_flops(device) -> tuple[float | None, str]:
    import torch

    if torch.device(device).type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in PEAK_BF16.items() if k in name), None), name


def flops_per_token(metrics: dict, cfg, seq_len: int) -> float:
    """6 N for the weights' matmuls (forward and backward) and 12 x depth x T x width for attention's."""
    return 6 * metrics["parameters"] + 12 * cfg.depth * seq_len * cfg.width


STEADY = 9  # tokens per second are counted from the end of this step (warm-up and compiling before it) to the last


def profiled(name: str, run, cfg, extract, store, device: str, seq_len: int) -> dict:
    """Train one part with the profiler over steps 10-19 (after 5 of warm-up); its line's figures."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from dihal.stages.diffusion import trainer

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    real = trainer.Fit.step
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with profile(activities=activities, schedule=schedule(wait=5, warmup=5, active=10)) as prof:
        marks = {}  # the clock at the end of step STEADY and of the last step: the rate past warm-up and compiling

        def step(fit, s):
            row = real(fit, s)
            prof.step()
            if s == STEADY or s + 1 == fit.total:
                if cuda:
                    torch.cuda.synchronize()  # twice a run: the steady rate's two ends
                marks[s] = time.perf_counter()
            return row

        trainer.Fit.step = step
        try:
            start = time.perf_counter()
            art = run(cfg, extract, store, force=True)
            seconds = time.perf_counter() - start
        finally:
            trainer.Fit.step = real
    m = art.manifest["metrics"]
    first, last = min(marks), max(marks)
    whole = m["train_tokens_per_s"]
    rate = m["tokens_seen"] / m["steps"] * (last - first) / (marks[last] - marks[first]) if last > first else whole
    peak, device_name = peak_flops(device)
    train_seconds = m["tokens_seen"] / whole if m.get("tokens_seen") else seconds
    out = {
        "part": name,
        "tokens_per_s": rate,
        "mfu": rate * flops_per_token(m, cfg, seq_len) / peak if peak else None,
        "data_wait_share": m["data_wait_seconds"] / max(train_seconds, 1e-9),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "parameters": m["parameters"],
        "device": device_name,
        "artifact": art,
    }
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    out["kernels"] = prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60)
    return out


def line(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a"
    return (
        f"{r['part']:<16} {r['parameters']:>12,} {r['tokens_per_s']:>11,.0f} {mfu:>7} "
        f"{100 * r['data_wait_share']:>9.1f}% {peak:>9}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=os.environ.get("DIHAL_ROOT", "runs/gpu-profile"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--like", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=4, help="the random model's blocks")
    p.add_argument("--layer", type=int, default=3, help="the bridge's layer")
    p.add_argument("--sequences", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--shrink", default="", help="make_random_model's shrinking flags, for a CPU rehearsal")
    p.add_argument("--recipe", default="", help="overrides of the paper protocol, for a CPU rehearsal")
    p.add_argument("--gen-batches", default="1,8,32", help="the generation benchmark's batches")
    p.add_argument("--gen-tokens", type=int, default=16, help="the generation benchmark's new tokens")
    p.add_argument("--compiled", action="store_true", help="also the store's bridge under --compile (on a GPU always)")
    a = p.parse_args()
    a.shrink, a.models, a.tokens, a.samples, a.paper_steps = a.shrink.split(), a.like, 0, 0, a.steps
    import torch

    from dihal.artifacts.store import ArtifactStore
    from dihal.stages import train_bridge, train_prior
    from dihal.stages.configs import BridgeConfig, PriorConfig

    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_profile: torch sees no GPU; rehearse on the CPU with DEVICE=cpu")
    smoke = Smoke(a)
    precision = "bfloat16" if a.dtype == "bfloat16" else "float32"
    try:
        model = smoke.model(a.like)
        dev = f"--device {a.device} --dtype {a.dtype}"
        extract = smoke.step(
            "extract",
            f"extract --model {model} --layers 0,{a.layer} --max-sequences {a.sequences} --seq-len {a.seq_len} {dev}",
            stage="extract",
        )
    except Failed as exc:
        sys.exit(f"FAILED at {exc}")
    store = ArtifactStore(smoke.root)
    recipe = dict(kv.split("=") for kv in a.recipe.split())
    recipe = {k: int(v) for k, v in recipe.items()}
    common = dict(steps=a.steps, eval_every=a.steps, device=a.device, precision=precision, **recipe)
    bridge = lambda states, **k: BridgeConfig.from_protocol("paper", layer=a.layer, states=states, **common, **k)
    parts = [
        ("bridge, store", train_bridge.run, bridge("store")),
        ("bridge, model", train_bridge.run, bridge("model")),
        ("prior", train_prior.run, PriorConfig.from_protocol("paper", layer=0, **common)),
    ]
    if a.compiled or a.device == "cuda":  # --compile's effect: the first part's steps under torch.compile
        parts.insert(1, ("bridge, compiled", train_bridge.run, bridge("store", compile=True)))
    rows = [profiled(name, run, cfg, extract, store, a.device, a.seq_len) for name, run, cfg in parts]
    print(f"\n{'part':<16} {'parameters':>12} {'tokens/s':>11} {'MFU':>7} {'data wait':>10} {'peak GiB':>9}")
    for r in rows:
        print(line(r))
    print("MFU counts the bridge's FLOPs alone: 'bridge, model' also runs the backbone's first --layer blocks")
    print(f"device: {rows[0]['device']}; MFU against {peak_flops(a.device)[0] or 'no'} bf16 FLOP/s")
    for r in rows:
        print(f"\n== {r['part']}: the 15 costliest kernels over steps 10-19\n{r['kernels']}")
    generation(model, rows[0]["artifact"], a)


def generation(model: str, bridge_art, a) -> None:
    """Issue 65 item 3 on the device: benchmarks/bench_hybrid_generate.py's timings (16 new tokens, batch 1, 8
    and 32, sampled at temperature 1, top-p 0.95) of the hybrid of the bridge just trained against the random
    backbone's own generate. With --layers blocks only, the bridge replaces --layer of them: its share of a
    token's time is larger than under the whole 32-block model's."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_hybrid_generate import timings
    from dihal.stages.lm.models import load_model
    from dihal.stages.parts.bridge import Bridge

    print(
        f"\n== generation: the hybrid of bridge {bridge_art.id} against the backbone's generate, {a.gen_tokens} tokens"
    )
    loaded = load_model(str(model), a.device, a.dtype)
    batches = tuple(int(b) for b in a.gen_batches.split(","))
    rows = timings(loaded, Bridge.load(bridge_art, a.device), batches, a.gen_tokens)
    print(f"{'batch':>5} {'hybrid tok/s':>13} {'backbone tok/s':>15} {'time ratio':>11}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['hybrid_tokens_per_s']:>13,.1f} {r['backbone_generate_tokens_per_s']:>15,.1f} "
            f"{r['hybrid_over_backbone_time']:>11.3f}"
        )
    if torch.device(a.device).type == "cuda":  # --batch-size auto on this card, and what that batch really holds
        from dihal.stages import generate as gen
        from dihal.stages.configs import GenerateConfig
        from dihal.stages.lm.tokens import start_token

        cfg = GenerateConfig(max_new_tokens=a.gen_tokens, num_samples=4096, device=a.device, dtype=a.dtype)
        batch, total = gen.auto_batch(cfg, bridge_art), torch.cuda.get_device_properties(a.device).total_memory
        bridge = Bridge.load(bridge_art, a.device)
        prefix = torch.tensor([[start_token(loaded.tokenizer)[0]]] * batch, device=a.device)
        torch.cuda.reset_peak_memory_stats(a.device)
        try:
            suffix = gen.suffix_model(loaded.model, bridge.layer)
            gen.generate_hybrid(loaded, bridge, suffix, prefix, cfg, gen.draws.stream(0, 0, a.device))
        except torch.OutOfMemoryError:
            print(f"--batch-size auto: {batch} samples ran out of memory: the rule counts too little")
            return
        peak = torch.cuda.max_memory_allocated(a.device)
        print(
            f"--batch-size auto: {batch} samples of {a.gen_tokens} tokens, peak {peak / 2**30:.1f} GiB allocated "
            f"of the card's {total / 2**30:.1f} GiB (the rule's budget {gen.MEMORY_SHARE:.0%})"
        )


if __name__ == "__main__":
    main()
