"""Token recoveries of docs/method.md section 5: each maps prior samples e (B, T', D), normalized,
at positions 1..T' to T' tokens.

    rounding  token_i = the vocabulary entry whose raw embedding has the highest cosine with the
              de-normalized e_i (deterministic, as in Diffusion-LM and SED)
    decoder   the CoDAR decoder, token by token (stages/decoder.py)
    hidden    the bridge conditioned on e gives h_l (position 0: the stored start-token state);
              the upper blocks, final norm and LM head give logits at positions 0..T'-1, and
              token_{i+1} is decoded from logits_i
    direct    DiHAL-direct: the prior's samples are normalized h_l themselves; unnormalized, with
              the start-token state in front, they go through the upper blocks as in `hidden`

Every recovery but rounding decodes its logits with the one decoding (stages/lm/decoding.py):
--temperature (0 = argmax), --top-p, float64; the draws of sample i depend on (seed, i) only.
"""

from __future__ import annotations

import torch

from dihal.stages.lm import decoding
from dihal.stages.lm.hybrid import lm_logits, suffix_hidden, suffix_model
from dihal.stages.lm.vocab import rounding
from dihal.stages.parts.autoencoder import Autoencoder
from dihal.stages.parts.bridge import Bridge
from dihal.stages.parts.decoder import Decoder


def generators(seed: int, first: int, count: int, salt: int) -> list[torch.Generator]:
    """One generator per sample i = first..first+count-1, seeded by (seed, i, what it draws) only."""
    return [torch.Generator().manual_seed(seed * 1_000_003 + salt + first + i) for i in range(count)]


def decode_rows(logits: torch.Tensor, temperature: float, top_p: float, gens: list[torch.Generator]) -> torch.Tensor:
    """(B, n, V) -> (B, n): each sample's positions drawn with its own generator."""
    if temperature == 0:
        return logits.argmax(-1)
    return torch.stack([decoding.sample(row, temperature, top_p, gen=g) for row, g in zip(logits, gens)])


@torch.no_grad()
def upper_tokens(model, suffix, h: torch.Tensor, temperature=0.0, top_p=1.0, gens=None, rows: int = 256):
    """h (B, T'+1, D) layer-l states at positions 0..T' -> (B, T') tokens decoded from logits 0..T'-1."""
    hidden = suffix_hidden(suffix, h[:, :-1])
    span = max(1, rows // h.shape[0])
    return torch.cat(
        [
            decode_rows(lm_logits(model, hidden[:, s : s + span]), temperature, top_p, gens)
            for s in range(0, hidden.shape[1], span)
        ],
        dim=1,
    )


def upper_argmax(model, suffix, h: torch.Tensor, rows: int = 256) -> torch.Tensor:
    return upper_tokens(model, suffix, h, rows=rows)


def bridge_states(bridge: Bridge, e: torch.Tensor, steps: int, seed: int, first: int = 0) -> torch.Tensor:
    """The bridge's noise for sample i depends on (seed, first + i) only."""
    gens = generators(seed, first, e.shape[0], 500_009)
    noise = torch.stack([torch.randn(e.shape[1], e.shape[2], generator=g) for g in gens]).to(e.device)
    return bridge.sample_condition(e, steps, noise)


def direct_states(y: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor, pos0: torch.Tensor) -> torch.Tensor:
    return torch.cat([pos0.expand(y.shape[0], 1, -1), y * sigma + mu], dim=1)


# -- the recoveries as stages/registry.py's RECOVERIES name them ---------------------------------------
# Each is built once per generation as Class(loaded, prior, part, cfg, table) -- table() gives the raw
# (V, D) embedding table, computed once -- and maps a block of prior samples to tokens.
DRAWS = 700_001  # the salt of the decoding draws (the bridge's noise has its own)


class Rounding:
    def __init__(self, loaded, prior, part, cfg, table):
        self.table, self.prior = table(), prior

    def tokens(self, block: torch.Tensor, first: int) -> torch.Tensor:
        return rounding(block, self.table, self.prior.mu, self.prior.sigma)


class DecoderRecovery:
    def __init__(self, loaded, prior, part, cfg, table):
        self.decoder, self.cfg = Decoder.load(part, table(), cfg.device), cfg

    def tokens(self, block: torch.Tensor, first: int) -> torch.Tensor:
        gens = generators(self.cfg.seed, first, block.shape[0], DRAWS)
        return self.decoder.tokens(block, self.cfg.decoding_temperature, self.cfg.top_p, gens)


class Hidden:
    """Through a bridge when one is given; without one the prior models h_l itself (DiHAL-direct)."""

    def __init__(self, loaded, prior, part, cfg, table):
        self.model, self.prior, self.cfg = loaded.model, prior, cfg
        self.bridge = Bridge.load(part, cfg.device) if part is not None else None
        self.suffix = suffix_model(loaded.model, self.bridge.layer if self.bridge is not None else prior.layer)

    def tokens(self, block: torch.Tensor, first: int) -> torch.Tensor:
        cfg, p = self.cfg, self.prior
        if self.bridge is not None:
            h = bridge_states(self.bridge, block, cfg.sample_steps, cfg.seed, first)
        else:
            h = direct_states(block, p.mu, p.sigma, p.norm.pos0)
        gens = generators(cfg.seed, first, block.shape[0], DRAWS)
        return upper_tokens(self.model, self.suffix, h, cfg.decoding_temperature, cfg.top_p, gens)


class LatentRecovery:
    """The LD4LG-style row: the prior's normalized latents, de-normalized, read by the autoencoder's decoder."""

    def __init__(self, loaded, prior, part, cfg, table):
        self.autoencoder, self.prior, self.cfg = Autoencoder(part, table(), cfg.device), prior, cfg

    def tokens(self, block: torch.Tensor, first: int) -> torch.Tensor:
        gens = generators(self.cfg.seed, first, block.shape[0], DRAWS)
        z = block * self.prior.sigma + self.prior.mu
        return self.autoencoder.tokens(z, self.cfg.decoding_temperature, self.cfg.top_p, gens)
