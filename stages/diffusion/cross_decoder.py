"""The CoDAR recovery's network, in one readable file (docs/method.md section 5).

A small causal transformer over tokens that cross-attends to a whole sequence of continuous
states e (the prior's sample, normalized h_0 at positions 1..T-1):
    input  = token embedding + position embedding of [start, tok_1, ..., tok_{T-2}]
    blocks = causal self-attention, cross-attention to W_e e + position embedding, MLP (pre-norm)
    output = logits for tok_1 .. tok_{T-1}
Trained teacher-forced; decoded greedily, one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int
    dim: int  # width D of the states it reads
    width: int = 256
    depth: int = 2
    heads: int = 4
    max_len: int = 63  # positions 1..T-1


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q, self.kv, self.proj = nn.Linear(width, width), nn.Linear(width, 2 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q = self.q(x).view(b, n, self.heads, w // self.heads).transpose(1, 2)
        k, v = self.kv(memory).view(b, memory.shape[1], 2, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(b, n, w))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        self.self_attn, self.cross_attn = Attention(width, heads, causal=True), Attention(width, heads, causal=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.self_attn(h, h)
        x = x + self.cross_attn(self.norm2(x), memory)
        return x + self.mlp(self.norm3(x))


class CrossDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.max_len, cfg.width)
        self.memory_in = nn.Linear(cfg.dim, cfg.width)
        self.memory_pos = nn.Embedding(cfg.max_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width)
        self.out = nn.Linear(cfg.width, cfg.vocab)
        for emb in (self.pos, self.memory_pos):
            nn.init.normal_(emb.weight, std=0.02)

    def hidden(self, tokens_in: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens_in) + self.pos(torch.arange(tokens_in.shape[1], device=e.device))[None]
        memory = self.memory_in(e) + self.memory_pos(torch.arange(e.shape[1], device=e.device))[None]
        for block in self.blocks:
            x = block(x, memory)
        return self.norm(x)

    def forward(self, tokens_in: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """tokens_in (B, n): start token then the tokens so far; e (B, T', D) -> logits (B, n, V)."""
        return self.out(self.hidden(tokens_in, e))

    @torch.no_grad()
    def greedy(self, e: torch.Tensor, start: int) -> torch.Tensor:
        """(B, T', D) -> (B, T') tokens, each the argmax given the ones before it."""
        tokens = torch.full((e.shape[0], 1), start, dtype=torch.long, device=e.device)
        for _ in range(e.shape[1]):
            nxt = self.out(self.hidden(tokens, e)[:, -1]).argmax(-1)  # the vocabulary only where it is needed
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        return tokens[:, 1:]
