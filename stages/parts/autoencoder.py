"""An LD4LG-style autoencoder at use time (METHOD §5): its stored latents, and its decoder
reading latents into tokens."""

from __future__ import annotations

import json

import torch

from dihal.artifacts import files
from dihal.artifacts.store import Artifact
from dihal.stages.diffusion.cross_decoder import CrossDecoder, DecoderConfig
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.lm import decoding


def latents_of(art: Artifact, split: str) -> torch.Tensor:
    """(N, K, d) stored latents of a split's sequences, raw (not normalized)."""
    return files.load_tensors(art.file("latents.safetensors"))[split]


class Autoencoder:
    """The trained decoder of an autoencoder: raw latents (B, K, d) -> tokens (B, T')."""

    def __init__(self, art: Artifact, table: torch.Tensor, device: str = "cpu"):
        meta = json.loads(art.file("autoencoder.json").read_text())
        norm = Normalizer(**files.load_tensors(art.file("stats.safetensors")))
        self.net = CrossDecoder(DecoderConfig(**meta["decoder"]), norm.c(table.float().cpu()))
        weights = files.load_tensors(art.file("weights_ema.safetensors"))
        self.net.load_state_dict(
            {k.removeprefix("decoder."): v for k, v in weights.items() if k.startswith("decoder.")}
        )
        self.net = self.net.to(device).eval()
        self.start, self.length = meta["start_token"], meta["seq_len"] - 1

    @torch.no_grad()
    def tokens(self, z: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, gens=None) -> torch.Tensor:
        """Token i of sample b drawn with gens[b] (temperature 0: argmax), T' tokens from K latents."""
        tokens = torch.full((z.shape[0], 1), self.start, dtype=torch.long, device=z.device)
        for _ in range(self.length):
            logits = self.net.logits(self.net.hidden(tokens, z)[:, -1])
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.stack([decoding.sample(row, temperature, top_p, gen=g) for row, g in zip(logits, gens)])
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        return tokens[:, 1:]
