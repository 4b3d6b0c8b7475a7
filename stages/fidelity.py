"""Bridge fidelity (METHOD §3), teacher forced on held-out sequences.

For each number of sampling steps: relative reconstruction error ||h_hat - h||^2 / ||h - mu||^2,
mean cosine similarity, KL(original || hybrid) of next-token distributions, top-1 agreement,
and the perplexity of the hybrid and of the original, all over positions 1..T-1 (position 0
is the exact BOS state in both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from dihal.stages.lm.hybrid import lm_logits, original_forward, suffix_hidden, suffix_model
from dihal.stages.parts.bridge import Bridge


@dataclass
class FidelityTotals:
    sq_err: float = 0.0
    sq_dev: float = 0.0
    cos_sum: float = 0.0
    kl_sum: float = 0.0
    agree: float = 0.0
    nll_hybrid: float = 0.0
    nll_original: float = 0.0
    positions: int = 0
    targets: int = 0
    by_position: dict = field(default_factory=dict)  # position -> [kl, agreements, count, nll h, nll o, targets]

    def add(self, h_hat, h, mu, logits, hidden_h, hidden_o, ids, rows: int = 256) -> None:
        """logits(hidden) -> float32 logits; taken over slices of positions of about `rows` rows, so
        memory stays O(rows x V) whatever the vocabulary (152k for Qwen3) and sequence length."""
        self.sq_err += float(((h_hat[:, 1:] - h[:, 1:]) ** 2).sum())
        self.sq_dev += float(((h[:, 1:] - mu) ** 2).sum())
        self.cos_sum += float(F.cosine_similarity(h_hat[:, 1:], h[:, 1:], dim=-1).sum())
        b, t = ids.shape
        span = max(1, rows // b)
        for s in range(1, t, span):
            e = min(s + span, t)
            lp_h = F.log_softmax(logits(hidden_h[:, s:e]), -1)
            lp_o = F.log_softmax(logits(hidden_o[:, s:e]), -1)
            kl = (lp_o.exp() * (lp_o - lp_h)).sum(-1).sum(0)  # per position, summed over the batch
            agree = (lp_h.argmax(-1) == lp_o.argmax(-1)).sum(0)
            self.kl_sum += float(kl.sum())
            self.agree += float(agree.sum())
            self.positions += b * (e - s)
            for offset, (k, a) in enumerate(zip(kl.tolist(), agree.tolist())):
                cell = self.by_position.setdefault(s + offset, [0.0, 0.0, 0, 0.0, 0.0, 0])
                cell[0], cell[1], cell[2] = cell[0] + k, cell[1] + a, cell[2] + b
            last = min(e, t - 1)  # position p predicts token p + 1
            if last > s:
                tgt = ids[:, s + 1 : last + 1, None]
                picked_h, picked_o = lp_h[:, : last - s].gather(-1, tgt), lp_o[:, : last - s].gather(-1, tgt)
                self.nll_hybrid -= float(picked_h.sum())
                self.nll_original -= float(picked_o.sum())
                self.targets += tgt.numel()
                nll_h, nll_o = -picked_h[..., 0].sum(0), -picked_o[..., 0].sum(0)  # per position, over the batch
                for offset, (a, o) in enumerate(zip(nll_h.tolist(), nll_o.tolist())):
                    cell = self.by_position[s + offset]
                    cell[3], cell[4], cell[5] = cell[3] + a, cell[4] + o, cell[5] + b

    def metrics(self) -> dict[str, float]:
        ppl_h = float(np.exp(self.nll_hybrid / self.targets))
        ppl_o = float(np.exp(self.nll_original / self.targets))
        return {
            "rel_recon_error": self.sq_err / self.sq_dev,
            "cosine": self.cos_sum / self.positions,
            "kl": self.kl_sum / self.positions,
            "top1_agreement": self.agree / self.positions,
            "ppl_hybrid": ppl_h,
            "ppl_original": ppl_o,
            "ppl_ratio": ppl_h / ppl_o,
        }

    def position_metrics(self) -> list[dict]:
        """KL, top-1 agreement and each model's mean NLL of the next token at each position, over the
        sequences (the last position predicts nothing: its NLLs are NaN)."""
        mean = lambda total, count: total / count if count else float("nan")
        return [
            {"position": p, "kl": k / n, "top1_agreement": a / n, "n": n}
            | {"nll_hybrid": mean(h, m), "nll_original": mean(o, m)}
            for p, (k, a, n, h, o, m) in sorted(self.by_position.items())
        ]


@torch.no_grad()
def evaluate_fidelity(
    model: torch.nn.Module,
    bridge: Bridge,
    input_ids: torch.Tensor | list[torch.Tensor],
    steps_list: list[int],
    batch_size: int = 16,
    seed: int = 0,
    rows: int = 256,
) -> dict[int, FidelityTotals]:
    """{steps: totals} over input_ids (N, T), or a list of such tensors of different lengths T, the
    same noise for every steps value; .metrics() gives the summary and .position_metrics() the same
    per position."""
    suffix = suffix_model(model, bridge.layer)
    device = next(model.parameters()).device
    totals = {s: FidelityTotals() for s in steps_list}
    gen = torch.Generator().manual_seed(seed)
    mu = bridge.norm.mu_y
    groups = input_ids if isinstance(input_ids, list) else [input_ids]
    batches = [group[start : start + batch_size] for group in groups for start in range(0, group.shape[0], batch_size)]
    for ids in batches:
        ids = ids.to(device)
        hidden_o, states = original_forward(model, ids, [0, bridge.layer])
        noise = bridge.noise(ids.shape[0], ids.shape[1], gen)
        for steps in steps_list:
            h_hat = bridge.sample(states[0], steps, noise)
            hidden_h = suffix_hidden(suffix, h_hat)
            head = lambda x: lm_logits(model, x)
            totals[steps].add(h_hat.float(), states[bridge.layer], mu, head, hidden_h, hidden_o, ids, rows)
    return totals
