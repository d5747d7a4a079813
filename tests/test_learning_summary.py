"""`benchmarks/learning.py`'s summary on hand-built job results: per-variant seeds (the
full-history variant may run fewer), paired differences only on the seeds both ran."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def learning():
    spec = importlib.util.spec_from_file_location("learning_bench", REPO / "benchmarks" / "learning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _job(values: dict[str, list[float]], curve_reward: float = 0.5) -> dict:
    """A job result whose per-task objective EM on each set is `values[bench]`."""
    ev = {}
    for bench, vals in values.items():
        per = {f"t{i}": {"em": v, "objective_em": v, "forgetting_rate": None} for i, v in enumerate(vals)}
        agg = {"n": len(vals), "em": sum(vals) / len(vals), "objective_em": sum(vals) / len(vals)}
        ev[bench] = {"aggregate": agg, "per_task": per}
    return {"eval": ev, "mean_time_step": 1.0, "mem_scoring_share": 0.0,
            "curve": [{"step": i + 1, "reward_mean": curve_reward} for i in range(3)]}


def test_paired_differences_use_the_seeds_both_variants_ran(learning, tmp_path):
    a = learning._args(["--seeds", "0", "1", "2", "--full-seeds", "0", "--variants", "grpo", "mempo", "full",
                        "--rl-steps", "3", "--bootstrap", "200", "--workdir", str(tmp_path)])
    assert learning.seeds_of(a, "mempo") == [0, 1, 2] and learning.seeds_of(a, "full") == [0]
    sets = ("single", "k2", "k4")
    results = {"untrained": _job({b: [0.0, 0.0] for b in sets}), "sft-memory": _job({b: [0.0, 1.0] for b in sets}),
               "sft-full": _job({b: [0.0, 1.0] for b in sets})}
    for s in range(3):
        results[f"rl-grpo-seed{s}"] = _job({b: [0.0, 0.0] for b in sets})
        results[f"rl-mempo-seed{s}"] = _job({b: [1.0, 0.0] for b in sets})  # +0.5 over grpo on every seed
    results["rl-full-seed0"] = _job({b: [1.0, 1.0] for b in sets})  # mempo - full = -0.5 on seed 0
    out = learning.summarise(a, results)
    assert out["config"]["seeds"] == {"grpo": [0, 1, 2], "mempo": [0, 1, 2], "full": [0]}
    assert out["paired"]["mempo_minus_grpo"]["seeds"] == [0, 1, 2]
    d = out["paired"]["mempo_minus_grpo"]["k2/objective_em"]
    assert d["mean"] == pytest.approx(0.5) and d["seeds"] == 3
    f = out["paired"]["mempo_minus_full"]
    assert f["seeds"] == [0] and f["k4/em"]["mean"] == pytest.approx(-0.5)
    assert out["results"]["full"]["k2"]["em"]["per_seed"] == [1.0]
    assert len(out["results"]["mempo"]["k2"]["em"]["per_seed"]) == 3
    learning.print_table(out)  # the table skips the seed lists
