"""The headline numbers of one run: about ten, for `dvc metrics show` / `dvc metrics diff` and
the registry version's tags. The full tables stay in `outputs/eval/metrics.json` and
`outputs/train/metrics.json`.

    from mempo.headline import headline_metrics
    headline_metrics(read_metrics_file("outputs/eval/metrics.json"), train_metrics)
    # {"em.world": 0.375, "em.k2": 0.125, ..., "em.gain": 0.18,
    #  "tok.memory": 412.0, "tok.full": 2310.5, "reward": 0.31, "kl": 0.012}

The register stage writes them to `outputs/register/headline.json` (the only file DVC
declares as `metrics`), so `dvc metrics show` prints one row of about ten columns and `dvc exp show`
one column per number. Keys are short so that row fits a terminal: the default run's nine
numbers print in about 120 columns (they took 164 as `em.world-k2`, `tokens.full_context`, ...).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from mempo.evaluation.metrics import round_metric, split_key

_K = re.compile(r"-k(\d+)$")
_SHORT_AGENT = {"full_context": "full", "external_memory": "ext"}


def _short_bench(benchmark: str) -> str:
    """`world-k2` -> `k2` (the world's composed tasks); other names as they are."""
    return benchmark.removeprefix("world-") if _K.search(benchmark) and benchmark.startswith("world-") else benchmark


def _k_of(benchmark: str) -> int:
    """Objectives per task of a benchmark name (`world-k8` -> 8; anything else 1)."""
    m = _K.search(benchmark)
    return int(m.group(1)) if m else 1


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def headline_metrics(
    eval_metrics: Mapping[str, Any],
    train_metrics: Mapping[str, Any] | None = None,
    *,
    agent: str = "memory",
    compare_agent: str = "full_context",
) -> dict[str, float]:
    """The headline table (flat `{key: number}`; a number with no source is left out, never NaN).

    Args:
        eval_metrics: the eval stage's flat table (`{"memory/world/em": 0.41, ...}`).
        train_metrics: the train stage's metrics.json (`final_reward_mean`, `final_kl`), or None.
        agent: the agent being trained (MemPO's memory agent).
        compare_agent: the agent whose peak prompt length is shown beside `agent`'s.

    Keys:
        `em.<benchmark>`: `agent`'s exact match on each benchmark it ran (`em.k2` for `world-k2`).
        `em.gain`: `agent`'s mean EM over those benchmarks minus the best other agent's mean
            EM over the same benchmarks (the strongest baseline; > 0: MemPO wins).
        `tok.<agent>`, `tok.<compare_agent>`: mean peak prompt tokens per episode on the
            benchmark with the most objectives per task (the largest k); `full_context` is
            `tok.full`, `external_memory` `tok.ext`.
        `reward`, `kl`: the train stage's mean outcome reward and KL to the start policy over the
            last quarter of the training steps.
    """
    table: dict[str, dict[str, dict[str, float]]] = {}
    for key, value in eval_metrics.items():
        try:
            a, bench, metric = split_key(key)
        except ValueError:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        table.setdefault(a, {}).setdefault(bench, {})[metric] = float(value)

    out: dict[str, float] = {}
    mine = table.get(agent, {})
    benches = sorted((b for b in mine if "em" in mine[b]), key=lambda b: (_K.sub("", b), _k_of(b)))
    for bench in benches:
        out[f"em.{_short_bench(bench)}"] = mine[bench]["em"]
    own = _mean([mine[b]["em"] for b in benches])
    # Baselines count only where they ran every benchmark the agent ran (same questions).
    baselines = [
        _mean([per[b]["em"] for b in benches]) for a, per in table.items()
        if a != agent and all("em" in per.get(b, {}) for b in benches)
    ]
    if own is not None and baselines:
        out["em.gain"] = own - max(baselines)
    with_tokens = [b for b in mine if "peak_prompt_tokens" in mine[b]]
    if with_tokens:
        largest = max(with_tokens, key=lambda b: (_k_of(b), b))
        for a in dict.fromkeys((agent, compare_agent)):
            v = table.get(a, {}).get(largest, {}).get("peak_prompt_tokens")
            if v is not None:
                out[f"tok.{_SHORT_AGENT.get(a, a)}"] = v
    for key, src in (("reward", "final_reward_mean"), ("kl", "final_kl")):
        v = (train_metrics or {}).get(src)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
    return {k: round_metric(v) for k, v in out.items()}
