"""The vocabulary's geometry (METHOD §5): every token's layer-0 state (the embedding table
as the extract sees it), the cosine-nearest token of a vector, rounding, and Diffusion-LM's clamp.

Cosine, not L2: an x0 estimate at high noise is a shrunk embedding, and by L2 every shrunk vector is
nearest to the few small-norm "hub" tokens.
"""

from __future__ import annotations

import torch

from dihal.stages.lm.capture import hidden_states


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


def nearest(x: torch.Tensor, table: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """Index of the row of table (V, D) with the highest cosine to every vector of x (..., D), in blocks
    of rows. Cosine, not L2: an x0 estimate at high noise is a shrunk embedding, and by L2 every shrunk
    vector is nearest to the few small-norm "hub" tokens (METHOD §5)."""
    flat = torch.nn.functional.normalize(x.reshape(-1, x.shape[-1]).float(), dim=-1)
    unit = torch.nn.functional.normalize(table.float(), dim=-1)
    out = torch.empty(flat.shape[0], dtype=torch.long, device=x.device)
    for s in range(0, flat.shape[0], rows):
        out[s : s + rows] = (flat[s : s + rows] @ unit.T).argmax(1)
    return out.reshape(x.shape[:-1])


def snap(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Diffusion-LM's clamp: each vector of x replaced by its cosine-nearest row of table, rescaled to x's norm."""
    rows = table[nearest(x, table)]
    return rows * (x.norm(dim=-1, keepdim=True) / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12))


def rounding(e: torch.Tensor, table: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """e normalized (B, T', D), table the raw (V, D) embeddings -> (B, T') cosine-nearest token ids."""
    return nearest(e * sigma + mu, table)
