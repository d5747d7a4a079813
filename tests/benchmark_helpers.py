"""Load a script of benchmarks/ as a module (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from mempo.io import write_json, write_jsonl

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py, executed as a fresh module named `<name>_bench`."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SETS = ("single", "k2", "k4")


def study_job(vals: list[float], curve: list[float] | None = None) -> dict[str, Any]:
    """One job result of benchmarks/learning.py: per-task values `vals` on every test set (EM
    and objective EM alike; forgetting 0.5 on k >= 2), and a reward curve (default: one step)."""
    ev = {b: {"aggregate": {"n": len(vals), "em": sum(vals) / len(vals), "objective_em": sum(vals) / len(vals),
                            "forgetting_rate": 0.5 if b != "single" else None},
              "per_task": {f"t{i}": {"em": v, "objective_em": v, "forgetting_rate": None if b == "single" else 0.5}
                           for i, v in enumerate(vals)}} for b in SETS}
    rewards = curve or [0.5]
    return {"eval": ev, "mean_time_step": 1.0, "mem_scoring_share": 0.0,
            "curve": [{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards)]}


def write_study(learning: ModuleType, path: Path, seeds: list[int], values: dict[str, dict[int, list[float]]],
                rl_steps: int = 1, sft: list[float] | None = None, start: str | None = None,
                extra: tuple[str, ...] = ()) -> Path:
    """A study of the variants in `values` on `seeds`, written as learning.py writes it (summary
    JSON and per-task file): variant v's per-task values on seed s are `values[v][s]`; the SFT
    start's per-task values are `sft` (default all 0) and its weights' digest `start` (default none);
    `extra`: more learning.py arguments (e.g. `--rl-mix 1:1 4:1`)."""
    a = learning._args(["--seeds", *map(str, seeds), "--variants", *values, "--rl-steps", str(rl_steps),
                        "--bootstrap", "50", "--workdir", str(path.parent), *extra])
    n = len(next(iter(next(iter(values.values())).values())))
    results = {k: study_job(sft or [0.0] * n) for k in ("untrained", "sft-memory", "sft-full")}
    if start is not None:
        for k in ("sft-memory", "sft-full"):
            results[k]["weights_sha256"] = f"{start}-{k}"
    for v, per_seed in values.items():
        for s in seeds:
            results[f"rl-{v}-seed{s}"] = study_job(per_seed[s])
    write_jsonl(learning.per_task_path(path), learning.per_task_rows(a, results))
    write_json(path, learning.summarise(a, results))
    return path
