"""Training curves as PNG (matplotlib Agg; no display needed).

    plot_curves(history, ["loss", "val_loss"], "outputs/sft/plots/sft_loss.png")
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mempo.io import atomic_path


def moving_mean(ys: Sequence[float], window: int) -> list[float]:
    """Trailing mean of the last `window` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(
    history: Sequence[dict[str, Any]], keys: Sequence[str], out: str | Path, title: str = "",
    x: str = "step", smooth: int = 0,
) -> Path:
    """One line per key of `history` rows (rows without the key are skipped) against `x`.
    `smooth` > 1: each raw line drawn faint, under its trailing mean over `smooth` points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for key in keys:
        pts = [(r[x], r[key]) for r in history if key in r and r[key] == r[key]]
        if not pts:
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if smooth > 1:
            (raw,) = ax.plot(xs, ys, alpha=0.2, linewidth=0.8)
            ax.plot(xs, moving_mean(ys, smooth), color=raw.get_color(), label=f"{key} (mean of {smooth})")
        else:
            ax.plot(xs, ys, label=key, marker="." if len(pts) < 30 else None)
    ax.set_xlabel(x)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return out
