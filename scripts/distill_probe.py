"""Distillation through the upper blocks, a probe (issue 66; docs/results/hybrid_generation.md, "Distillation
through the upper blocks"): fine-tune a trained bridge on KL(original || hybrid) of the next-token distributions,
mean over positions 1.. of the extract's training rows (fidelity's direction and positions), the gradient taken
through the frozen upper blocks and LM head and through the sampler as generation runs it (noise 0, --sample-steps
Euler steps). AdamW, a linear warm-up, gradient clipping, no EMA; the rows in a seeded order, each seen at most
once per pass. It writes the fine-tuned weights to --out; `hybrid_study.py --weights FILE` reads the bridge with
them. Nothing goes into the store: a probe, not a stage (its verdict on the page above: screened out).

    python scripts/distill_probe.py --bridge 29a432418e75 --root runs/full-own --out runs/distilled.safetensors
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dihal.artifacts import files
from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore
from dihal.stages.lineage import backbone_for
from dihal.stages.lm.capture import hidden_states
from dihal.stages.lm.hybrid import lm_logits, suffix_hidden, suffix_model
from dihal.stages.parts.bridge import Bridge


def kl_loss(model, suffix, bridge: Bridge, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Mean KL(original || hybrid) over rows and positions 1..T-2 of ids (B, T), the bridge sampled at noise 0; the
    gradient reaches the bridge's network alone."""
    with torch.no_grad():
        p = lm_logits(model, model.model(input_ids=ids, use_cache=False).last_hidden_state)
        h0 = hidden_states(model, ids, [0])[0]
    h = bridge.sample(h0, steps, torch.zeros(h0.shape[0], h0.shape[1] - bridge.start, h0.shape[2], device=h0.device))
    q = lm_logits(suffix, suffix_hidden(suffix, h))
    lp, lq = F.log_softmax(p[:, 1:-1].float(), -1), F.log_softmax(q[:, 1:-1].float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()


def distill(
    model,
    suffix,
    bridge: Bridge,
    rows: np.ndarray,
    *,
    steps: int,
    lr: float,
    batch: int,
    sample_steps: int = 8,
    warmup: int = 10,
    clip: float = 1.0,
    seed: int = 0,
    log=print,
) -> list[float]:
    """Fine-tune bridge.net in place on rows (N, T) of token ids; returns each step's loss."""
    for p in [*model.parameters(), *suffix.parameters()]:
        p.requires_grad_(False)
    net = bridge.net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    order = np.random.default_rng(seed).permutation(len(rows))
    losses, began = [], time.time()
    for s in range(steps):
        first = (s * batch) % len(order)
        ids = torch.as_tensor(rows[np.sort(order[first : first + batch])], dtype=torch.long)
        loss = kl_loss(model, suffix, bridge, ids, sample_steps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (s + 1) / max(1, warmup))
        opt.step()
        losses.append(float(loss.detach()))
        if s % 10 == 0 or s == steps - 1:
            log(f"step {s}: KL {np.mean(losses[-10:]):.4f} (last 10), {time.time() - began:.0f} s")
    bridge.net.eval()
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bridge", required=True)
    p.add_argument("--root", default=None)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sample-steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    store = ArtifactStore(a.root or os.environ.get("DIHAL_ROOT", "runs"))
    art = store.load("bridge", a.bridge)
    group = hs.open_group(store.load("extract", art.manifest["parents"]["extract"]))
    loaded = backbone_for(art, "cpu", "float32")
    bridge = Bridge.load(art)
    suffix = suffix_model(loaded.model, bridge.layer)
    rows = np.asarray(group["input_ids"])[hs.split_indices(group, "train")]
    distill(
        loaded.model, suffix, bridge, rows, steps=a.steps, lr=a.lr, batch=a.batch_size,
        sample_steps=a.sample_steps, seed=a.seed,
    )  # fmt: skip
    files.save_tensors(Path(a.out), {k: v.detach().contiguous() for k, v in bridge.net.state_dict().items()})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
