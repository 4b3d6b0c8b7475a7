"""The bridge's denoiser, in one readable file (METHOD §2).

A small pre-norm transformer over positions with causal attention (bidirectional for the
comparison's prior, which also has no condition and may take its previous x0 estimate):
    input  = W_x x_t + W_c c (+ a learned position embedding, positions "learned")
    blocks = attention and MLP, each modulated by the timestep through zero-initialised
             adaptive layer norm (shift, scale, gate)
    output = f(x_t, t, c) + A c          (a learned linear skip from the condition)
With causal attention and noise fixed per position, position p never depends on later
positions, so generation keeps one key/value cache per sampling step.

Positions. "learned" (every bridge before issue 47): an embedding of max_len positions, so the
bridge ends at its training length. "rotary": queries and keys rotated by their position (RoPE, as
the backbones' own attention) and each query attending the keys of the last max_len positions and
the first one (a sliding window that keeps the sequence's first position, as StreamingLLM keeps its
sink), so no attention layer ever sees a distance it did not see in training and no position ends
the bridge; through depth d a position reaches d windows back, as in Mistral's sliding window.
Within max_len positions the window covers everything and it is plain causal RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DenoiserConfig:
    dim: int  # backbone width D
    width: int = 256
    depth: int = 4
    heads: int = 4
    max_len: int = 64
    causal: bool = True  # the bridge; the comparison's prior attends both ways
    condition: bool = True  # W_c c and the skip A c; the prior has no condition
    self_condition: bool = False  # an input projection of the previous x0 estimate (SED)
    positions: str = "learned"  # "learned" (max_len of them) or "rotary" (a window of max_len, any length)

    def __post_init__(self):
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}")
        if self.positions == "rotary" and not self.causal:
            raise ValueError("rotary positions are for the causal bridge")


POSITIONS = ("learned", "rotary")
ROPE_BASE = 10_000.0


def rotate(x: torch.Tensor, positions: torch.Tensor, angles: tuple | None = None) -> torch.Tensor:
    """RoPE: (B, H, n, d) rotated pairwise by the angles position * ROPE_BASE^(-2i/d) (half-split pairs).
    angles: rotary_angles(positions, d) where a caller computed them once for every block."""
    half = x.shape[-1] // 2
    cos, sin = angles if angles is not None else rotary_angles(positions, x.shape[-1], x.device)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rotary_angles(positions: torch.Tensor, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of RoPE's angles at `positions` (float32), what rotate applies."""
    half = head_dim // 2
    freqs = ROPE_BASE ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None]
    return angles.cos(), angles.sin()


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class TimestepEmbedding(nn.Module):
    def __init__(self, width: int, frequencies: int = 128):
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = 1000.0 * t.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([angles.cos(), angles.sin()], dim=1).to(self.mlp[0].weight.dtype))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool = True, window: int | None = None):
        super().__init__()
        self.heads, self.causal, self.window = heads, causal, window  # window: rotary's, else None
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(
        self, x: torch.Tensor, cache: dict | None = None, rotary: tuple[torch.Tensor, int] | None = None
    ) -> torch.Tensor:
        """rotary: (the positions start..start+n-1 on x's device, the last of them as a host int, their RoPE
        angles: rotary_angles, the same in every block)."""
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if self.window is not None:
            positions, last, angles = rotary
            q, k = rotate(q, positions, angles), rotate(k, positions, angles)
            out = self._windowed(q, k, v, positions, last, cache)
            return self.proj(out.transpose(1, 2).reshape(b, n, w))
        if cache is not None and "k" in cache:  # earlier positions, computed at this same step
            k = torch.cat([cache["k"], k], dim=2)
            v = torch.cat([cache["v"], v], dim=2)
        if cache is not None:
            cache["k"], cache["v"] = k, v
        past = k.shape[2] - n
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            mask = torch.ones(n, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=past)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, w))

    def _windowed(self, q, k, v, positions: torch.Tensor, last: int, cache: dict | None) -> torch.Tensor:
        """Rotary attention of queries at `positions` over the keys at most window - 1 positions back and the
        first position's; a cache keeps only what a later query can still attend."""
        if positions.numel() == 0:  # no new position (a start token alone): nothing to attend, the cache as it was
            return torch.zeros_like(q)
        key_positions = positions
        if cache is not None and "k" in cache:
            k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            key_positions = torch.cat([cache["positions"], positions])
        if last < self.window and key_positions.numel() == positions.numel():  # the whole window
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            back = positions[:, None] - key_positions[None]
            allowed = (back >= 0) & ((back < self.window) | (key_positions[None] == 0))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        if cache is not None:
            keep = (key_positions == 0) | (key_positions > positions[-1] - self.window)
            cache["k"], cache["v"], cache["positions"] = k[:, :, keep], v[:, :, keep], key_positions[keep]
        return out


class Block(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool = True, window: int | None = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.attn = CausalSelfAttention(width, heads, causal, window)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))
        self.modulation = nn.Linear(width, 6 * width)
        nn.init.zeros_(self.modulation.weight)  # adaLN-Zero: every block starts as the identity
        nn.init.zeros_(self.modulation.bias)

    def forward(
        self,
        x: torch.Tensor,
        temb: torch.Tensor,
        cache: dict | None = None,
        rotary: tuple | None = None,
        modulations: tuple | None = None,
    ) -> torch.Tensor:
        """modulations: this block's share of Denoiser.time_terms(t), where a sampler computed it once."""
        mods = modulations if modulations is not None else self.modulations(temb)
        shift1, scale1, gate1, shift2, scale2, gate2 = mods
        x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1), cache, rotary)
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))

    def modulations(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.modulation(F.silu(temb)).chunk(6, dim=1)


class Denoiser(nn.Module):
    def __init__(self, cfg: DenoiserConfig):
        super().__init__()
        self.cfg = cfg
        self.in_x = nn.Linear(cfg.dim, cfg.width)
        self.in_c = nn.Linear(cfg.dim, cfg.width) if cfg.condition else None
        self.in_sc = nn.Linear(cfg.dim, cfg.width) if cfg.self_condition else None
        self.rotary = cfg.positions == "rotary"
        self.pos = None if self.rotary else nn.Embedding(cfg.max_len, cfg.width)
        self.time = TimestepEmbedding(cfg.width)
        window = cfg.max_len if self.rotary else None
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads, cfg.causal, window) for _ in range(cfg.depth))
        self.final_norm = nn.LayerNorm(cfg.width, elementwise_affine=False)
        self.final_modulation = nn.Linear(cfg.width, 2 * cfg.width)
        nn.init.zeros_(self.final_modulation.weight)
        nn.init.zeros_(self.final_modulation.bias)
        self.out = nn.Linear(cfg.width, cfg.dim)
        self.skip = nn.Linear(cfg.dim, cfg.dim) if cfg.condition else None  # A c
        if self.pos is not None:
            nn.init.normal_(self.pos.weight, std=0.02)

    def forward(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        c: torch.Tensor | None = None,
        start: int = 0,
        caches: list[dict] | None = None,
        x0_prev: torch.Tensor | None = None,
        times: tuple | None = None,
        condition: tuple | None = None,
    ) -> torch.Tensor:
        """x_t, c, x0_prev: (B, n, D) for positions start..start+n-1 of the covered range; t: (B,). times =
        time_terms(t) and condition = condition_terms(c) where a sampler computed them once (an Euler step's
        t is the same at every new position, and a position's c the same at every step): the same tensors,
        so the same output."""
        positions = torch.arange(start, start + x_t.shape[1], device=x_t.device)
        h = self.in_x(x_t) if self.rotary else self.in_x(x_t) + self.pos(positions)[None]
        in_c, skip = condition if condition is not None else self.condition_terms(c)
        if in_c is not None:
            h = h + in_c
        if self.in_sc is not None:
            h = h + self.in_sc(x0_prev if x0_prev is not None else torch.zeros_like(x_t))
        blocks, (shift, scale) = times if times is not None else self.time_terms(t)
        rotary = None
        if self.rotary:  # the last position known on the host; the angles once for every block
            angles = rotary_angles(positions, self.cfg.width // self.cfg.heads, x_t.device)
            rotary = (positions, start + x_t.shape[1] - 1, angles)
        for i, block in enumerate(self.blocks):
            h = block(h, None, None if caches is None else caches[i], rotary, blocks[i])
        out = self.out(modulate(self.final_norm(h), shift, scale))
        return out + skip if skip is not None else out

    def time_terms(self, t: torch.Tensor) -> tuple[list[tuple], tuple]:
        """What depends on t alone: every block's modulations and the final norm's (shift, scale)."""
        temb = self.time(t)
        return [block.modulations(temb) for block in self.blocks], self.final_modulation(F.silu(temb)).chunk(2, dim=1)

    def condition_terms(self, c: torch.Tensor | None) -> tuple:
        """What depends on c alone: (W_c c, A c), None without a condition."""
        if self.in_c is None:
            return None, None
        return self.in_c(c), self.skip(c) if self.skip is not None else None

    def new_caches(self) -> list[dict]:
        return [{} for _ in self.blocks]

    @property
    def max_positions(self) -> int | None:
        """The covered positions it reads: max_len with learned positions, unbounded (None) with rotary."""
        return None if self.rotary else self.cfg.max_len
