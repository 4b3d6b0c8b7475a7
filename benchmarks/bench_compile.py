"""`--compile` (issue 64 item 4): one bridge training step, eager against torch.compile, at the `cpu-small`
protocol's shapes on smollm2-135m's width (D = 576, width 256, depth 4, batch 32 x 63), on this machine's CPU:
the seconds compiling takes (the first steps), the steady step's time each way, and the ratio; the losses of
both over the same steps (their relative gap: the rounding the compiled kernels differ by). A GPU's figure is
what matters for the paper protocol; scripts/gpu_profile.py runs the paper bridge both ways when a GPU is lent.

    python benchmarks/bench_compile.py      # writes benchmarks/results/compile.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save  # noqa: E402
from dihal.stages.configs import BridgeConfig  # noqa: E402
from dihal.stages.diffusion import flow  # noqa: E402
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig  # noqa: E402

D, BATCH, TOKENS, STEPS, WARM = 576, 32, 63, 30, 5


def run(compiled: bool) -> dict:
    cfg = BridgeConfig.from_protocol("cpu-small", layer=1)
    torch.manual_seed(0)
    net = Denoiser(DenoiserConfig(dim=D, width=cfg.width, depth=cfg.depth, heads=cfg.heads, max_len=TOKENS))
    model = torch.compile(net) if compiled else net
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(1)
    y, c = torch.randn(BATCH, TOKENS, D, generator=gen), torch.randn(BATCH, TOKENS, D, generator=gen)
    times, losses = [], []
    for _ in range(STEPS):
        t, eps = torch.rand(BATCH, generator=gen), torch.randn(BATCH, TOKENS, D, generator=gen)
        began = time.perf_counter()
        out = model(flow.noisy(y, eps, t), t, c)
        loss = ((out.float() - y) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
        losses.append(float(loss))
    return {
        "first_steps_s": round(sum(times[:WARM]), 2),
        "step_ms": 1000 * statistics.median(times[WARM:]),
        "losses": losses,
    }


def main() -> None:
    eager, compiled = run(False), run(True)
    gap = max(abs(a - b) / abs(a) for a, b in zip(eager["losses"], compiled["losses"]))
    save(
        "compile",
        {
            "shape": {"dim": D, "batch": BATCH, "tokens": TOKENS, "protocol": "cpu-small", "steps": STEPS},
            "eager_step_ms": round(eager["step_ms"], 1),
            "compiled_step_ms": round(compiled["step_ms"], 1),
            "compiled_over_eager": round(compiled["step_ms"] / eager["step_ms"], 3),
            "first_steps_s": {"eager": eager["first_steps_s"], "compiled": compiled["first_steps_s"]},
            "largest_relative_loss_gap": gap,
        },
    )


if __name__ == "__main__":
    main()
