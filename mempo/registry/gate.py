"""The promotion gate: a pure decision whether a challenger's metrics may replace the champion's.

    from mempo.registry.gate import GateConfig, evaluate_gate
    evaluate_gate({"memory/world/em": 0.4, "memory/world/n": 200}, None, GateConfig())

`evaluate_gate` checks, in order:

1. every required metric is present and finite (the primary metric and one per required
   benchmark), on at least `min_eval_n` questions;
2. every absolute floor holds;
3. against a champion: both were evaluated on the same questions (`same_eval_set`), the
   champion has the primary metric, the challenger gains at least `min_gain` on it, and
   no guarded metric the champion has regresses by more than `tolerance` (or is missing).

No I/O here: `mempo.registry.promote` reads the tables from the registry and records the result.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mempo.config.stages import PromoteParams

_PROMOTE = PromoteParams()  # the defaults of the `promote:` section


@dataclass(frozen=True)
class GateConfig:
    """What a challenger must show to replace the champion: the gate keys of the `promote:`
    section, whose defaults (`PromoteParams`) these are; `from_params` builds one from it.

    Attributes:
        primary_metric: the metric that decides (e.g. `memory/world/em`).
        min_gain: challenger - champion on the primary metric must be >= this (in the
            metric's units; direction-aware for lower-is-better metrics).
        tolerance: allowed regression on each guarded metric (absolute, metric units).
        guard_metrics: glob patterns of metrics that must not regress beyond `tolerance`.
        lower_is_better: glob patterns of metrics where smaller is better (tokens, latency).
        required_benchmarks: benchmark names that must have a value ...
        benchmark_metric: ... under this key template (`{benchmark}` is replaced).
        floors: absolute minimums per metric (maximums for lower-is-better metrics).
        min_eval_n: each required metric must rest on at least this many questions (its
            `<agent>/<benchmark>/n`): one lucky answer is not evidence.
        same_eval_set: against a champion, every benchmark compared must have been evaluated
            on the same questions (equal eval-set sha256) by both versions.
    """

    primary_metric: str = _PROMOTE.primary_metric
    min_gain: float = _PROMOTE.min_gain
    tolerance: float = _PROMOTE.tolerance
    guard_metrics: tuple[str, ...] = tuple(_PROMOTE.guard_metrics)
    lower_is_better: tuple[str, ...] = tuple(_PROMOTE.lower_is_better)
    required_benchmarks: tuple[str, ...] = tuple(_PROMOTE.required_benchmarks)
    benchmark_metric: str = _PROMOTE.benchmark_metric
    floors: Mapping[str, float] = field(default_factory=lambda: dict(_PROMOTE.floors))
    min_eval_n: int = _PROMOTE.min_eval_n
    same_eval_set: bool = _PROMOTE.same_eval_set

    @classmethod
    def from_params(cls, p: PromoteParams | Mapping[str, Any]) -> GateConfig:
        """The gate the `promote:` section asks for (a `PromoteParams` or a mapping of its keys;
        keys that are not gate settings, such as `out`, are left out)."""
        d = p.model_dump() if isinstance(p, PromoteParams) else dict(p)
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for k in ("guard_metrics", "lower_is_better", "required_benchmarks"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)

    def is_lower_better(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, p) for p in self.lower_is_better)

    def required_metrics(self) -> list[str]:
        keys = [self.primary_metric]
        keys += [self.benchmark_metric.format(benchmark=b) for b in self.required_benchmarks]
        return list(dict.fromkeys(keys))

    def to_json(self) -> str:
        d = asdict(self)
        d["floors"] = dict(self.floors)
        return json.dumps(d, sort_keys=True)


@dataclass(frozen=True)
class GateCheck:
    """One check of the gate: its name, whether it passed, and the numbers behind it."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class GateResult:
    """The outcome of `evaluate_gate`: passed only if every check passed."""

    passed: bool
    checks: tuple[GateCheck, ...]
    primary_delta: float | None

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]


def _value(table: Mapping[str, float] | None, key: str) -> float | None:
    """The finite number under `key`, else None (missing, not a number, NaN or +-inf)."""
    if table is None or key not in table:
        return None
    try:
        v = float(table[key])
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def split_metric_key(key: str) -> tuple[str, str] | None:
    """(agent, benchmark) of an `agent/benchmark/metric` key, else None."""
    parts = key.split("/")
    return (parts[0], parts[1]) if len(parts) == 3 else None


def evaluate_gate(
    challenger: Mapping[str, float],
    champion: Mapping[str, float] | None,
    gate: GateConfig,
    *,
    challenger_sets: Mapping[str, Mapping[str, Any]] | None = None,
    champion_sets: Mapping[str, Mapping[str, Any]] | None = None,
) -> GateResult:
    """Decide whether `challenger` may replace `champion` (None: there is no champion yet).

    Both are flat metric tables (`{"memory/world/em": 0.41, "memory/world/n": 200, ...}`);
    NaN and +-inf count as missing. `*_sets` are the eval sets behind each table,
    `{benchmark: {"n": questions, "sha256": ...}}` (see `eval_set_fingerprints`); None when
    unknown, which fails the same-eval-set check against a champion.
    Pure: the same inputs always give the same result.
    """
    checks: list[GateCheck] = []

    def better_or_equal(key: str, new: float, old: float, slack: float) -> bool:
        # new is no worse than old by more than `slack` (slack < 0 demands a gain).
        return new <= old + slack if gate.is_lower_better(key) else new >= old - slack

    required = gate.required_metrics()
    for key in required:
        v = _value(challenger, key)
        checks.append(GateCheck(f"required:{key}", v is not None, "missing" if v is None else f"{v:.6g}"))

    for agent, bench in dict.fromkeys(p for p in map(split_metric_key, required) if p):
        n = _value(challenger, f"{agent}/{bench}/n")
        checks.append(GateCheck(
            f"eval-size:{agent}/{bench}", n is not None and n >= gate.min_eval_n,
            "question count missing" if n is None else f"n={n:.0f} (min {gate.min_eval_n})",
        ))

    for key, floor in sorted(gate.floors.items()):
        v = _value(challenger, key)
        if v is None:
            checks.append(GateCheck(f"floor:{key}", False, f"missing (floor {floor:.6g})"))
            continue
        ok = v <= floor if gate.is_lower_better(key) else v >= floor
        checks.append(GateCheck(f"floor:{key}", ok, f"{v:.6g} vs floor {floor:.6g}"))

    delta: float | None = None
    if champion is not None:
        compared = [gate.primary_metric]
        new, old = _value(challenger, gate.primary_metric), _value(champion, gate.primary_metric)
        if new is None:
            checks.append(GateCheck("gain:" + gate.primary_metric, False, "challenger has no value"))
        elif old is None:
            # Nothing to beat is not a win: the champion's evidence is broken, so a person decides
            # (re-register the champion with its evaluation, or move @champion by hand).
            checks.append(GateCheck("gain:" + gate.primary_metric, False,
                                    "champion has no value: the two cannot be compared"))
        else:
            delta = new - old
            ok = better_or_equal(gate.primary_metric, new, old, -gate.min_gain)
            checks.append(GateCheck(
                "gain:" + gate.primary_metric, ok,
                f"{new:.6g} vs champion {old:.6g} (delta {delta:+.6g}, min gain {gate.min_gain:.6g})",
            ))
        guarded = sorted(
            k for k in champion
            if k != gate.primary_metric and any(fnmatch.fnmatchcase(k, p) for p in gate.guard_metrics)
        )
        for key in guarded:
            old = _value(champion, key)
            if old is None:
                continue
            compared.append(key)
            new = _value(challenger, key)
            if new is None:
                checks.append(GateCheck(f"no-regression:{key}", False, f"missing (champion {old:.6g})"))
                continue
            ok = better_or_equal(key, new, old, gate.tolerance)
            checks.append(GateCheck(
                f"no-regression:{key}", ok,
                f"{new:.6g} vs champion {old:.6g} (tolerance {gate.tolerance:.6g})",
            ))
        if gate.same_eval_set:
            for bench in dict.fromkeys(p[1] for p in map(split_metric_key, compared) if p):
                mine, theirs = (challenger_sets or {}).get(bench), (champion_sets or {}).get(bench)
                if not mine or not theirs:
                    checks.append(GateCheck(f"same-eval-set:{bench}", False,
                                            f"eval set unknown for the {'challenger' if not mine else 'champion'}"))
                    continue
                same = mine.get("sha256") == theirs.get("sha256") and mine.get("n") == theirs.get("n")
                checks.append(GateCheck(
                    f"same-eval-set:{bench}", same,
                    f"n={mine.get('n')} sha256 {str(mine.get('sha256'))[:12]} vs champion "
                    f"n={theirs.get('n')} sha256 {str(theirs.get('sha256'))[:12]}",
                ))
    else:
        checks.append(GateCheck("champion", True, "no champion yet: floors and required metrics decide"))

    return GateResult(all(c.passed for c in checks), tuple(checks), delta)

def gate_evidence(metrics: Mapping[str, float], gate: GateConfig) -> dict[str, float]:
    """The part of `metrics` the gate reads: required, floor and guarded metrics, and the
    question count (`<agent>/<benchmark>/n`) behind each. These become `metric.*` tags."""
    keys = {*gate.required_metrics(), *gate.floors}
    keys |= {k for k in metrics if any(fnmatch.fnmatchcase(k, p) for p in gate.guard_metrics)}
    keys |= {f"{a}/{b}/n" for a, b in filter(None, map(split_metric_key, list(keys)))}
    return {k: metrics[k] for k in sorted(keys) if k in metrics}

def gate_from_params(p: PromoteParams | Mapping[str, Any]) -> GateConfig:
    """`GateConfig.from_params` (the name the KFP components and the CLI call)."""
    return GateConfig.from_params(p)
