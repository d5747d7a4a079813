"""The promotion gate as a pure function: hand-worked cases and properties over random metric tables."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from mempo.registry import GateConfig, evaluate_gate

GATE = GateConfig(
    primary_metric="memory/world/em",
    min_gain=0.01,
    tolerance=0.02,
    guard_metrics=("memory/*/em", "memory/*/f1", "memory/*/peak_prompt_tokens"),
    lower_is_better=("*tokens*",),
    required_benchmarks=("world", "world-k4"),
    benchmark_metric="memory/{benchmark}/em",
    floors={"memory/world/em": 0.1},
)
KEYS = [
    "memory/world/em", "memory/world-k4/em", "memory/world/f1", "memory/world-k4/f1",
    "memory/world/peak_prompt_tokens", "full_context/world/em",
]


def test_better_challenger_passes_and_reports_delta() -> None:
    champ = {"memory/world/em": 0.30, "memory/world-k4/em": 0.2, "memory/world/f1": 0.4}
    chall = {"memory/world/em": 0.35, "memory/world-k4/em": 0.19, "memory/world/f1": 0.41}
    r = evaluate_gate(chall, champ, GATE)
    assert r.passed, r.failures()
    assert math.isclose(r.primary_delta or 0, 0.05)


def test_each_failure_mode_is_named() -> None:
    champ = {"memory/world/em": 0.30, "memory/world-k4/em": 0.2, "memory/world/f1": 0.4,
             "memory/world/peak_prompt_tokens": 500}
    base = {"memory/world/em": 0.35, "memory/world-k4/em": 0.2, "memory/world/f1": 0.4,
            "memory/world/peak_prompt_tokens": 500}
    cases = [
        (["gain:memory/world/em"], {**base, "memory/world/em": 0.305}),
        (["no-regression:memory/world/f1"], {**base, "memory/world/f1": 0.37}),
        (["no-regression:memory/world/peak_prompt_tokens"], {**base, "memory/world/peak_prompt_tokens": 600}),
        # A missing benchmark is both incomplete and a regression against the champion.
        (["required:memory/world-k4/em", "no-regression:memory/world-k4/em"],
         {k: v for k, v in base.items() if k != "memory/world-k4/em"}),
    ]
    for names, chall in cases:
        r = evaluate_gate(chall, champ, GATE)
        assert not r.passed
        assert [c.name for c in r.checks if not c.passed] == names


def test_first_model_needs_only_required_and_floors() -> None:
    assert evaluate_gate({"memory/world/em": 0.2, "memory/world-k4/em": 0.0}, None, GATE).passed
    below = evaluate_gate({"memory/world/em": 0.05, "memory/world-k4/em": 0.0}, None, GATE)
    assert not below.passed and below.failures()[0].startswith("floor:memory/world/em")
    assert not evaluate_gate({"memory/world/em": float("nan"), "memory/world-k4/em": 0.3}, None, GATE).passed


values = st.one_of(st.floats(0, 1, allow_nan=False), st.just(float("nan")))
tables = st.dictionaries(st.sampled_from(KEYS), values, max_size=len(KEYS))


def _num(t: dict[str, float], k: str) -> float | None:
    v = t.get(k)
    return None if v is None or math.isnan(v) else v


@settings(max_examples=400, deadline=None)
@given(challenger=tables, champion=st.one_of(st.none(), tables))
def test_gate_never_promotes_a_worse_incomplete_or_below_floor_challenger(challenger, champion) -> None:
    r = evaluate_gate(challenger, champion, GATE)
    assert r.passed == all(c.passed for c in r.checks)
    assert r.checks, "the evidence is never empty"
    if not r.passed:
        assert r.failures()
        return
    # Promoted => complete ...
    for key in GATE.required_metrics():
        assert _num(challenger, key) is not None
    # ... above every floor ...
    assert _num(challenger, "memory/world/em") >= 0.1
    if champion is None:
        return
    # ... gains enough on the primary metric ...
    new, old = _num(challenger, GATE.primary_metric), _num(champion, GATE.primary_metric)
    if old is not None:
        assert new - old >= GATE.min_gain - 1e-12
    # ... and regresses on no guarded metric beyond the tolerance.
    for key in ("memory/world-k4/em", "memory/world/f1", "memory/world-k4/f1"):
        if _num(champion, key) is not None:
            assert _num(challenger, key) is not None
            assert _num(challenger, key) >= _num(champion, key) - GATE.tolerance
    if _num(champion, "memory/world/peak_prompt_tokens") is not None:
        assert _num(challenger, "memory/world/peak_prompt_tokens") <= (
            _num(champion, "memory/world/peak_prompt_tokens") + GATE.tolerance
        )


@settings(max_examples=200, deadline=None)
@given(table=tables)
def test_gate_is_deterministic_and_a_copy_of_the_champion_passes_at_zero_gain(table) -> None:
    gate = GateConfig(primary_metric="memory/world/em", min_gain=0.0, tolerance=0.0,
                      required_benchmarks=(), guard_metrics=GATE.guard_metrics,
                      lower_is_better=GATE.lower_is_better)
    assert evaluate_gate(table, table, gate) == evaluate_gate(dict(table), dict(table), gate)
    r = evaluate_gate(table, table, gate)
    assert r.passed == (_num(table, "memory/world/em") is not None)
