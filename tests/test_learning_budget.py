"""`benchmarks/learning_budget.py`: the same seeds at two RL budgets, variant by variant (long -
short, paired by seed and task) and the gap between two variants at each budget."""

from __future__ import annotations

import json

import pytest
from benchmark_helpers import load_benchmark, write_study

from mempo.errors import MempoError
from mempo.evaluation.stats import paired_bootstrap


@pytest.fixture(scope="module")
def learning():
    return load_benchmark("learning")


@pytest.fixture(scope="module")
def lb():
    return load_benchmark("learning_budget")


SHORT = {"grpo": {1: [0.0, 0.0, 1.0, 0.0], 2: [1.0, 0.0, 0.0, 0.0]},
         "mempo_half": {1: [1.0, 0.0, 1.0, 0.0], 2: [1.0, 1.0, 0.0, 0.0]}}
LONG = {"grpo": {1: [1.0, 0.0, 1.0, 0.0], 2: [1.0, 1.0, 0.0, 0.0], 3: [1.0, 1.0, 1.0, 1.0]},
        "mempo_half": {1: [1.0, 0.0, 1.0, 0.0], 2: [1.0, 1.0, 1.0, 0.0], 3: [0.0, 0.0, 0.0, 0.0]}}


def _tasks(vals):
    return {f"t{i}": v for i, v in enumerate(vals)}


def test_more_steps_and_the_gap_change_are_paired_by_seed_and_task(learning, lb, tmp_path):
    long = write_study(learning, tmp_path / "l" / "long.json", [1, 2, 3], LONG, rl_steps=4)
    short = write_study(learning, tmp_path / "s" / "short.json", [1, 2], SHORT, rl_steps=2)
    out = lb.compare(lb.load_study(long, "mempo_half", "grpo"), lb.load_study(short, "mempo_half", "grpo"),
                     ["mempo_half", "grpo"], 200)
    assert out["seeds"] == [1, 2] and out["rl_steps"] == {"long": 4, "short": 2}  # seed 3 has no partner
    assert out["resampled"].startswith("seeds, then tasks")
    d = out["more_steps"]["grpo"]["k2/objective_em"]
    assert d["mean"] == pytest.approx((0.25 + 0.25) / 2)  # one task more right on each seed
    assert d == paired_bootstrap([_tasks(LONG["grpo"][s]) for s in (1, 2)],
                                 [_tasks(SHORT["grpo"][s]) for s in (1, 2)], 200)
    assert out["more_steps"]["mempo_half"]["k4/em"]["mean"] == pytest.approx((0.0 + 0.25) / 2)
    gap = out["gap"]
    assert gap["short"]["k2/em"]["mean"] == pytest.approx((0.25 + 0.25) / 2)  # mempo_half led by a task a seed
    assert gap["long"]["k2/em"]["mean"] == pytest.approx((0.0 + 0.25) / 2)
    assert gap["change"]["k2/em"]["mean"] == pytest.approx(-0.125)  # the lead shrank on seed 1
    assert gap["change"]["k2/em"]["ci95_low"] < -0.125 < 0.0 <= gap["change"]["k2/em"]["ci95_high"]
    assert gap["change"]["single/forgetting_rate"] is None  # no forgetting on single questions


def test_without_a_per_task_file_seed_means_are_compared(learning, lb, tmp_path, capsys):
    long = write_study(learning, tmp_path / "l" / "long.json", [1, 2, 3], LONG, rl_steps=4)
    short = write_study(learning, tmp_path / "s" / "short.json", [1, 2], SHORT, rl_steps=2)
    learning.per_task_path(short).unlink()  # a study from before the per-task files
    out_path = tmp_path / "budget.json"
    assert lb.main([str(long), str(short), "--variants", "grpo", "--out", str(out_path)]) == 0
    printed = capsys.readouterr().out
    assert "4 - 2 RL steps, seeds [1, 2] (seeds only resampled)" in printed and "gap" not in printed
    out = json.loads(out_path.read_text())
    d = out["more_steps"]["grpo"]["single/em"]
    assert (d["mean"], d["ci95_low"], d["ci95_high"], d["seeds"]) == (0.25, 0.25, 0.25, 2)
    assert "gap" not in out and list(out["more_steps"]) == ["grpo"]
    assert out_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_studies_that_differ_in_more_than_the_steps_or_share_no_seed_are_refused(learning, lb, tmp_path, capsys):
    long = write_study(learning, tmp_path / "l" / "long.json", [1, 2, 3], LONG, rl_steps=4)
    short = write_study(learning, tmp_path / "s" / "short.json", [1, 2], SHORT, rl_steps=2)
    assert lb.main([str(short), str(long), "--variants", "grpo", "mempo_half"]) == 2
    assert "short.json: 2 RL steps, not more than" in capsys.readouterr().err
    study = json.loads(short.read_text())
    study["config"]["n_rollouts"] = 8
    other = tmp_path / "s" / "other.json"
    other.write_text(json.dumps(study))
    assert lb.main([str(long), str(other), "--variants", "grpo"]) == 2
    assert "config.n_rollouts is 4, but" in capsys.readouterr().err
    far = write_study(learning, tmp_path / "f" / "far.json", [7], {v: {7: [0.0] * 4} for v in SHORT}, rl_steps=2)
    with pytest.raises(MempoError, match="share no seed"):
        lb.compare(lb.load_study(long, "grpo", "grpo"), lb.load_study(far, "grpo", "grpo"), ["grpo"])
    assert lb.main([str(long), str(short), "--variants", "full"]) == 2
    assert "long.json: no variant 'full'" in capsys.readouterr().err
    restarted = write_study(learning, tmp_path / "r" / "restarted.json", [1, 2], SHORT, rl_steps=2, sft=[1.0] * 4)
    assert lb.main([str(long), str(restarted), "--variants", "grpo"]) == 2
    assert "restarted.json: its RL start has sft single em 1.0, but" in capsys.readouterr().err


MIX = ("--rl-mix", "1:1", "2:0.5", "4:1")


def test_two_rl_mixtures_are_compared_like_two_budgets(learning, lb, tmp_path, capsys):
    """`--setting rl_mix`: a study run with `--rl-mix` against one on params.yaml's mixture,
    same steps, paired by seed and task; the gap's change is the mixture's effect on the lead."""
    mix = write_study(learning, tmp_path / "m" / "mix.json", [1, 2, 3], LONG, rl_steps=2, extra=MIX)
    base = write_study(learning, tmp_path / "b" / "base.json", [1, 2], SHORT, rl_steps=2)
    out_path = tmp_path / "mix_vs_base.json"
    assert lb.main([str(mix), str(base), "--setting", "rl_mix", "--variants", "mempo_half", "grpo",
                    "--bootstrap", "200", "--out", str(out_path)]) == 0
    printed = capsys.readouterr().out
    assert "RL on 1:1 2:0.5 4:1 - on the default mixture, seeds [1, 2]" in printed
    out = json.loads(out_path.read_text())
    assert out["rl_mix"]["mix"] == [{"k": 1, "share": 1.0}, {"k": 2, "share": 0.5}, {"k": 4, "share": 1.0}]
    assert "more_steps" not in out and "rl_steps" not in out
    d = out["with_mix"]["grpo"]["k2/objective_em"]
    assert d == paired_bootstrap([_tasks(LONG["grpo"][s]) for s in (1, 2)],
                                 [_tasks(SHORT["grpo"][s]) for s in (1, 2)], 200)
    assert out["gap"]["base"]["k2/em"]["mean"] == pytest.approx(0.25)
    assert out["gap"]["change"]["k2/em"]["mean"] == pytest.approx(-0.125)
    assert out_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_studies_of_two_mixtures_are_not_one_experiment(learning, lb, tmp_path, capsys):
    """A mixture study pools and compares by steps only with studies of its own mixture; one
    compared by mixture must keep the steps, and two of one mixture have nothing to compare."""
    mix = write_study(learning, tmp_path / "m" / "mix.json", [1, 2], SHORT, rl_steps=4, extra=MIX)
    base = write_study(learning, tmp_path / "b" / "base.json", [1, 2], SHORT, rl_steps=2)
    assert lb.main([str(mix), str(base), "--variants", "grpo"]) == 2
    assert "mix.json: config.rl_mix is [{'k': 1, 'share': 1.0}" in capsys.readouterr().err
    assert lb.main([str(mix), str(base), "--setting", "rl_mix", "--variants", "grpo"]) == 2
    assert "mix.json: config.rl_steps is 4, but" in capsys.readouterr().err
    again = write_study(learning, tmp_path / "a" / "again.json", [1, 2], LONG, rl_steps=2)
    assert lb.main([str(again), str(base), "--setting", "rl_mix", "--variants", "grpo"]) == 2
    assert "both trained RL on the default mixture: nothing to compare" in capsys.readouterr().err


def test_two_reward_rules_are_compared_by_their_overrides(learning, lb, tmp_path, capsys):
    """`--setting rl_set`: a study run with `--rl-set` against one on params.yaml as it is."""
    changed = write_study(learning, tmp_path / "m" / "mean.json", [1, 2], LONG, rl_steps=2,
                          extra=("--rl-set", "mempo.multi_rule=mean"))
    base = write_study(learning, tmp_path / "b" / "base.json", [1, 2], SHORT, rl_steps=2)
    assert lb.main([str(changed), str(base), "--variants", "grpo"]) == 2
    assert "mean.json: config.rl_set is {'mempo.multi_rule': 'mean'}" in capsys.readouterr().err
    assert lb.main([str(changed), str(base), "--setting", "rl_set", "--variants", "grpo", "--bootstrap", "50"]) == 0
    assert "RL on mempo.multi_rule=mean - on params.yaml, seeds [1, 2]" in capsys.readouterr().out
    out = lb.compare(lb.load_study(changed, "grpo", "grpo"), lb.load_study(base, "grpo", "grpo"), ["grpo"], 50,
                     "rl_set")
    assert out["rl_set"] == {"set": {"mempo.multi_rule": "mean"}, "base": "params.yaml"}
    assert out["with_set"]["grpo"]["k2/objective_em"]["mean"] == pytest.approx(0.25)
