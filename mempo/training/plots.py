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


def _save(fig: Any, out: str | Path) -> Path:
    """Lay out, write as PNG atomically, close."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
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
    return _save(fig, out)


def plot_forest(rows: Sequence[tuple[str, dict[str, float], dict[str, float]]], xlabel: str, out: str | Path,
                legend_title: str = "") -> Path:
    """A forest plot: per row (label, interval, marks), the interval's mean with its 95% range
    (`mempo.evaluation.stats` result: mean, ci95_low, ci95_high), and each mark (name -> value,
    e.g. one study's own mean) as a small coloured tick beside it. The first row is on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(rows) + 1.4), dpi=100)
    colours: dict[str, str] = {}
    for y, (_, d, marks) in zip(range(len(rows) - 1, -1, -1), rows, strict=True):
        ax.errorbar([d["mean"]], [y], xerr=[[d["mean"] - d["ci95_low"]], [d["ci95_high"] - d["mean"]]],
                    fmt="o", color="black", capsize=3)
        for name, value in marks.items():
            new = name not in colours
            colours.setdefault(name, f"C{len(colours)}")
            ax.plot([value], [y + 0.22], marker="|", markersize=8, linestyle="none", color=colours[name],
                    label=name if new else None)
    ax.axvline(0.0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in reversed(rows)])
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)
    if len(colours) > 1:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title=legend_title, title_fontsize=8)
    return _save(fig, out)
