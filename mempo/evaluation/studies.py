"""Learning-study results (`benchmarks/learning.py --out` files) read back for pooling and
comparing: a study's settings, its seeds, per seed its values and, where the per-task file
(`<study>.per_task.jsonl.gz`) is beside it, per task. Used by `benchmarks/learning_pool.py`
(studies on other seeds) and `benchmarks/learning_budget.py` (the same seeds at another RL budget).

    st = load_study(Path("benchmarks/results/learning_rl120.json"), "mempo_half", "grpo")
    st["seeds"], st["per_seed"]["grpo"]["k4"]["objective_em"][seed], st["per_task"]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mempo.errors import MempoError
from mempo.evaluation.stats import curve_slopes
from mempo.io import iter_jsonl

BENCHES = ("single", "k2", "k4")
METRICS = ("em", "objective_em", "forgetting_rate")
SAME = ("rl_steps", "batch_questions", "n_rollouts", "eval_tasks", "policy")  # what must match to pool
# The start a study's RL variants train from: its SFT checkpoints, evaluated before RL (results
# `sft`, `sft_full`) on the same greedy test tasks, so one start gives the same numbers in every study.
START_VARIANTS = ("sft", "sft_full")
START_METRICS = ("em", "objective_em", "mean_prompt_tokens")


def load_study(path: Path, a: str, b: str) -> dict[str, Any]:
    """The study's settings, the seeds both variants ran, and per seed and set its per-seed
    values (and per-task values, where its per-task file exists)."""
    try:
        study = json.loads(path.read_text())
        seeds = study["config"]["seeds"]
        results = study["results"]
        for v in (a, b):
            if v not in seeds or v not in results:
                raise MempoError(f"{path}: no variant '{v}' (it has: {', '.join(sorted(seeds))})")
        per_seed = {v: {bench: {m: dict(zip(seeds[v], results[v][bench][m]["per_seed"], strict=True))
                                for m in METRICS} for bench in BENCHES} for v in (a, b)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MempoError(f"{path}: not a learning study result ({type(e).__name__}: {e})") from e
    common = [s for s in seeds[a] if s in seeds[b]]
    side = path.with_suffix(".per_task.jsonl.gz")
    per_task: dict[tuple[str, int, str], dict[str, dict[str, Any]]] | None = None
    if side.exists():
        per_task = {}
        for n, row in iter_jsonl(side):  # malformed lines: DataError naming the file and line
            try:
                per_task.setdefault((row["variant"], int(row["seed"]), row["bench"]), {})[row["task"]] = row
            except (ValueError, KeyError, TypeError) as e:
                raise MempoError(f"{side}: row {n}: {type(e).__name__}: {e}") from e
        missing = [f"{v} seed {s} {bench}" for v in (a, b) for s in common for bench in BENCHES
                   if (v, s, bench) not in per_task]
        if missing:
            raise MempoError(f"{side}: no per-task rows for {', '.join(missing[:4])}")
    return {"path": path, "config": study["config"], "seeds": common, "per_seed": per_seed, "per_task": per_task,
            "slopes": {v: reward_slopes(study, v) for v in (a, b)}, "start": start_signature(study)}


def start_signature(study: dict[str, Any]) -> dict[str, Any]:
    """What identifies the SFT checkpoints a study's RL variants start from: the sha256 of their
    weights where the study recorded it (`config.start`, learning.py since 2026-12-04), and for
    every study the start policies' own greedy evaluation on its test tasks (per set: EM,
    objective EM, mean prompt tokens), which two studies of one start reproduce exactly."""
    sig: dict[str, Any] = {}
    for v in START_VARIANTS:
        res = (study.get("results") or {}).get(v) or {}
        for bench in BENCHES:
            for m in START_METRICS:
                mean = ((res.get(bench) or {}).get(m) or {}).get("mean")
                if mean is not None:
                    sig[f"{v} {bench} {m}"] = round(float(mean), 6)
    for fmt, digest in ((study.get("config") or {}).get("start") or {}).items():
        if digest:
            sig[f"weights sha256 of sft-{fmt}"] = digest
    return sig


def check_same_start(studies: list[dict[str, Any]]) -> None:
    """Refuse studies (`load_study`'s) whose RL starts differ: two SFT checkpoints trained from
    the same params can still differ (another commit's numerics, another machine), and a
    difference pooled over them would mix two experiments. Compared on what both recorded."""
    first = studies[0]
    for st in studies[1:]:
        for key, value in st["start"].items():
            other = first["start"].get(key)
            if other is not None and other != value:
                raise MempoError(f"{st['path']}: its RL start has {key} {value!r}, but {first['path']}'s has {other!r}: "
                                 "the studies start from different SFT checkpoints (or evaluate them differently); "
                                 "pool or compare only studies of one start")


def reward_slopes(study: dict[str, Any], v: str) -> dict[int, dict[str, float | None]] | None:
    """Per seed, the slopes of variant v's training reward (`curve_slopes`): the study's own
    `reward_trend`, or, for a study from before it that ran v on one seed, its curve (the mean
    over one seed is that seed's curve). None where neither is there."""
    trend = (study.get("reward_trend") or {}).get(v)
    if trend:
        return {int(s): d for s, d in trend["per_seed"].items()}
    seeds, curve = study["config"]["seeds"].get(v, []), (study.get("curves") or {}).get(v)
    if len(seeds) == 1 and curve:
        return {seeds[0]: curve_slopes([row.get("reward_mean") for row in curve])}
    return None
