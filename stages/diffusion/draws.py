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

Every other seeded stream of dihal is made here too, so that its rule has one owner: `stream(seed, i)` is
stream i of a run's seed (a sample of the prior, a sample's decoding, a batch of generation), drawn from
seed * SEED_STRIDE + i, and `noise_block(seed, k)` is the hybrid's noise past its training length.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class Draws(Protocol):
    def rand(self) -> torch.Tensor: ...

    def randn(self, *shape: int) -> torch.Tensor: ...


SEED_STRIDE = 1_000_003  # a prime: the streams of seed s are s * SEED_STRIDE + i, apart from seed s + 1's
STEP_STRIDE = 4099  # a training step's items are streams step * STEP_STRIDE + j (at most 4099 items a step)


def stream(seed: int, index: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    """Stream `index` of a run's `seed`: what a prior's sample i, a recovery's sample i (index: its salt + i)
    and a generation's batch draw from, so each depends on (seed, index) alone. On the CPU unless a device
    is named (a GPU generation's: another stream than the CPU's for the same seed, recorded in its id)."""
    return torch.Generator(device=device).manual_seed(int(seed) * SEED_STRIDE + int(index))


def noise_block(seed: int, block: int) -> torch.Generator:
    """The hybrid's noise for its positions in block k >= 1 of its training length (stages/hybrid_lm.py)."""
    return torch.Generator().manual_seed(int(seed) + int(block) * SEED_STRIDE)


def step_seed(seed: int, step: int) -> int:
    return int(seed) * SEED_STRIDE + step * STEP_STRIDE


class ItemDraws:
    """One CPU generator per item (seeded by (seed, step, slot)); values moved to `device`."""

    def __init__(self, seed: int, step: int, slots: np.ndarray, device: torch.device | str = "cpu"):
        self.gens = [stream(seed, step * STEP_STRIDE + int(j)) for j in slots]
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
