"""The CoDAR recovery's network, in one readable file (METHOD §5).

A small causal transformer over tokens that cross-attends to a whole sequence of continuous
states e (the prior's sample, normalized h_0 at positions 1..T-1). Its token input and output
are the backbone's embedding table E (V, D), frozen and normalized as e is: like the bridge,
only the blocks and two projections are trained, never a V-way table.
    input  = W_in E[tok] + position embedding of [start, tok_1, ..., tok_{T-2}]
    blocks = causal self-attention, cross-attention to W_e e + position embedding, MLP (pre-norm)
    output = logits (W_out h) E^T / sqrt(D) for tok_1 .. tok_{T-1}
Trained teacher-forced; decoded one token at a time (stages/lm/decoding.py).
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
    memory_dim: int | None = None  # width of the states it cross-attends to; None: dim (the LD4LG-style
    # decoder reads latents of another width than the embedding table)


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
    def __init__(self, cfg: DecoderConfig, table: torch.Tensor):
        """table: the (V, D) normalized embedding table, a buffer that is neither trained nor saved."""
        super().__init__()
        self.cfg = cfg
        if tuple(table.shape) != (cfg.vocab, cfg.dim):
            raise ValueError(f"embedding table {tuple(table.shape)} is not (vocab, dim) = ({cfg.vocab}, {cfg.dim})")
        self.register_buffer("table", table.float(), persistent=False)
        self.token_in = nn.Linear(cfg.dim, cfg.width)
        self.pos = nn.Embedding(cfg.max_len, cfg.width)
        self.memory_in = nn.Linear(cfg.memory_dim or cfg.dim, cfg.width)
        self.memory_pos = nn.Embedding(cfg.max_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.dim)
        for emb in (self.pos, self.memory_pos):
            nn.init.normal_(emb.weight, std=0.02)

    def hidden(self, tokens_in: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        x = self.token_in(self.table[tokens_in]) + self.pos(torch.arange(tokens_in.shape[1], device=e.device))[None]
        memory = self.memory_in(e) + self.memory_pos(torch.arange(e.shape[1], device=e.device))[None]
        for block in self.blocks:
            x = block(x, memory)
        return self.norm(x)

    def forward(self, tokens_in: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """tokens_in (B, n): start token then the tokens so far; e (B, T', D) -> logits (B, n, V)."""
        return self.logits(self.hidden(tokens_in, e))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden) @ self.table.T / self.cfg.dim**0.5

    @torch.no_grad()
    def decode(self, e: torch.Tensor, start: int, pick) -> torch.Tensor:
        """(B, T', D) -> (B, T') tokens; pick(logits (B, V), i) chooses token i given the ones before it."""
        tokens = torch.full((e.shape[0], 1), start, dtype=torch.long, device=e.device)
        for i in range(e.shape[1]):
            nxt = pick(self.logits(self.hidden(tokens, e)[:, -1]), i)  # the vocabulary only where it is needed
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        return tokens[:, 1:]

    def greedy(self, e: torch.Tensor, start: int) -> torch.Tensor:
        return self.decode(e, start, lambda logits, i: logits.argmax(-1))


VAL_BATCH = 64  # validation sequences per forward (decoder and autoencoder)
LOGIT_ELEMENTS = 1 << 24  # float32 logits built at once when scoring: 64 MiB, 130 positions of a 128k vocabulary


@torch.no_grad()
def teacher_forced(net: CrossDecoder, ids: torch.Tensor, memory: torch.Tensor) -> tuple[float, int, int]:
    """(summed token cross-entropy, argmax hits, tokens) of ids[:, 1:] given ids[:, :-1] and memory,
    with the vocabulary's logits built LOGIT_ELEMENTS at a time: never the (B, T, V) tensor, which at
    the paper protocol's 512 x 127 x 128,256 would be 33 GB before log_softmax doubles it."""
    hidden = net.hidden(ids[:, :-1], memory).reshape(-1, net.cfg.width)
    target = ids[:, 1:].reshape(-1)
    rows = max(1, LOGIT_ELEMENTS // net.cfg.vocab)
    nll, hits = 0.0, 0
    for a in range(0, target.shape[0], rows):
        logits = net.logits(hidden[a : a + rows]).float()
        nll += float(F.cross_entropy(logits, target[a : a + rows], reduction="sum"))
        hits += int((logits.argmax(-1) == target[a : a + rows]).sum())
    return nll, hits, int(target.shape[0])
