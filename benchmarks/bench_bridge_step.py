"""One bridge training step at the paper protocol's shapes (D = 4096, batch 64 x 127, width 1024,
depth 8), and how much of it is drawing the step's noise (issue 34).

Before, every item drew its t and its 127 x 4096 noise from a CPU generator of its own, and the
loss moved the condition to the device and back. That is still the CPU path (a CPU artifact's id
keeps meaning the same weights); a GPU draws the global batch's noise on the device with one
generator instead. On the CPU this measures the step, the per-item draws (the old path, and the
CPU's now), and one generator drawing the same numbers at once (what the GPU path does, here run
on the CPU): the share of the step each would take. On a GPU, where the step itself is ~100 times
faster, the per-item CPU draws and their host-to-device copy would dominate it.

python benchmarks/bench_bridge_step.py      # writes benchmarks/results/bridge_step.json
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, save  # noqa: E402
from dihal.stages.configs import BridgeConfig  # noqa: E402
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig  # noqa: E402
from dihal.stages.diffusion.draws import DeviceDraws, ItemDraws  # noqa: E402
from dihal.stages.diffusion.normalizer import Normalizer  # noqa: E402
from dihal.stages.train_bridge import BridgeTask  # noqa: E402

D, BATCH, SEQ_LEN, REPEATS = 4096, 64, 128, 3


def main() -> None:
    cfg = BridgeConfig.from_protocol("paper", layer=1, steps=10)
    task = BridgeTask.__new__(BridgeTask)  # the loss alone: the batch comes from memory, not a store
    zeros, ones = torch.zeros(D), torch.ones(D)
    task.cfg, task.start, task.prior = cfg, 1, None
    task.norm = task.on_device = Normalizer(zeros, ones, zeros, ones, zeros)
    rng = np.random.default_rng(0)
    batch = {k: rng.standard_normal((BATCH, SEQ_LEN, D), dtype=np.float32).astype(np.float16) for k in ("c", "y")}
    torch.manual_seed(0)
    net = Denoiser(DenoiserConfig(dim=D, width=cfg.width, depth=cfg.depth, heads=cfg.heads, max_len=SEQ_LEN - 1))
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr)
    slots, device = np.arange(BATCH), torch.device("cpu")

    def draw(kind: str, step: int):
        draws = ItemDraws(0, step, slots) if kind == "per item" else DeviceDraws(0, step, slots, BATCH, device)
        return draws.rand(), draws.randn(SEQ_LEN - 1, D)

    def train_step(step: int) -> None:
        loss = task.loss(net, batch, ItemDraws(0, step, slots), device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    train_step(0)  # warm-up
    steps, noise = [], {"per item": [], "one generator": []}
    for r in range(REPEATS):
        with Timer() as t:
            train_step(r + 1)
        steps.append(t.seconds)
        for kind in noise:
            with Timer() as t:
                draw(kind, r + 1)
            noise[kind].append(t.seconds)
    step_s = statistics.median(steps)
    rows = {}
    for kind, seconds in noise.items():
        median = statistics.median(seconds)
        rows[kind] = {"noise_seconds": round(median, 4), "share_of_step": round(median / step_s, 4)}
    save(
        "bridge_step",
        {
            "shapes": f"D {D}, batch {BATCH} x {SEQ_LEN - 1}, denoiser width {cfg.width} depth {cfg.depth} (paper)",
            "parameters": sum(p.numel() for p in net.parameters()),
            "step_seconds_median": round(step_s, 2),
            "step_seconds": [round(s, 2) for s in steps],
            "noise": rows,
            "note": "median of 3 steps after a warm-up; the step uses the per-item draws, as every CPU run does",
        },
    )


if __name__ == "__main__":
    main()
