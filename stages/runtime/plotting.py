"""Matplotlib without a display: one way to open and save a figure for every stage."""

from __future__ import annotations


def figure(width: float = 8, height: float = 4.5):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def save(fig, ax, path, title: str, dpi: int = 120) -> None:
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
