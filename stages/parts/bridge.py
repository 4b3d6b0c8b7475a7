"""A trained bridge at use time (METHOD §2): an h_0 sequence to a sampled h_l sequence,
whole (sample, sample_condition) or position by position with one key/value cache per Euler step
(CachedSampler, the AR hybrid's)."""

from __future__ import annotations

import json

import torch

from dihal.artifacts import files
from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact
from dihal.stages.diffusion import flow
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig
from dihal.stages.diffusion.normalizer import Normalizer


class Bridge:
    """A trained bridge: h_0 sequence -> sampled h_l sequence (raw units, position 0 exact)."""

    def __init__(self, net: Denoiser, norm: Normalizer, layer: int, start: int, prediction: str):
        self.net, self.norm, self.layer, self.start, self.prediction = net.eval(), norm, layer, start, prediction

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    @staticmethod
    def load(art: Artifact, device: str = "cpu", weights: str = "ema") -> Bridge:
        meta = json.loads(art.file("bridge.json").read_text())
        name = f"weights_{weights}.safetensors" if weights == "ema" else "weights.safetensors"
        if not art.file(name).exists() and weights != "ema":
            raise DihalError(f"bridge {art.id} kept its EMA weights alone (--keep-weights); load its ema weights")
        return Bridge.read(meta, art.file(name), art.file("stats.safetensors"), device)

    @staticmethod
    def read(meta: dict, weights, stats, device: str = "cpu") -> Bridge:
        """A bridge from bridge.json's fields and its weights' and statistics' files (an artifact's, or an
        exported package's: stages/export.py)."""
        net = Denoiser(DenoiserConfig(**meta["denoiser"]))
        net.load_state_dict(files.load_tensors(weights))
        norm = Normalizer(**files.load_tensors(stats))
        return Bridge(net.to(device), norm.to(device), meta["layer"], meta["start"], meta["prediction"])

    def positions(self, context: int | None) -> int | None:
        """How many positions a hybrid of it reads: learned positions end at its extract's --seq-len
        (max_len covered positions and the start token); rotary ones at the backbone's context."""
        covered = self.net.max_positions
        return context if covered is None else covered + self.start

    def cached_sampler(self, steps: int, batch: int) -> CachedSampler:
        return CachedSampler(self, steps, batch)

    def noise(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """Noise for the covered positions, drawn once per position, on the generator's device."""
        shape = (batch, length - self.start, self.net.cfg.dim)
        return torch.randn(shape, generator=generator, device=generator.device).to(self.device)

    @torch.no_grad()
    def sample_condition(self, c: torch.Tensor, steps: int, noise: torch.Tensor) -> torch.Tensor:
        """c: (B, T', D) normalized conditions at positions 1..T' (a prior's sample) -> (B, T'+1, D)
        raw layer-l states, position 0 the stored start-token state."""
        y = flow.sample(lambda x, t, i: self.net(x, t, c), noise[:, : c.shape[1]], steps, self.prediction)
        return self._assemble(y, c.shape[0])

    def sample(self, h0: torch.Tensor, steps: int, noise: torch.Tensor) -> torch.Tensor:
        """h0: (B, T, D) raw layer-0 states -> (B, T, D) raw layer-l states. Gradient mode is the caller's:
        every stage samples under no_grad; scripts/distill_probe.py takes the gradient through it."""
        c = self.norm.c(h0[:, self.start :].float())
        y = flow.sample(lambda x, t, i: self.net(x, t, c), noise[:, : c.shape[1]], steps, self.prediction)
        return self._assemble(y, h0.shape[0])

    def _assemble(self, y: torch.Tensor, batch: int) -> torch.Tensor:
        h = self.norm.unnormalize(y)
        if self.start == 1:
            h = torch.cat([self.norm.pos0.expand(batch, 1, -1), h], dim=1)
        return h


class CachedSampler:
    """Incremental bridge sampling for generation: each new position runs the denoiser once per
    Euler step against that step's key/value cache of earlier positions; nothing is recomputed."""

    def __init__(self, bridge: Bridge, steps: int, batch: int):
        self.bridge, self.steps, self.batch = bridge, steps, batch
        self.caches = [bridge.net.new_caches() for _ in range(steps)]
        self.done = 0  # covered positions already sampled
        self.started = False  # position 0 (the stored start-token state) emitted
        self.time_terms: dict[int, tuple] = {}  # per Euler step: its t is the same at every position

    def times(self, step: int, t: torch.Tensor) -> tuple:
        """The denoiser's time terms of Euler step `step` (Denoiser.time_terms), computed at its first position."""
        if step not in self.time_terms or self.time_terms[step][0].shape != t.shape:
            self.time_terms[step] = (t, self.bridge.net.time_terms(t))
        return self.time_terms[step][1]

    @torch.no_grad()
    def extend(self, h0_new: torch.Tensor, noise_new: torch.Tensor) -> torch.Tensor:
        """h0_new: (B, n, D) layer-0 states of the next n positions (absolute positions continue)."""
        b = self.bridge
        first = None
        if not self.started:  # an unprompted prefix is the start token alone: done stays 0 after it
            self.started = True
            if b.start == 1:
                first, h0_new = h0_new[:, :1], h0_new[:, 1:]
        out = []
        if h0_new.shape[1]:
            c = b.norm.c(h0_new.float())
            start, condition = self.done, b.net.condition_terms(c)  # once for every Euler step
            y = flow.sample(
                lambda x, t, i: b.net(x, t, c, start, self.caches[i], times=self.times(i, t), condition=condition),
                noise_new[:, : c.shape[1]],
                self.steps,
                b.prediction,
            )
            self.done += c.shape[1]
            out.append(b.norm.unnormalize(y))
        if first is not None:
            out.insert(0, b.norm.pos0.expand(h0_new.shape[0], 1, -1))
        return torch.cat(out, dim=1)
