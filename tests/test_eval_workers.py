"""`eval.workers`: the (benchmark, agent) pairs in spawned worker processes give the rows of
the single-process run, in its order; a worker's error reaches the caller as raised.

Real components: the tiny (untrained) policy, BM25 over the tiny world's corpus, greedy
decoding, the memory probe on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from mempo.config import load_params
from mempo.errors import DataError
from mempo.evaluation.runner import run_eval
from mempo.evaluation.workers import pair_cost, pair_order

TIMING_COLUMNS = ("latency_s",)


@pytest.fixture(scope="module")
def tiny_policy(tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained tiny Qwen2 policy (BPE tokenizer trained on the tiny world)."""
    from mempo.policy.tiny import TinyPolicySpec, bootstrap_tiny

    out = tmp_path_factory.mktemp("policy") / "tiny"
    bootstrap_tiny(
        out,
        tiny_world / "corpus.jsonl",
        [tiny_world / "qa" / "train.jsonl"],
        spec=TinyPolicySpec(copy_steps=0),
    )
    return out


def _params(tiny_world: Path, tiny_policy: Path, out: Path, **eval_over: Any) -> Any:
    over: dict[str, Any] = {
        "eval.model": str(tiny_policy),
        "eval.retriever": str(tiny_world / "corpus.jsonl"),
        "eval.benchmarks": ["world", "world-k2"],
        "eval.agents": ["memory", "rag", "direct"],
        "eval.limit": 3,
        "eval.out": str(out),
        "eval.rollout.max_new_tokens": 16,
        "eval.rollout.turns_per_objective": 2,
        "eval.mlflow_genai_samples": 0,
        "benchmarks.world": str(tiny_world / "qa" / "test.jsonl"),
    }
    over.update({f"eval.{k}": v for k, v in eval_over.items()})
    return load_params(None, overrides=over)


def _same(a: Any, b: Any) -> bool:
    return (
        isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    ) or a == b


def test_pairs_are_queued_costliest_first() -> None:
    from mempo.tasks import Objective, Task

    def task(i: int, k: int) -> Task:
        objs = tuple(Objective(question=f"q{i}.{j}", answers=("a",)) for j in range(k))
        return Task(
            id=str(i),
            question="; ".join(o.question for o in objs),
            objectives=objs,
            golden_answers=("a",),
        )

    items = {"world": [task(i, 1) for i in range(4)], "world-k2": [task(i, 2) for i in range(4)]}
    assert pair_cost("memory", items["world-k2"]) == 4 * 2 * 3
    assert pair_cost("rag", items["world-k2"]) == 4 * 2
    assert pair_order(items, ["memory", "rag", "direct"]) == [
        ("world-k2", "memory"),  # 24
        ("world", "memory"),  # 12
        ("world-k2", "rag"),  # 8, ties keep benchmark then agent order
        ("world-k2", "direct"),
        ("world", "rag"),  # 4
        ("world", "direct"),
    ]


def test_two_workers_give_the_rows_of_one_process_in_its_order(
    tiny_world: Path, tiny_policy: Path, tmp_path: Path
) -> None:
    p = _params(tiny_world, tiny_policy, tmp_path / "one")
    one = run_eval(p.eval, p.benchmarks, track=False)
    p = _params(tiny_world, tiny_policy, tmp_path / "two", workers=2)
    two = run_eval(p.eval, p.benchmarks, track=False)

    assert (one.meta["workers"], two.meta["workers"]) == (1, 2)
    assert json.loads((tmp_path / "two" / "eval.json").read_text())["workers"] == 2
    assert len(one.rows) == 2 * 3 * 3
    assert [(r["benchmark"], r["agent"], r["id"]) for r in two.rows] == [
        (r["benchmark"], r["agent"], r["id"]) for r in one.rows
    ]
    columns = [c for c in one.rows[0] if c not in TIMING_COLUMNS]
    assert set(columns) == {c for c in two.rows[0] if c not in TIMING_COLUMNS}
    for a, b in zip(one.rows, two.rows, strict=True):
        differ = [c for c in columns if not _same(a[c], b[c])]
        assert differ == [], (a["benchmark"], a["agent"], a["id"], differ)
    # The probe ran in the workers too (the memory agent's rows with a final memory).
    probed = [r for r in two.rows if r["agent"] == "memory" and r["final_memory"]]
    assert all(not math.isnan(r["memory_probe"]) for r in probed)
    # Same metrics, except the timings.
    m1, m2 = (
        {
            k: v
            for k, v in json.loads((tmp_path / d / "metrics.json").read_text()).items()
            if "latency" not in k
        }
        for d in ("one", "two")
    )
    assert m1.keys() == m2.keys() and all(_same(m1[k], m2[k]) for k in m1)


def test_an_error_in_a_worker_reaches_the_caller_as_raised(
    tiny_world: Path, tiny_policy: Path, tmp_path: Path
) -> None:
    # A retriever folder that is no index: with workers the parent never opens the retriever,
    # each worker's engines do, so the error is raised in a worker.
    missing = tmp_path / "no-index"
    p = _params(tiny_world, tiny_policy, tmp_path / "eval", retriever=str(missing), workers=2)
    with pytest.raises(DataError, match="not an index folder") as in_worker:
        run_eval(p.eval, p.benchmarks, track=False)
    assert in_worker.value.path == str(missing)
    assert "Traceback" in str(in_worker.value.__cause__)  # the worker's traceback
    p.eval.workers = 1
    with pytest.raises(DataError) as in_process:
        run_eval(p.eval, p.benchmarks, track=False)
    assert str(in_worker.value) == str(in_process.value)
    assert not (tmp_path / "eval").exists()
