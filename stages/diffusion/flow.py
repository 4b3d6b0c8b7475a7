"""The noise path and sampler of docs/method.md section 2, separate from the network (as in diffusers).

Rectified flow: x_t = (1 - t) y + t eps, t ~ U(0, 1). The network output is read as the clean
target y_hat (prediction "x0") or as the velocity eps - y (prediction "velocity"); either way
the sampler integrates dx/dt = (x_t - y_hat) / t from t = 1 to t = 0 with Euler steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PREDICTIONS = ("x0", "velocity")
VALIDATION_TIMES = tuple((j + 0.5) / 16 for j in range(16))


def noisy(y: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    t = t.view(-1, *([1] * (y.dim() - 1)))
    return (1 - t) * y + t * eps


def clean_estimate(output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, prediction: str) -> torch.Tensor:
    """y_hat from the network output."""
    if prediction == "x0":
        return output
    t = t.view(-1, *([1] * (x_t.dim() - 1)))
    return x_t - t * output


def training_target(y: torch.Tensor, eps: torch.Tensor, prediction: str) -> torch.Tensor:
    return y if prediction == "x0" else eps - y


def time_grid(steps: int) -> list[float]:
    return [1 - i / steps for i in range(steps + 1)]


def sample(
    denoise: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    noise: torch.Tensor,
    steps: int,
    prediction: str = "x0",
) -> torch.Tensor:
    """Euler integration from pure noise (t = 1) to t = 0.

    denoise(x_t, t, step_index) returns the network output; step_index lets a caller keep one
    attention cache per step (generation reuses earlier positions that way).
    """
    if steps < 1:
        raise ValueError("steps must be at least 1")
    x = noise
    grid = time_grid(steps)
    for i in range(steps):
        t, t_next = grid[i], grid[i + 1]
        t_vec = torch.full((x.shape[0],), t, device=x.device, dtype=x.dtype)
        y_hat = clean_estimate(denoise(x, t_vec, i), x, t_vec, prediction)
        x = y_hat if t_next == 0 else x + (t_next - t) * (x - y_hat) / t
    return x


def corrupt(c: torch.Tensor, sigma_max: float, draws) -> torch.Tensor:
    """c + sigma z, sigma ~ U(0, sigma_max) per sequence (drawn after the item's other draws, on c's device)."""
    if sigma_max <= 0:
        return c
    sigma = draws.rand() * sigma_max
    z = draws.randn(*c.shape[1:])
    return c + sigma[:, None, None] * z
