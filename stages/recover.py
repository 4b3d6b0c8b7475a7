"""Token recoveries of METHOD §5: each maps prior samples e (B, T', D), normalized,
at positions 1..T' to T' tokens.

    rounding  token_i = the vocabulary entry whose raw embedding has the highest cosine with the
              de-normalized e_i (deterministic, as in Diffusion-LM and SED)
    decoder   the CoDAR decoder, token by token (stages/train_decoder.py)
    hidden    the bridge conditioned on e gives h_l (position 0: the stored start-token state);
              the upper blocks, final norm and LM head give logits at positions 0..T'-1, and
              token_{i+1} is read from logits_i by the readout of METHOD §5.1 (--readout):
                independent  D(logits_i), one parallel pass
                guided       D(logits_i + gamma log p(e_{i+1} | v)), one parallel pass
                refine:K     K more passes, the bridge conditioned on the clean embeddings of the
                             previous pass's tokens, each token redrawn by the guided rule
                causal       token by token with the hybrid's caches, the bridge conditioned on the
                             clean embeddings of the tokens chosen so far, each by the guided rule
              log p(e | v) = -|u(e) - u(t_v)|^2 / (2 s^2), the cosine form: u is the unit vector of the
              raw (de-normalized) vector, t_v token v's layer-0 state, as rounding reads them (by L2 the
              hub tokens win, METHOD §5); s^2 is the mean per-dimension squared distance
              between the run's samples and their cosine-nearest tokens, measured on those samples.
              gamma = 0 is independent, gamma -> infinity is rounding.
    direct    DiHAL-direct: the prior's samples are normalized h_l themselves; unnormalized, with
              the start-token state in front, they go through the upper blocks as in `hidden`

Every recovery but rounding decodes its logits with the one decoding (stages/lm/decoding.py):
--temperature (0 = argmax), --top-p, float64; the draws of sample i depend on (seed, i) only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dihal.stages.diffusion import draws
from dihal.stages.lm import decoding
from dihal.stages.lm.hybrid import lm_logits, suffix_hidden, suffix_model
from dihal.stages.lm.vocab import nearest, rounding
from dihal.stages.parts.autoencoder import Autoencoder
from dihal.stages.parts.bridge import Bridge
from dihal.stages.parts.decoder import Decoder


def generators(seed: int, first: int, count: int, salt: int) -> list[torch.Generator]:
    """One generator per sample i = first..first+count-1, seeded by (seed, i, what it draws) only."""
    return [draws.stream(seed, salt + first + i) for i in range(count)]


def decode_rows(logits: torch.Tensor, temperature: float, top_p: float, gens: list[torch.Generator]) -> torch.Tensor:
    """(B, n, V) -> (B, n): each sample's positions drawn with its own generator."""
    if temperature == 0:
        return logits.argmax(-1)
    return torch.stack([decoding.sample(row, temperature, top_p, gen=g) for row, g in zip(logits, gens)])


@torch.no_grad()
def upper_tokens(model, suffix, h: torch.Tensor, temperature=0.0, top_p=1.0, gens=None, rows: int = 256, guide=None):
    """h (B, T'+1, D) layer-l states at positions 0..T' -> (B, T') tokens decoded from logits 0..T'-1;
    guide(logits, s, e): logits of positions s..s+n plus what the readout adds (None: nothing)."""
    hidden = suffix_hidden(suffix, h[:, :-1])
    span = max(1, rows // h.shape[0])
    out = []
    for s in range(0, hidden.shape[1], span):
        logits = lm_logits(model, hidden[:, s : s + span])
        out.append(decode_rows(logits if guide is None else guide(logits, s), temperature, top_p, gens))
    return torch.cat(out, dim=1)


def upper_argmax(model, suffix, h: torch.Tensor, rows: int = 256) -> torch.Tensor:
    return upper_tokens(model, suffix, h, rows=rows)


def bridge_noise(e: torch.Tensor, seed: int, first: int = 0) -> torch.Tensor:
    """The bridge's noise (B, T', D) for samples first..first+B-1: sample i's depends on (seed, first + i) only."""
    gens = generators(seed, first, e.shape[0], 500_009)
    return torch.stack([torch.randn(e.shape[1], e.shape[2], generator=g) for g in gens]).to(e.device)


def bridge_states(bridge: Bridge, e: torch.Tensor, steps: int, seed: int, first: int = 0) -> torch.Tensor:
    return bridge.sample_condition(e, steps, bridge_noise(e, seed, first))


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
    """Through a bridge when one is given, read as cfg.readout says; without one the prior models h_l
    itself (DiHAL-direct, read independently)."""

    def __init__(self, loaded, prior, part, cfg, table):
        self.model, self.prior, self.cfg = loaded.model, prior, cfg
        self.bridge = Bridge.load(part, cfg.device) if part is not None else None
        self.suffix = suffix_model(loaded.model, self.bridge.layer if self.bridge is not None else prior.layer)
        self.kind, self.passes = cfg.readout_kind
        self.table = table() if self.kind != "independent" else None
        self.units = F.normalize(self.table, dim=-1) if self.table is not None else None
        self.s2: float | None = None

    def calibrate(self, e: torch.Tensor) -> None:
        """s^2 from the run's own samples e (N, T', D): the mean per-dimension squared distance between each
        sample's unit vector and its cosine-nearest token's."""
        if self.units is None:
            return
        u = F.normalize((e * self.prior.sigma + self.prior.mu).reshape(-1, e.shape[-1]).float(), dim=-1)
        nn = nearest(u, self.table)
        self.s2 = max(float(((u - self.units[nn]) ** 2).sum(-1).mean()) / e.shape[-1], 1e-12)

    def describe(self) -> dict:
        """What the manifest records of the readout."""
        out = {"readout": self.cfg.readout}
        if self.kind != "independent":
            out.update(guidance=self.cfg.guidance, s2=self.s2, form="cosine")
        if self.kind == "refine":
            out["passes"] = self.passes + 1
        return out

    def log_p(self, e: torch.Tensor) -> torch.Tensor:
        """(B, n, D) normalized samples -> (B, n, V) log p(e | v) = -|u(e) - u(t_v)|^2 / (2 s^2) = -(1 - cos) / s^2."""
        u = F.normalize((e * self.prior.sigma + self.prior.mu).float(), dim=-1)
        return -(1 - u @ self.units.T) / self.s2

    def tokens(self, block: torch.Tensor, first: int) -> torch.Tensor:
        cfg, p = self.cfg, self.prior
        if self.bridge is None:
            h = direct_states(block, p.mu, p.sigma, p.norm.pos0)
            return upper_tokens(
                self.model, self.suffix, h, cfg.decoding_temperature, cfg.top_p, self._draws(block, first)
            )
        noise = bridge_noise(block, cfg.seed, first)
        if self.kind == "causal":
            return self._causal(block, noise, first)
        guide = None if self.kind == "independent" else lambda logits, s: self._guided(logits, block, s)
        tokens, cond = None, block
        for k in range(self.passes + 1):  # refine:K: K more passes, each conditioned on the last one's tokens
            if k:
                cond = self.bridge.norm.c(self.table[tokens])
            h = self.bridge.sample_condition(cond, cfg.sample_steps, noise)
            gens = self._draws(block, first, k)
            tokens = upper_tokens(self.model, self.suffix, h, cfg.decoding_temperature, cfg.top_p, gens, guide=guide)
        return tokens

    def _draws(self, block: torch.Tensor, first: int, k: int = 0) -> list[torch.Generator]:
        """The decoding draws of pass k (pass 0's are independent's)."""
        return generators(self.cfg.seed, first, block.shape[0], DRAWS + 7_919 * k)

    def _guided(self, logits: torch.Tensor, block: torch.Tensor, s: int) -> torch.Tensor:
        """logits_i (positions s..s+n-1) plus gamma log p(e_{i+1} | v): e_{i+1} is block[:, i]."""
        return logits + self.cfg.guidance * self.log_p(block[:, s : s + logits.shape[1]])

    @torch.no_grad()
    def _causal(self, block: torch.Tensor, noise: torch.Tensor, first: int) -> torch.Tensor:
        """Token by token: the bridge's cached sampler conditioned on the chosen tokens' clean embeddings,
        the upper blocks' key/value cache, each token by the guided rule."""
        from transformers import DynamicCache

        cfg, b = self.cfg, block.shape[0]
        sampler, kv = self.bridge.cached_sampler(cfg.sample_steps, b), DynamicCache(config=self.suffix.config)
        gens = self._draws(block, first)
        h = sampler.extend(torch.zeros(b, 1, block.shape[-1], device=block.device), noise[:, :0])  # the start state
        dtype, out = next(self.suffix.parameters()).dtype, []
        for i in range(block.shape[1]):
            hidden = self.suffix.model(inputs_embeds=h.to(dtype), cache=kv, use_cache=True).last_hidden_state
            logits = self._guided(lm_logits(self.model, hidden[:, -1:]), block, i)
            token = decode_rows(logits, cfg.decoding_temperature, cfg.top_p, gens)[:, 0]
            out.append(token)
            if i + 1 < block.shape[1]:
                h = sampler.extend(self.table[token][:, None], noise[:, i : i + 1])
        return torch.stack(out, dim=1)


class LatentRecovery:
    """The LD4LG-style row: the prior's normalized latents, de-normalized, read by the autoencoder's decoder."""

    def __init__(self, loaded, prior, part, cfg, table):
        self.autoencoder, self.prior, self.cfg = Autoencoder(part, table(), cfg.device), prior, cfg

    def tokens(self, block: torch.Tensor, first: int) -> torch.Tensor:
        gens = generators(self.cfg.seed, first, block.shape[0], DRAWS)
        z = block * self.prior.sigma + self.prior.mu
        return self.autoencoder.tokens(z, self.cfg.decoding_temperature, self.cfg.top_p, gens)
