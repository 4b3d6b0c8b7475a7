"""The randomness of one training step: each item's time t, noise and corrupted condition.

Item j of step s draws from a stream of its own, determined by (seed, s, j), so a run resumed at
step s, or split over ranks, draws exactly what one uninterrupted process draws. Two ways hold
those streams, chosen by the training device:

    ItemDraws     CPU: one torch.Generator per item, seeded by (seed, s, j). These are the draws every
                  CPU artifact was trained with, so a CPU artifact's id keeps meaning the same weights.
    DeviceDraws   GPU: one generator on the device per process, seeded by (seed, s), drawing the whole
                  global batch's values at once and keeping this rank's items. Nothing is drawn on the
                  host or copied to the device: at the paper protocol's 64 x 127 x 4096 noise, per-item
                  CPU draws take 0.25 s on one thread, longer than the GPU step itself.

A task asks `draws.rand()` (one uniform per item) and `draws.randn(*shape)` (a normal tensor per
item), always in the same order, and gets (B, ...) tensors on the training device.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class Draws(Protocol):
    def rand(self) -> torch.Tensor: ...

    def randn(self, *shape: int) -> torch.Tensor: ...


def step_seed(seed: int, step: int) -> int:
    return int(seed) * 1_000_003 + step * 4099


class ItemDraws:
    """One CPU generator per item (seeded by (seed, step, slot)); values moved to `device`."""

    def __init__(self, seed: int, step: int, slots: np.ndarray, device: torch.device | str = "cpu"):
        self.gens = [torch.Generator().manual_seed(step_seed(seed, step) + int(j)) for j in slots]
        self.device = device

    def rand(self) -> torch.Tensor:
        return torch.stack([torch.rand((), generator=g) for g in self.gens]).to(self.device)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.stack([torch.randn(shape, generator=g) for g in self.gens]).to(self.device)


class DeviceDraws:
    """One generator on `device` per process, reseeded by (seed, step): each call draws the global
    batch (global_size items) and keeps the rows of this rank's slots."""

    _generators: dict[str, torch.Generator] = {}

    def __init__(self, seed: int, step: int, slots: np.ndarray, global_size: int, device: torch.device | str):
        key = str(torch.device(device))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device)
        self.gen = self._generators[key].manual_seed(step_seed(seed, step))
        self.slots = torch.as_tensor(np.asarray(slots), device=device)
        self.global_size, self.device = global_size, device

    def rand(self) -> torch.Tensor:
        return torch.rand(self.global_size, generator=self.gen, device=self.device)[self.slots]

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn((self.global_size, *shape), generator=self.gen, device=self.device)[self.slots]


def for_step(seed: int, step: int, slots: np.ndarray, global_size: int, device: torch.device) -> Draws:
    """This rank's draws of one step: on the device's own generator on a GPU, per item on the CPU."""
    if torch.device(device).type == "cuda":
        return DeviceDraws(seed, step, slots, global_size, device)
    return ItemDraws(seed, step, slots, device)
