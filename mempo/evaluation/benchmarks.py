"""The benchmark registry: a name -> the questions to evaluate on.

    paths = {"hotpotqa": "data/qa/hotpotqa/dev.jsonl", "world": "data/world/qa/test.jsonl"}
    items = load_benchmark("world-k4", paths, limit=100, seed=0)

Names:
- the standard seven QA sets of the MemPO / Search-R1 papers, each a FlashRAG jsonl file
  whose path comes from the `benchmarks:` section of params.yaml (null by default: nothing
  is bundled, and asking for one without a path is an error, never a silent skip);
- `world`: the knowledge world's held-out questions (`qa/test.jsonl`);
- `world-k{1,2,4,8,16}`: multi-objective tasks composed from those same questions with
  `mempo.tasks.compose_multi_objective` (k questions joined with "; ");
- any other name given a path in `benchmarks:` (a custom FlashRAG set).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mempo.datasets import load_qa
from mempo.errors import ConfigError, DataError
from mempo.tasks import MAX_OBJECTIVES, Task, compose_multi_objective

STANDARD_BENCHMARKS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wiki", "musique", "bamboogle")
WORLD_BENCHMARK = "world"
WORLD_K_VALUES = (1, 2, 4, 8, 16)
WORLD_BENCHMARKS = (WORLD_BENCHMARK, *(f"world-k{k}" for k in WORLD_K_VALUES))
_WORLD_K = re.compile(r"^world-k(\d+)$")


@dataclass(frozen=True)
class BenchmarkSpec:
    """Where a benchmark's questions come from.

    Attributes:
        name: the registry name (`hotpotqa`, `world-k8`).
        path: the FlashRAG jsonl file read.
        k: objectives per task (1 for plain question sets).
        composed: True when the tasks are composed from `path` with `compose_multi_objective`.
    """

    name: str
    path: Path
    k: int = 1
    composed: bool = False


def objectives_k(name: str) -> int | None:
    """k of a `world-k{k}` name, None for any other name."""
    m = _WORLD_K.match(name)
    return int(m.group(1)) if m else None


def resolve_benchmark(name: str, paths: Mapping[str, str | None]) -> BenchmarkSpec:
    """Find where benchmark `name` is read from, checking the file exists.

    Args:
        name: a registry name (see the module docstring).
        paths: the `benchmarks:` section, name -> jsonl path or None.

    Raises:
        ConfigError: the name is unknown, or a known benchmark has no path configured.
        DataError: the configured file does not exist.
    """
    k = objectives_k(name)
    if k is not None:
        if not 1 <= k <= MAX_OBJECTIVES:
            raise ConfigError(f"benchmark '{name}': k must be in 1..{MAX_OBJECTIVES}", field="eval.benchmarks")
        source = WORLD_BENCHMARK
    else:
        source = name
    if source not in paths and source not in STANDARD_BENCHMARKS:
        known = sorted({*STANDARD_BENCHMARKS, *WORLD_BENCHMARKS, *paths})
        raise ConfigError(
            f"unknown benchmark '{name}'; known: {', '.join(known)} "
            "(or add `NAME: path/to/flashrag.jsonl` under `benchmarks:` in params.yaml)",
            field="eval.benchmarks",
        )
    raw = paths.get(source)
    if raw is None or str(raw).strip() == "":
        raise ConfigError(
            f"benchmark '{name}' was requested but no file is configured for it: set "
            f"`benchmarks.{source}` in params.yaml to its FlashRAG jsonl path "
            f"(e.g. --set benchmarks.{source}=data/{source}/test.jsonl)",
            field=f"benchmarks.{source}",
        )
    path = Path(raw)
    if not path.is_file():
        raise DataError(
            f"benchmark '{name}': file not found (configured as benchmarks.{source})", path=path
        )
    return BenchmarkSpec(name=name, path=path, k=k or 1, composed=k is not None)


def load_benchmark(
    name: str,
    paths: Mapping[str, str | None],
    *,
    limit: int | None = None,
    seed: int = 0,
) -> list[Task]:
    """The questions (or composed tasks) of benchmark `name`, in a fixed order.

    The first `limit` items are kept (file order; for composed tasks the order the seeded
    composition gives), so two runs with the same params evaluate identical inputs.

    Raises:
        ConfigError / DataError: see `resolve_benchmark`; DataError for a malformed file or
        too few questions to compose one task.
    """
    spec = resolve_benchmark(name, paths)
    items = load_qa(spec.path)
    if spec.composed:
        if len(items) < spec.k:
            raise DataError(
                f"benchmark '{name}' needs at least {spec.k} questions to compose one task; "
                f"the file has {len(items)}",
                path=spec.path,
            )
        n_tasks = len(items) // spec.k
        if limit is not None:
            n_tasks = min(n_tasks, limit)
        return compose_multi_objective(items, k=spec.k, n_tasks=n_tasks, seed=seed, id_prefix=name)
    if not items:
        raise DataError(f"benchmark '{name}' has no questions", path=spec.path)
    return items if limit is None else items[:limit]


def load_benchmarks(
    names: list[str],
    paths: Mapping[str, str | None],
    *,
    limit: int | None = None,
    seed: int = 0,
) -> dict[str, list[Task]]:
    """`load_benchmark` for each name, all resolved before any is loaded (fail fast)."""
    if not names:
        raise ConfigError("no benchmarks requested", field="eval.benchmarks")
    if len(set(names)) != len(names):
        raise ConfigError(f"benchmark listed twice in {names}", field="eval.benchmarks")
    for name in names:
        resolve_benchmark(name, paths)
    return {name: load_benchmark(name, paths, limit=limit, seed=seed) for name in names}
