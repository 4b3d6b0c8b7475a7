"""The noise path and sampler of METHOD §2, separate from the network (as in diffusers).

Rectified flow: x_t = (1 - t) y + t eps, t ~ U(0, 1) (a prior may train on a shifted t, `shift_time`). The
network output is read as the clean target y_hat (prediction "x0") or as the velocity eps - y (prediction
"velocity"); either way the sampler integrates dx/dt = (x_t - y_hat) / t from t = 1 to t = 0 with Euler steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PREDICTIONS = ("x0", "velocity")
VALIDATION_TIMES = tuple((j + 0.5) / 16 for j in range(16))
VALIDATION_SEED = 1234  # the validation noise: the same draw at every evaluation of every part


def noisy(y: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    t = t.view(-1, *([1] * (y.dim() - 1)))
    return (1 - t) * y + t * eps


def shift_time(u: torch.Tensor, shift: float) -> torch.Tensor:
    """t = s u / (1 + (s - 1) u) of a uniform u (METHOD §5, the prior's --time-shift): the resolution shift of
    "simple diffusion" and of rectified-flow image models (SD3). s = 1 is u itself; s > 1 moves mass toward
    t = 1 (noise), P(t <= q) = q / (s - (s - 1) q), median s / (1 + s)."""
    return u if shift == 1.0 else shift * u / (1 + (shift - 1) * u)


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
    denoise: Callable[..., torch.Tensor],
    noise: torch.Tensor,
    steps: int,
    prediction: str = "x0",
    refine: Callable[[torch.Tensor], torch.Tensor] | None = None,
    self_condition: bool = False,
) -> torch.Tensor:
    """Euler integration from pure noise (t = 1) to t = 0: the one sampler of every part.

    denoise(x_t, t, step_index) returns the network output; step_index lets a caller keep one
    attention cache per step (generation reuses earlier positions that way). With self_condition,
    denoise(x_t, t, step_index, x0_prev) also gets the previous step's clean estimate (zeros at the
    first step: SED's self-conditioning). refine(y_hat) replaces each clean estimate before it is used
    (Diffusion-LM's clamping to the embedding table).
    """
    if steps < 1:
        raise ValueError("steps must be at least 1")
    x = noise
    grid = time_grid(steps)
    previous = torch.zeros_like(noise) if self_condition else None
    for i in range(steps):
        t, t_next = grid[i], grid[i + 1]
        t_vec = torch.full((x.shape[0],), t, device=x.device, dtype=x.dtype)
        out = denoise(x, t_vec, i) if previous is None else denoise(x, t_vec, i, previous)
        y_hat = clean_estimate(out, x, t_vec, prediction)
        if refine is not None:
            y_hat = refine(y_hat)
        if self_condition:
            previous = y_hat
        x = y_hat if t_next == 0 else x + (t_next - t) * (x - y_hat) / t
    return x


def corrupt(c: torch.Tensor, sigma_max: float, draws) -> torch.Tensor:
    """c + sigma z, sigma ~ U(0, sigma_max) per sequence (drawn after the item's other draws, on c's device)."""
    if sigma_max <= 0:
        return c
    sigma = draws.rand() * sigma_max
    z = draws.randn(*c.shape[1:])
    return c + sigma[:, None, None] * z


@torch.no_grad()
def validation_loss(
    net, y: torch.Tensor, c: torch.Tensor | None = None, prediction: str = "x0", batch: int = 64
) -> float:
    """Every trained part's validation number: the x0 mean squared error of y (N, T, D) over the fixed grid
    VALIDATION_TIMES, the noise drawn from VALIDATION_SEED; net(x_t, t, c) with a condition c (the bridge),
    net(x_t, t) without one (the prior, no self-conditioning input)."""
    device = next(net.parameters()).device
    on_device = device.type == "cuda"  # the noise drawn where it is used, one stream per time (configs.gpu_key)
    gen = torch.Generator().manual_seed(VALIDATION_SEED)
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0  # read once, at the end
    for i, t_value in enumerate(VALIDATION_TIMES):
        if on_device:
            gen = torch.Generator(device=device).manual_seed(VALIDATION_SEED + i)
        else:  # the CPU's stream, every CPU artifact's validation loss
            eps_all = torch.randn(y.shape, generator=gen)
        for s in range(0, y.shape[0], batch):
            yb = y[s : s + batch].to(device)
            eb = torch.randn(yb.shape, generator=gen, device=device) if on_device else eps_all[s : s + batch]
            t = torch.full((yb.shape[0],), t_value, device=device)
            x_t = noisy(yb, eb, t)
            out = net(x_t, t) if c is None else net(x_t, t, c[s : s + batch].to(device))
            y_hat = clean_estimate(out.float(), x_t, t, prediction)
            total += ((y_hat - yb) ** 2).sum().double()
            count += yb.numel()
    return float(total) / count
