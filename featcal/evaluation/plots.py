"""PNG plots of results (matplotlib, headless)."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_drift(rows: list[dict], path: str | os.PathLike) -> None:
    """Per-layer L2 distance and cosine similarity to the experts, merged vs calibrated."""
    layers = [r["layer"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric, title in ((axes[0], "l2", "mean L2 distance to experts"), (axes[1], "cosine", "cosine similarity to experts")):
        ax.plot(layers, [r[f"merged_{metric}"] for r in rows], "o-", label="merged")
        ax.plot(layers, [r[f"featcal_{metric}"] for r in rows], "s-", label="FeatCal")
        ax.set_xlabel("layer")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    _save(fig, path)


def plot_lines(rows: list[dict], x: str, ys: list[str], path: str | os.PathLike, ylabel: str,
               log_x: bool = False, hlines: dict[str, float] | None = None) -> None:
    """One line per key in `ys` over `x`, with optional horizontal reference lines."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for y in ys:
        ax.plot([r[x] for r in rows], [r[y] for r in rows], "o-", label=y)
    for i, (label, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, linestyle="--", color=f"C{len(ys) + i}", label=label)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
