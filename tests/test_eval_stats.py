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


def test_curve_slopes_are_least_squares_per_100_steps_in_each_half():
    from mempo.evaluation.stats import curve_slopes

    # rising 0.01 a step for 10 steps, then flat at the value it reached; a None step is left out
    curve = [0.01 * i for i in range(10)] + [0.2] * 4 + [None] + [0.2] * 5
    s = curve_slopes(curve)
    assert s["early"] == pytest.approx(1.0) and s["late"] == pytest.approx(0.0)
    # hand-worked: y = 0, 1, 0, 1 against x = 0..3: sum (x - 1.5)(y - 0.5) = 1, sum (x - 1.5)^2 = 5,
    # slope 0.2 a step, 20 per 100 steps
    assert curve_slopes([9, 9, 9, 9, 0, 1, 0, 1])["late"] == pytest.approx(20.0)
    assert curve_slopes([0.5, 0.5]) == {"early": None, "late": None}  # too short to fit


def test_pooled_slopes_say_rising_flat_or_undecided_from_the_late_interval():
    from mempo.evaluation.stats import slopes_over_seeds

    rising = {s: [0.001 * (s + 1) * i for i in range(20)] for s in range(3)}  # every seed still rising
    out = slopes_over_seeds(rising, 200)
    assert out["verdict"] == "rising" and out["late"]["ci95_low"] > 0 and out["late"]["seeds"] == 3
    assert out["per_seed"][1]["late"] == pytest.approx(0.2)
    falling = {s: [1.0 - 0.01 * i for i in range(20)] for s in range(2)}
    assert slopes_over_seeds(falling, 50)["verdict"] == "falling"
    # one seed falls as much as another rises in its second half: the interval straddles 0 widely
    split = {0: [0.01 * i for i in range(10)] + [0.1 + 0.01 * i for i in range(10)],
             1: [0.01 * i for i in range(10)] + [0.1 - 0.01 * i for i in range(10)]}
    out = slopes_over_seeds(split, 200)
    assert out["verdict"] == "undecided" and out["early"]["mean"] == pytest.approx(1.0)
    # both seeds rose, then settled within 0.01 per 100 steps of level
    settled = {s: [0.01 * i for i in range(10)] + [0.1 + 0.0001 * (-1) ** s * i for i in range(10)] for s in range(2)}
    assert slopes_over_seeds(settled, 200)["verdict"] == "flat"
    # still rising, surely, but by less than the tolerance (0.005-0.01 per 100 steps): flat, not rising
    slow = {s: [0.01 * i for i in range(10)] + [0.1 + 0.00005 * (s + 1) * i for i in range(10)] for s in range(2)}
    out = slopes_over_seeds(slow, 200)
    assert out["late"]["ci95_low"] > 0 and out["late"]["ci95_high"] < 0.02 and out["verdict"] == "flat"
    assert slopes_over_seeds({0: [0.1]}, 50)["verdict"] is None
    one = slopes_over_seeds({0: [0.01 * i for i in range(20)]}, 50)  # rising, but one seed has no interval
    assert one["late"]["mean"] == pytest.approx(1.0) and one["verdict"] == "undecided"


def test_strata_resample_seeds_within_their_start_and_one_stratum_draws_as_none():
    """Seeds of two starts: stratified, every replicate keeps each start's seed count, so a
    start whose seeds all agree adds no width; with one label the draws are the unstratified ones."""
    from mempo.evaluation.stats import seed_bootstrap

    diffs = [0.0, 0.0, 0.0, 1.0, 1.0]
    free = seed_bootstrap(diffs, 500)
    strat = seed_bootstrap(diffs, 500, strata=["a", "a", "a", "b", "b"])
    assert strat["mean"] == free["mean"] == pytest.approx(0.4) and strat["strata"] == 2 and "strata" not in free
    assert strat["ci95_low"] == strat["ci95_high"] == pytest.approx(0.4)  # 3 x 0 and 2 x 1 in every replicate
    assert free["ci95_high"] - free["ci95_low"] > 0.3
    assert seed_bootstrap(diffs, 500, strata=["x"] * 5) == free
    rng = random.Random(3)
    a = [{f"t{i}": float(rng.random() < 0.6) for i in range(30)} for _ in range(4)]
    b = [{f"t{i}": float(rng.random() < 0.4) for i in range(30)} for _ in range(4)]
    assert paired_bootstrap(a, b, 300, strata=[1, 1, 1, 1]) == paired_bootstrap(a, b, 300)
    two = paired_bootstrap(a, b, 300, strata=[1, 1, 2, 2])
    assert two["strata"] == 2 and two["mean"] == paired_bootstrap(a, b, 300)["mean"]
    with pytest.raises(ValueError, match="one label per seed"):
        seed_bootstrap(diffs, 10, strata=["a"])
