"""The benchmark registry: standard names need a configured file, world-k* compose tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mempo.errors import ConfigError, DataError
from mempo.evaluation.benchmarks import (
    STANDARD_BENCHMARKS,
    WORLD_BENCHMARKS,
    load_benchmark,
    load_benchmarks,
    resolve_benchmark,
)


def _paths(world: Path) -> dict[str, str | None]:
    return {**{n: None for n in STANDARD_BENCHMARKS}, "world": str(world / "qa" / "test.jsonl")}


def test_registry_names_cover_the_standard_seven_and_the_world() -> None:
    assert STANDARD_BENCHMARKS == ("nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle")
    assert WORLD_BENCHMARKS == ("world", "world-k1", "world-k2", "world-k4", "world-k8", "world-k16")


@pytest.mark.parametrize("name", STANDARD_BENCHMARKS)
def test_requested_standard_benchmark_without_a_path_is_a_clear_error(tiny_world: Path, name: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_benchmarks(["world", name], _paths(tiny_world))
    assert e.value.field == f"benchmarks.{name}"
    assert "no file is configured" in e.value.message


def test_configured_but_missing_file_names_the_path(tiny_world: Path, tmp_path: Path) -> None:
    paths = {**_paths(tiny_world), "hotpotqa": str(tmp_path / "nope.jsonl")}
    with pytest.raises(DataError) as e:
        resolve_benchmark("hotpotqa", paths)
    assert e.value.path == str(tmp_path / "nope.jsonl")


def test_unknown_name_lists_the_known_ones(tiny_world: Path) -> None:
    with pytest.raises(ConfigError, match="unknown benchmark 'hotpot'.*bamboogle"):
        resolve_benchmark("hotpot", _paths(tiny_world))
    with pytest.raises(ConfigError, match="k must be in 1..16"):
        resolve_benchmark("world-k32", _paths(tiny_world))


def test_standard_benchmark_loads_from_a_flashrag_file_with_limit(tiny_world: Path, tmp_path: Path) -> None:
    f = tmp_path / "bamboogle.jsonl"
    f.write_text("".join(json.dumps({"id": i, "question": f"q{i}?", "golden_answers": [f"a{i}"]}) + "\n"
                         for i in range(5)))
    items = load_benchmark("bamboogle", {**_paths(tiny_world), "bamboogle": str(f)}, limit=3)
    assert [it.id for it in items] == ["0", "1", "2"]
    assert list(items[2].golden_answers) == ["a2"]


def test_custom_named_benchmark(tiny_world: Path) -> None:
    paths = {**_paths(tiny_world), "my-set": str(tiny_world / "qa" / "val.jsonl")}
    assert len(load_benchmark("my-set", paths, limit=4)) == 4


def test_world_k_composes_k_objective_tasks_deterministically(tiny_world: Path) -> None:
    paths = _paths(tiny_world)
    a = load_benchmark("world-k4", paths, limit=5, seed=0)
    b = load_benchmark("world-k4", paths, limit=5, seed=0)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
    assert len(a) == 5
    for task in a:
        objs = task.objectives
        assert len(objs) == 4 and task.metadata["k"] == 4
        assert task.question == "; ".join(o.question for o in objs)
        assert list(task.golden_answers) == ["; ".join(o.answers[0] for o in objs)]
    # The plain `world` benchmark is the test split in file order.
    world = load_benchmark("world", paths, limit=3)
    assert [q.id for q in world] == ["world-test-00000", "world-test-00001", "world-test-00002"]


def test_world_k16_is_capped_by_the_questions_available(tiny_world: Path) -> None:
    n_test = sum(1 for _ in open(tiny_world / "qa" / "test.jsonl"))
    tasks = load_benchmark("world-k16", _paths(tiny_world), limit=1000)
    assert len(tasks) == n_test // 16


def test_duplicate_or_empty_request_is_an_error(tiny_world: Path) -> None:
    with pytest.raises(ConfigError, match="twice"):
        load_benchmarks(["world", "world"], _paths(tiny_world))
    with pytest.raises(ConfigError, match="no benchmarks"):
        load_benchmarks([], _paths(tiny_world))
