"""Token recoveries of docs/method.md section 5: each maps prior samples e (B, T', D), normalized,
at positions 1..T' to T' tokens.

    rounding  token_i = the vocabulary entry whose normalized embedding is nearest to e_i (L2)
    decoder   the CoDAR decoder, greedy (stages/decoder.py)
    hidden    the bridge conditioned on e gives h_l (position 0: the stored start-token state);
              the upper blocks, final norm and LM head give logits at positions 0..T'-1, and
              token_{i+1} = argmax logits_i
    direct    DiHAL-direct: the prior's samples are normalized h_l themselves; unnormalized, with
              the start-token state in front, they go through the upper blocks as in `hidden`
"""

from __future__ import annotations

import torch

from dihal.stages.bridge import Bridge
from dihal.stages.lm.capture import hidden_states
from dihal.stages.lm.hybrid import lm_logits, suffix_hidden, suffix_model
from dihal.stages.prior import nearest


@torch.no_grad()
def embedding_table(model, batch: int = 4096) -> torch.Tensor:
    """(V, D) layer-0 state of every vocabulary entry (the embedding with any model-specific scaling,
    as the extract stores it), read through the same hook as extraction."""
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    rows = [
        hidden_states(model, torch.arange(s, min(s + batch, vocab), device=device)[:, None], [0])[0][:, 0]
        for s in range(0, vocab, batch)
    ]
    return torch.cat(rows).float()


def rounding(e: torch.Tensor, table_norm: torch.Tensor) -> torch.Tensor:
    return nearest(e, table_norm)


@torch.no_grad()
def upper_argmax(model, suffix, h: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """h (B, T'+1, D) layer-l states at positions 0..T' -> (B, T') tokens: argmax of logits 0..T'-1."""
    hidden = suffix_hidden(suffix, h[:, :-1])
    span = max(1, rows // h.shape[0])
    return torch.cat(
        [lm_logits(model, hidden[:, s : s + span]).argmax(-1) for s in range(0, hidden.shape[1], span)], dim=1
    )


def hidden(model, suffix, bridge: Bridge, e: torch.Tensor, steps: int, seed: int, first: int = 0) -> torch.Tensor:
    """The bridge's noise for sample i depends on (seed, first + i) only."""
    noise = torch.stack(
        [
            torch.randn(
                e.shape[1], e.shape[2], generator=torch.Generator().manual_seed(seed * 1_000_003 + 500_009 + first + i)
            )
            for i in range(e.shape[0])
        ]
    ).to(e.device)
    return upper_argmax(model, suffix, bridge.sample_condition(e, steps, noise))


def direct(model, suffix, y: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor, pos0: torch.Tensor) -> torch.Tensor:
    h = torch.cat([pos0.expand(y.shape[0], 1, -1), y * sigma + mu], dim=1)
    return upper_argmax(model, suffix, h)


# -- the recoveries as stages/registry.py's RECOVERIES name them ---------------------------------------
# Each is built once per generation as Class(loaded, prior, part, cfg, table) -- table() gives the
# normalized embedding table, computed once -- and maps a block of prior samples to tokens.
class Rounding:
    def __init__(self, loaded, prior, part, cfg, table):
        self.table = table()

    def tokens(self, block: torch.Tensor, first: int) -> torch.Tensor:
        return rounding(block, self.table)


class DecoderRecovery:
    def __init__(self, loaded, prior, part, cfg, table):
        from dihal.stages.decoder import Decoder

        self.decoder = Decoder.load(part, cfg.device)

    def tokens(self, block: torch.Tensor, first: int) -> torch.Tensor:
        return self.decoder.tokens(block)


class Hidden:
    """Through a bridge when one is given; without one the prior models h_l itself (DiHAL-direct)."""

    def __init__(self, loaded, prior, part, cfg, table):
        self.model, self.prior, self.cfg = loaded.model, prior, cfg
        self.bridge = Bridge.load(part, cfg.device) if part is not None else None
        self.suffix = suffix_model(loaded.model, self.bridge.layer if self.bridge is not None else prior.layer)

    def tokens(self, block: torch.Tensor, first: int) -> torch.Tensor:
        if self.bridge is not None:
            return hidden(self.model, self.suffix, self.bridge, block, self.cfg.sample_steps, self.cfg.seed, first)
        p = self.prior
        return direct(self.model, self.suffix, block, p.mu, p.sigma, p.norm.pos0)
