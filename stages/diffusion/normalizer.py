"""Per-dimension normalization of a target and its condition (METHOD §2),
fitted in one streaming pass over the train split so that no split is ever held in memory.

Moments are merged block by block in float64 (Chan, Golub and LeVeque's pairwise update of
Welford's method), so the result equals the two-pass mean and unbiased standard deviation to
rounding. Position 0 (the start token) is left out of both; the target's position-0 state,
one constant vector, is averaged separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.errors import DihalError


class RunningMoments:
    """Mean and unbiased variance per dimension over rows added in blocks."""

    def __init__(self, dim: int):
        self.n, self.mean, self.m2 = 0, np.zeros(dim), np.zeros(dim)

    def add(self, rows: np.ndarray) -> None:
        rows = rows.reshape(-1, rows.shape[-1]).astype(np.float64)
        nb = rows.shape[0]
        if nb == 0:
            return
        mb = rows.mean(axis=0)
        m2b = ((rows - mb) ** 2).sum(axis=0)
        delta, n = mb - self.mean, self.n + nb
        self.mean = self.mean + delta * (nb / n)
        self.m2 = self.m2 + m2b + delta**2 * (self.n * nb / n)
        self.n = n

    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / max(self.n - 1, 1))


def table_moments(table: torch.Tensor, ids: np.ndarray, rows: int = 8192) -> RunningMoments:
    """The moments of table[ids] per dimension (float64) from each token's count: sum_v n_v e_v / N and
    sum_v n_v (e_v - mean)^2, over the tokens that occur, in blocks of `rows` of them on the table's device.
    What RunningMoments over every (sequence, position) of h_0 gives, to rounding, without building it."""
    counts = np.bincount(np.asarray(ids, dtype=np.int64).ravel(), minlength=table.shape[0])
    used = np.flatnonzero(counts)
    moments = RunningMoments(table.shape[1])
    weights = torch.from_numpy(counts[used].astype(np.float64)).to(table.device)
    n = float(weights.sum()) if used.size else 0.0
    if n == 0:
        return moments
    index = torch.from_numpy(used).to(table.device)
    total = torch.zeros(table.shape[1], dtype=torch.float64, device=table.device)
    for s in range(0, used.size, rows):
        total += weights[s : s + rows] @ table[index[s : s + rows]].double()
    mean = total / n
    m2 = torch.zeros_like(mean)
    for s in range(0, used.size, rows):
        m2 += weights[s : s + rows] @ (table[index[s : s + rows]].double() - mean) ** 2
    moments.n, moments.mean, moments.m2 = int(n), mean.cpu().numpy(), m2.cpu().numpy()
    return moments


def target_moments(group, layer: int, seqs: np.ndarray, start: int, block_bytes: int = 64 << 20, states=None):
    """(moments of `layer` over positions start.. of the sequences `seqs`, the sum of its position-0 states): read
    in contiguous runs of at most block_bytes, or computed by `states` (--states model: ModelStates.blocks, in
    order). What Normalizer.fit needs of its target; stages/moments.py stores it once per extract and layer."""
    if states is None:
        width = group[f"layers/{layer}"].shape[2]
        runs = hs.contiguous_runs(group, layer, seqs, block_bytes)
        blocks = (hs.read_block(group, layer, r[0], r[-1] + 1) for r in runs)
    else:
        width, ids = states.width, hs.token_ids(group, seqs)
        blocks = (block.numpy() for block in states.blocks(ids))
    moments, pos0 = RunningMoments(width), np.zeros(width)
    for target in blocks:
        moments.add(target[:, start:])
        pos0 += target[:, 0].astype(np.float64).sum(axis=0)
    return moments, pos0


@dataclass
class Normalizer:
    mu_y: torch.Tensor
    sigma_y: torch.Tensor
    mu_c: torch.Tensor
    sigma_c: torch.Tensor
    pos0: torch.Tensor  # (D,) the constant target state at position 0

    @staticmethod
    def fit(
        group,
        cond_layer: int,
        target_layer: int,
        seqs: np.ndarray,
        start: int = 1,
        block_bytes: int = 64 << 20,
        table: torch.Tensor | None = None,
        states=None,
        target=None,
    ) -> Normalizer:
        """The target's moments (target: what target_moments returns, stored once per extract and layer by
        stages/moments.py; else computed here, with `states` for --states model) and the condition's: from the
        tokens' counts where h_0 = table[token id] (table_moments, no layer read), the target's own where it is
        the same layer, else read in contiguous runs of at most block_bytes laid out as the target layer's."""
        y, pos0 = target or target_moments(group, target_layer, seqs, start, block_bytes, states)
        width = y.mean.shape[0]
        if table is not None:
            c = table_moments(table, hs.token_ids(group, seqs)[:, start:])
        elif cond_layer == target_layer:  # read or computed alike
            c = y
        else:
            c = RunningMoments(width)
            for r in hs.contiguous_runs(group, target_layer, seqs, block_bytes):
                c.add(hs.read_block(group, cond_layer, r[0], r[-1] + 1)[:, start:])
        for layer, moments in ((target_layer, y), (cond_layer, c)):
            if not (np.isfinite(moments.mean).all() and np.isfinite(moments.m2).all()):
                raise DihalError(
                    f"layer {layer} of this extract holds non-finite states (a float16 backbone past its range); "
                    "extract it again with --dtype bfloat16 or float32"
                )
        as_t = lambda a: torch.from_numpy(np.asarray(a)).float()
        floor = lambda s: np.maximum(s, 1e-6)
        return Normalizer(
            as_t(y.mean), as_t(floor(y.std())), as_t(c.mean), as_t(floor(c.std())), as_t(pos0 / max(len(seqs), 1))
        )

    def y(self, h: torch.Tensor) -> torch.Tensor:
        return (h - self.mu_y) / self.sigma_y

    def c(self, h0: torch.Tensor) -> torch.Tensor:
        return (h0 - self.mu_c) / self.sigma_c

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.sigma_y + self.mu_y

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "mu_y": self.mu_y,
            "sigma_y": self.sigma_y,
            "mu_c": self.mu_c,
            "sigma_c": self.sigma_c,
            "pos0": self.pos0,
        }

    def to(self, device) -> Normalizer:
        return Normalizer(**{k: v.to(device) for k, v in self.tensors().items()})
