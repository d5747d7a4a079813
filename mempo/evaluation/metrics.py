"""Evaluation metrics: per sample and aggregated, as the flat `metrics.json` DVC reads.

    rows = [sample_row(...), ...]                     # one dict per (agent, benchmark, question)
    flat = aggregate(rows)                            # {"memory/world/em": 0.41, ...}

Every answer-quality number comes from `mempo.rewards` (the project's one normaliser and
its EM / F1 / substring-EM / multi-objective scorers); this module only records and averages.

Per-sample columns (`samples.parquet`): see `SAMPLE_COLUMNS`. The aggregate of a
per-sample metric over one (agent, benchmark) is its mean over the samples (rates for the
0/1 columns), except `peak_prompt_tokens_max` (the largest peak) and `n` (the count).
Metrics undefined for a pair are left out rather than written as NaN: `memory_probe` exists
only for agents that write a memory, `objective_em` / `all_correct` only for k > 1 tasks, the
forgetting rates only for k > 1 tasks of the agents whose context is their own memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Per-sample numeric columns averaged into metrics.json, in report order.
MEAN_METRICS = (
    "em",
    "f1",
    "substring_em",
    "format_valid",
    "objective_em",
    "all_correct",
    "turns",
    "searches",
    "peak_prompt_tokens",
    "total_prompt_tokens",
    "generated_tokens",
    "repeated_turns",        # turns whose prompt the episode already had (greedy eval samples them:
                             # eval.rollout.repeat_temperature)
    "latency_s",
    "truncated",
    "memory_probe",
    "forgetting_rate",       # 0/1 per episode: a stored answer was dropped (mempo.forgetting)
    "forgetting_rate_seen",  # 0/1: an answer seen in an observation or memory was not kept
)
# Metrics only meaningful for multi-objective (k > 1) tasks.
MULTI_OBJECTIVE_METRICS = ("objective_em", "all_correct", "forgetting_rate", "forgetting_rate_seen")
DECIMALS = 4

SAMPLE_COLUMNS = (
    "agent",              # memory | full_context | direct | rag | external_memory
    "policy",             # the model the agent ran (eval.model, or its own from eval.models)
    "benchmark",          # registry name
    "id",                 # question / task id
    "question",
    "golden_answers",     # list[str]
    "prediction",         # the final <answer> text, "" when none
    "k",                  # objectives in the task
    *MEAN_METRICS,        # latency_s: an episode's first turn request to its end (episodes run
                          # concurrently, their turns batched); single-turn agents: their batch's call
    "hit_turn_limit",     # 0/1: stopped by max_turns without an answer
    "prompt_tokens_by_turn",  # list[int], prompt length of each turn (tokens)
    "final_memory",       # the last <mem> text ("" for agents without one)
    "transcript",         # JSON: per-turn memory / think / search / titles / answer
    "error",              # "" or why the episode failed (scored as wrong)
)


def round_metric(value: float | int) -> float | int:
    """The value as written to metrics.json: ints stay ints, floats get `DECIMALS` places."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    return round(float(value), DECIMALS)


def _mean(values: Iterable[float]) -> float | None:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def aggregate_pair(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | int]:
    """Aggregate the rows of one (agent, benchmark): metric name -> value (see module doc)."""
    if not rows:
        return {}
    out: dict[str, float | int] = {"n": len(rows)}
    multi = max(int(r.get("k", 1)) for r in rows) > 1
    for name in MEAN_METRICS:
        if name in MULTI_OBJECTIVE_METRICS and not multi:
            continue
        m = _mean(r.get(name) for r in rows)
        if m is not None:
            out[name] = round_metric(m)
    peaks = [int(r["peak_prompt_tokens"]) for r in rows if r.get("peak_prompt_tokens") is not None]
    if peaks:
        out["peak_prompt_tokens_max"] = max(peaks)
    return out


def aggregate(rows: Iterable[Mapping[str, Any]]) -> dict[str, float | int]:
    """Flat metrics over all rows: `"{agent}/{benchmark}/{metric}" -> value`, keys sorted."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["agent"]), str(r["benchmark"])), []).append(r)
    flat: dict[str, float | int] = {}
    for (agent, bench), group in groups.items():
        for metric, value in aggregate_pair(group).items():
            flat[metric_key(agent, bench, metric)] = value
    return dict(sorted(flat.items()))


def metric_key(agent: str, benchmark: str, metric: str) -> str:
    """The metrics.json key, e.g. `memory/world-k8/em`."""
    return f"{agent}/{benchmark}/{metric}"


def split_key(key: str) -> tuple[str, str, str]:
    """Inverse of `metric_key` (benchmark names never contain '/')."""
    agent, bench, metric = key.split("/", 2)
    return agent, bench, metric


def nested(flat: Mapping[str, float | int]) -> dict[str, dict[str, dict[str, float | int]]]:
    """`{agent: {benchmark: {metric: value}}}` from the flat form."""
    out: dict[str, dict[str, dict[str, float | int]]] = {}
    for key, value in flat.items():
        agent, bench, metric = split_key(key)
        out.setdefault(agent, {}).setdefault(bench, {})[metric] = value
    return out


def prompt_tokens_by_turn(rows: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """Mean prompt length (tokens) at each turn index (0-based) over the episodes that reached it."""
    sums: dict[int, list[float]] = {}
    for r in rows:
        for t, n in enumerate(r.get("prompt_tokens_by_turn") or []):
            sums.setdefault(t, []).append(float(n))
    return {t: sum(v) / len(v) for t, v in sorted(sums.items())}


def answer_scores(
    prediction: str | None, golden_answers: Sequence[str], objectives: Sequence[Sequence[str]] | None = None
) -> dict[str, float]:
    """EM, F1, substring EM (and, for k > 1 tasks, per-objective EM and all-correct) of one answer.

    All from `mempo.rewards`. `objectives` are the task's per-objective answer lists
    (`Task.answer_lists`; default: one objective, `golden_answers`, so a plain gold answer
    that happens to contain ";" stays one objective). For a k-objective task, `em` is the
    task's correctness under the "all objectives right" rule (= `all_correct`),
    `objective_em` the mean of the per-objective EMs, and `f1` / `substring_em` compare the
    whole `a1; a2; ...` string with the joined gold string. A missing answer (None) scores 0.

    Example: prediction "Paris; 1901" for objectives [["Paris"], ["1900"]] ->
    em 0.0, objective_em 0.5, all_correct 0.0, f1 0.5 (1 of 2 tokens), substring_em 0.0.
    """
    from mempo.rewards import answer_correctness, multi_objective_scores, substring_match, token_f1

    objectives = [list(o) for o in objectives] if objectives else [list(golden_answers)]
    out = {
        "em": answer_correctness(prediction, golden_answers, objectives, multi_rule="all"),
        "f1": token_f1(prediction, golden_answers),
        "substring_em": substring_match(prediction, golden_answers),
    }
    if len(objectives) > 1:
        mo = multi_objective_scores(prediction, objectives)
        out["objective_em"] = mo.mean
        out["all_correct"] = mo.all_correct
    else:
        out["objective_em"] = float("nan")
        out["all_correct"] = float("nan")
    return out
