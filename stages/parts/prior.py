"""A trained prior at use time (METHOD §5): seeded noise to sequences of normalized states
(positions 1..T-1), with Diffusion-LM's clamping as an option, and its x0 estimates of noised real
states (the `prior:T` conditions the decoder and the comparison's bridges train on)."""

from __future__ import annotations

import json

import torch

from dihal.artifacts import files
from dihal.artifacts.store import Artifact
from dihal.stages.diffusion import draws, flow
from dihal.stages.diffusion.denoiser import Denoiser, DenoiserConfig
from dihal.stages.diffusion.normalizer import Normalizer
from dihal.stages.lm.vocab import snap


def space(norm: Normalizer, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu, sigma) of the prior's space: the bridge's condition statistics for layer 0."""
    return (norm.mu_c, norm.sigma_c) if layer == 0 else (norm.mu_y, norm.sigma_y)


class Prior:
    """A trained prior at use time: seeded noise -> sequences of normalized states (positions 1..T-1)."""

    def __init__(
        self, net: Denoiser, norm: Normalizer, layer: int, self_condition: bool, seq_len: int, latent: bool = False
    ):
        self.net, self.norm, self.layer, self.self_condition = net.eval(), norm, layer, self_condition
        self.seq_len, self.latent = seq_len, latent
        self.mu, self.sigma = space(norm, layer)

    @staticmethod
    def load(art: Artifact, device: str = "cpu") -> Prior:
        meta = json.loads(art.file("prior.json").read_text())
        net = Denoiser(DenoiserConfig(**meta["denoiser"]))
        net.load_state_dict(files.load_tensors(art.file("weights_ema.safetensors")))
        norm = Normalizer(**files.load_tensors(art.file("stats.safetensors"))).to(device)
        return Prior(
            net.to(device), norm, meta["layer"], meta["self_condition"], meta["seq_len"], meta.get("latent", False)
        )

    @torch.no_grad()
    def sample(
        self, n: int, steps: int, seed: int, batch: int = 64, clamp_to: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(n, T-1, D) normalized samples; steps 0 returns the initial noise itself (the null prior).
        clamp_to: the raw (V, D) embedding table for clamping (layer 0 only). Sample i's noise depends
        only on (seed, i), so rows that share the prior and the seed share their samples whatever else
        differs (clamping, batch size)."""
        device = next(self.net.parameters()).device
        out = []
        for first in range(0, n, batch):
            count = min(batch, n - first)
            noise = torch.stack(
                [
                    torch.randn(
                        self.seq_len - 1,
                        self.net.cfg.dim,
                        generator=draws.stream(seed, first + i),
                    )
                    for i in range(count)
                ]
            ).to(device)
            out.append(self._integrate(noise, steps, clamp_to))
        return torch.cat(out)

    @torch.no_grad()
    def corrupt(self, raw: torch.Tensor, t_max: float, draws) -> torch.Tensor:
        """Section 5's `prior:T` conditions: raw states (B, T', D) at positions 1..T' -> the prior's own
        x0 estimate (raw units, no gradient) from them noised to t ~ U(0, t_max) per sequence: errors
        of the kind generation feeds a recovery. Drawn after the item's other draws, as flow.corrupt."""
        device = next(self.net.parameters()).device
        e = ((raw.to(device) - self.mu) / self.sigma).float()
        t = draws.rand().to(device) * t_max
        eps = draws.randn(*e.shape[1:]).to(device)
        x0_prev = torch.zeros_like(e) if self.self_condition else None
        y_hat = self.net(flow.noisy(e, eps, t), t, x0_prev=x0_prev).float()
        return y_hat * self.sigma + self.mu

    def _integrate(self, x: torch.Tensor, steps: int, clamp_to: torch.Tensor | None) -> torch.Tensor:
        """flow.sample with the prior's self-conditioning and, where asked, clamping (in the raw embedding
        space, then back)."""
        if steps == 0:
            return x
        clamp = (
            None if clamp_to is None else lambda y: (snap(y * self.sigma + self.mu, clamp_to) - self.mu) / self.sigma
        )
        net = lambda x_t, t, i, x0_prev=None: self.net(x_t, t, x0_prev=x0_prev).float()
        return flow.sample(net, x, steps, "x0", refine=clamp, self_condition=self.self_condition)
