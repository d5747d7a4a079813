"""Paired bootstrap of variant differences (mempo.evaluation.stats)."""

from __future__ import annotations

import random

import pytest

from mempo.evaluation.stats import paired_bootstrap


def test_a_constant_difference_has_a_zero_width_interval():
    a = [{"t1": 1.0, "t2": 1.0, "t3": 0.0}, {"t1": 1.0, "t2": 0.0, "t3": 1.0}]
    b = [{"t1": 0.5, "t2": 0.5, "t3": -0.5}, {"t1": 0.5, "t2": -0.5, "t3": 0.5}]
    d = paired_bootstrap(a, b, n_boot=200)
    assert d["mean"] == pytest.approx(0.5) and d["ci95_low"] == pytest.approx(0.5) == d["ci95_high"]
    assert d["seeds"] == 2 and d["tasks_per_seed"] == 3


def test_pairing_by_task_skips_missing_and_none_and_the_interval_covers_the_mean():
    rng = random.Random(1)
    a = [{f"t{i}": float(rng.random() < 0.6) for i in range(200)} for _ in range(5)]
    b = [{f"t{i}": float(rng.random() < 0.4) for i in range(200)} for _ in range(5)]
    b[0]["t0"] = None
    del b[1]["t1"]
    d = paired_bootstrap(a, b, n_boot=500)
    assert d["ci95_low"] < d["mean"] < d["ci95_high"]
    assert 0.1 < d["mean"] < 0.3 and d["ci95_low"] > 0.0  # a real gain of ~0.2 is detected
    assert d["tasks_per_seed"] == pytest.approx((199 + 199 + 200 * 3) / 5)
    # no difference: the interval straddles 0
    d0 = paired_bootstrap(a, a[::-1], n_boot=500)
    assert d0["ci95_low"] < 0.0 < d0["ci95_high"]


def test_unpaired_inputs_are_refused_and_nothing_in_common_is_none():
    with pytest.raises(ValueError, match="pair"):
        paired_bootstrap([{"t": 1.0}], [])
    assert paired_bootstrap([{"t": 1.0}], [{"u": 1.0}]) is None


def test_seed_bootstrap_resamples_per_seed_differences():
    from mempo.evaluation.stats import seed_bootstrap

    d = seed_bootstrap([0.1, 0.1, 0.1], n_boot=100)
    assert (d["mean"], d["ci95_low"], d["ci95_high"], d["seeds"]) == pytest.approx((0.1, 0.1, 0.1, 3))
    d = seed_bootstrap([0.05, -0.02, 0.03, 0.01, 0.04, -0.01], n_boot=1000)
    assert d["mean"] == pytest.approx(0.1 / 6) and d["ci95_low"] < d["mean"] < d["ci95_high"]
    assert min([0.05, -0.02]) <= d["ci95_low"] and d["ci95_high"] <= 0.05
    assert seed_bootstrap([]) is None
