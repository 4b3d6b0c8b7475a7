"""A trained CoDAR decoder at use time (METHOD §5): normalized conditions to tokens, one at
a time; and the backbone's frozen embedding table it (and the LD4LG-style decoder) reads."""

from __future__ import annotations

import json

import torch

from dihal.artifacts import files
from dihal.artifacts.store import Artifact
from dihal.stages.diffusion.cross_decoder import CrossDecoder, DecoderConfig
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.lm import decoding


def frozen_table(extract: Artifact, cfg, loaded=None) -> torch.Tensor:
    """The backbone's raw (V, D) embedding table, frozen: from `loaded`, else from the backbone read
    once on the run's device in its training precision (what generation reads it from, too)."""
    from dihal.stages.lineage import backbone_for
    from dihal.stages.lm.vocab import embedding_table

    loaded = loaded or backbone_for(extract, cfg.device, cfg.precision)
    return embedding_table(loaded.model)


class Decoder:
    """A trained decoder at use time: normalized conditions (B, T', D) -> tokens (B, T')."""

    def __init__(self, net: CrossDecoder, start: int, seq_len: int):
        self.net, self.start, self.seq_len = net.eval(), start, seq_len

    @staticmethod
    def load(art: Artifact, table: torch.Tensor, device: str = "cpu") -> Decoder:
        """table: the backbone's raw (V, D) embedding table, which the weights do not hold."""
        meta = json.loads(art.file("decoder.json").read_text())
        norm = Normalizer(**files.load_tensors(art.file("stats.safetensors")))
        net = CrossDecoder(DecoderConfig(**meta["decoder"]), norm.c(table.float().cpu()))
        net.load_state_dict(files.load_tensors(art.file("weights_ema.safetensors")))
        return Decoder(net.to(device), meta["start_token"], meta["seq_len"])

    def tokens(self, e: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, gens=None) -> torch.Tensor:
        """Token i of sample b drawn with gens[b] (temperature 0: argmax)."""
        if temperature == 0:
            return self.net.greedy(e, self.start)
        pick = lambda logits, i: torch.stack(
            [decoding.sample(row, temperature, top_p, gen=g) for row, g in zip(logits, gens)]
        )
        return self.net.decode(e, self.start, pick)
