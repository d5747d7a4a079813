"""`mempo.training.plots`: PNG curves, and the trailing mean that makes long noisy curves readable."""

from __future__ import annotations

import pytest

from mempo.training.plots import moving_mean, plot_curves


def test_moving_mean_is_the_trailing_mean_over_the_window():
    assert moving_mean([1.0, 3.0, 5.0, 7.0, 9.0], 2) == pytest.approx([1.0, 2.0, 4.0, 6.0, 8.0])
    assert moving_mean([4.0, 0.0, 2.0, 6.0], 3) == pytest.approx([4.0, 2.0, 2.0, 8 / 3])
    assert moving_mean([0.5, 0.7], 1) == [0.5, 0.7]


def test_a_smoothed_plot_draws_the_raw_line_faint_under_its_mean(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    drawn = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (drawn.extend(fig.axes[0].get_lines()), close(fig)))
    history = [{"step": i + 1, "reward": (i % 2) * 1.0} for i in range(40)]
    out = plot_curves(history, ["reward", "absent"], tmp_path / "p" / "curve.png", smooth=4)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    raw, mean = drawn
    assert raw.get_alpha() == pytest.approx(0.2) and mean.get_label() == "reward (mean of 4)"
    assert list(mean.get_ydata())[3:] == pytest.approx([0.5] * 37)  # the 0/1 alternation averages out
