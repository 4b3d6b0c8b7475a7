"""Matplotlib without a display: one way to open and save a figure for every stage."""

from __future__ import annotations


def figure(width: float = 8, height: float = 4.5, ncols: int = 1, width_ratios=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(ncols=ncols, figsize=(width, height), width_ratios=width_ratios)


def save(fig, ax, path, title: str, dpi: int = 120) -> None:
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def loss_curve(log: list[dict], path, title: str, ylabel: str, floor: float | None = None) -> None:
    """Training loss per step and the EMA validation loss where it was evaluated, log scale; floor, a
    reference loss (the decoder's unigram entropy) as a dashed line."""
    fig, ax = figure(7, 4)
    ax.plot([r["step"] for r in log], [r["train_loss"] for r in log], alpha=0.5, label="train")
    val = [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), marker="o", label="validation (EMA)")
    if floor is not None:
        ax.axhline(floor, color="gray", linestyle="--", label=f"reference {floor:.2f}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend()
    save(fig, ax, path, title, dpi=110)
