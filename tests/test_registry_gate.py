"""The promotion gate as a pure function: hand-worked cases and properties over random metric tables."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from mempo.registry.gate import GateConfig, evaluate_gate

GATE = GateConfig(
    primary_metric="memory/world/em",
    min_gain=0.01,
    tolerance=0.02,
    guard_metrics=("memory/*/em", "memory/*/f1", "memory/*/peak_prompt_tokens"),
    lower_is_better=("*tokens*",),
    required_benchmarks=("world", "world-k4"),
    benchmark_metric="memory/{benchmark}/em",
    floors={"memory/world/em": 0.1},
    min_eval_n=16,
)
KEYS = [
    "memory/world/em", "memory/world-k4/em", "memory/world/f1", "memory/world-k4/f1",
    "memory/world/peak_prompt_tokens", "full_context/world/em",
]
# Both benchmarks evaluated on the same 200 / 50 questions.
N = {"memory/world/n": 200, "memory/world-k4/n": 50}
SETS = {"world": {"n": 200, "sha256": "aa11"}, "world-k4": {"n": 50, "sha256": "bb22"}}


def _gate(chall: dict, champ: dict | None, gate: GateConfig = GATE, chall_sets=SETS, champ_sets=SETS):
    return evaluate_gate({**N, **chall}, None if champ is None else {**N, **champ}, gate,
                         challenger_sets=chall_sets, champion_sets=champ_sets)


def test_better_challenger_passes_and_reports_delta() -> None:
    champ = {"memory/world/em": 0.30, "memory/world-k4/em": 0.2, "memory/world/f1": 0.4}
    chall = {"memory/world/em": 0.35, "memory/world-k4/em": 0.19, "memory/world/f1": 0.41}
    r = _gate(chall, champ)
    assert r.passed, r.failures()
    assert math.isclose(r.primary_delta or 0, 0.05)
    assert {c.name for c in r.checks} >= {"eval-size:memory/world", "same-eval-set:world", "same-eval-set:world-k4"}


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
        r = _gate(chall, champ)
        assert not r.passed
        assert [c.name for c in r.checks if not c.passed] == names


def test_first_model_needs_only_required_floors_and_enough_questions() -> None:
    assert _gate({"memory/world/em": 0.2, "memory/world-k4/em": 0.0}, None).passed
    below = _gate({"memory/world/em": 0.05, "memory/world-k4/em": 0.0}, None)
    assert not below.passed and below.failures() == ["floor:memory/world/em: 0.05 vs floor 0.1"]
    assert not _gate({"memory/world/em": float("nan"), "memory/world-k4/em": 0.3}, None).passed


# ---- issue 18.4: the gate compared evaluations that were not comparable


def test_one_lucky_answer_does_not_beat_a_champion_evaluated_on_200_questions() -> None:
    # The DAG with eval_limit=1: one question, answered right, EM 1.0.
    lucky = {"memory/world/em": 1.0, "memory/world/n": 1, "memory/world-k4/em": 1.0, "memory/world-k4/n": 1}
    lucky_sets = {"world": {"n": 1, "sha256": "cc33"}, "world-k4": {"n": 1, "sha256": "dd44"}}
    champ = {"memory/world/em": 0.375, "memory/world-k4/em": 0.2}
    r = evaluate_gate(lucky, {**N, **champ}, GATE, challenger_sets=lucky_sets, champion_sets=SETS)
    assert not r.passed
    failed = {c.name for c in r.checks if not c.passed}
    assert {"eval-size:memory/world", "same-eval-set:world", "same-eval-set:world-k4"} <= failed
    # Even with no minimum, different questions are not compared ...
    r = evaluate_gate(lucky, {**N, **champ}, GateConfig(required_benchmarks=("world",)),
                      challenger_sets=lucky_sets, champion_sets=SETS)
    assert [c.name for c in r.checks if not c.passed] == ["same-eval-set:world", "same-eval-set:world-k4"]
    # ... and with no champion, one question is not enough evidence either.
    r = evaluate_gate(lucky, None, GATE, challenger_sets=lucky_sets)
    assert [c.name for c in r.checks if not c.passed] == ["eval-size:memory/world", "eval-size:memory/world-k4"]


def test_unknown_eval_sets_or_counts_fail_closed() -> None:
    chall = {"memory/world/em": 0.5, "memory/world-k4/em": 0.3}
    champ = {"memory/world/em": 0.3, "memory/world-k4/em": 0.2}
    r = _gate(chall, champ, chall_sets=None)
    assert "same-eval-set:world: eval set unknown for the challenger" in r.failures()
    r = _gate(chall, champ, champ_sets={"world-k4": SETS["world-k4"]})
    assert r.failures() == ["same-eval-set:world: eval set unknown for the champion"]
    r = evaluate_gate(chall, None, GATE)  # no `n` in the table
    assert r.failures() == ["eval-size:memory/world: question count missing",
                            "eval-size:memory/world-k4: question count missing"]
    # Switched off, the eval set is not compared (a deliberate choice in params).
    r = _gate(chall, champ, replace(GATE, same_eval_set=False), chall_sets=None)
    assert r.passed, r.failures()


def test_infinities_never_pass() -> None:
    inf = float("inf")
    r = _gate({"memory/world/em": inf, "memory/world-k4/em": 0.3}, None)
    assert r.failures()[0] == "required:memory/world/em: missing"
    # +inf on the primary metric does not beat any champion.
    champ = {"memory/world/em": 0.3, "memory/world-k4/em": 0.2}
    assert not _gate({"memory/world/em": inf, "memory/world-k4/em": 0.2}, champ).passed
    # -inf prompt tokens (lower is better) is no improvement, nor does it pass a maximum.
    champ_tok = {**champ, "memory/world/peak_prompt_tokens": 500}
    r = _gate({"memory/world/em": 0.35, "memory/world-k4/em": 0.2, "memory/world/peak_prompt_tokens": -inf}, champ_tok)
    assert r.failures() == ["no-regression:memory/world/peak_prompt_tokens: missing (champion 500)"]
    capped = replace(GATE, floors={"memory/world/peak_prompt_tokens": 1000})
    r = _gate({"memory/world/em": 0.35, "memory/world-k4/em": 0.2, "memory/world/peak_prompt_tokens": -inf}, None,
              capped)
    assert r.failures() == ["floor:memory/world/peak_prompt_tokens: missing (floor 1000)"]
    # An infinite question count is no count.
    r = evaluate_gate({**N, "memory/world/n": inf, "memory/world/em": 0.5, "memory/world-k4/em": 0.3}, None, GATE)
    assert r.failures() == ["eval-size:memory/world: question count missing"]


def test_a_champion_without_the_primary_metric_is_not_beaten_by_default() -> None:
    champ = {"memory/world-k4/em": 0.2, "memory/world/f1": 0.4}  # its primary metric was never recorded
    r = _gate({"memory/world/em": 0.35, "memory/world-k4/em": 0.2, "memory/world/f1": 0.4}, champ)
    assert not r.passed
    assert r.failures() == ["gain:memory/world/em: champion has no value: the two cannot be compared"]
    assert r.primary_delta is None


# ---- properties

values = st.one_of(st.floats(0, 1, allow_nan=False), st.just(float("nan")), st.just(float("inf")),
                   st.just(float("-inf")))
tables = st.dictionaries(st.sampled_from(KEYS), values, max_size=len(KEYS))
counts = st.fixed_dictionaries({}, optional={"memory/world/n": st.sampled_from([1, 15, 16, 200]),
                                             "memory/world-k4/n": st.sampled_from([1, 16, 50])})
sets = st.one_of(st.none(), st.sampled_from([SETS, {"world": {"n": 1, "sha256": "cc33"}, "world-k4": SETS["world-k4"]}]))


def _num(t: dict[str, float], k: str) -> float | None:
    v = t.get(k)
    return None if v is None or not math.isfinite(v) else v


@settings(max_examples=400, deadline=None)
@given(challenger=tables, champion=st.one_of(st.none(), tables), n=counts, chall_sets=sets, champ_sets=sets)
def test_gate_never_promotes_a_worse_incomplete_small_or_incomparable_challenger(
    challenger, champion, n, chall_sets, champ_sets
) -> None:
    challenger = {**challenger, **n}
    r = evaluate_gate(challenger, champion, GATE, challenger_sets=chall_sets, champion_sets=champ_sets)
    assert r.passed == all(c.passed for c in r.checks)
    assert r.checks, "the evidence is never empty"
    if not r.passed:
        assert r.failures()
        return
    # Promoted => complete, on enough questions ...
    for key in GATE.required_metrics():
        assert _num(challenger, key) is not None
    assert challenger["memory/world/n"] >= 16 and challenger["memory/world-k4/n"] >= 16
    # ... above every floor ...
    assert _num(challenger, "memory/world/em") >= 0.1
    if champion is None:
        return
    # ... on the same questions as the champion ...
    assert chall_sets is not None and chall_sets == champ_sets
    # ... gains enough on the primary metric (which the champion has) ...
    new, old = _num(challenger, GATE.primary_metric), _num(champion, GATE.primary_metric)
    assert old is not None and new - old >= GATE.min_gain - 1e-12
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
    table = {**table, "memory/world/n": 16}
    run = lambda a, b: evaluate_gate(a, b, gate, challenger_sets=SETS, champion_sets=SETS)  # noqa: E731
    assert run(table, table) == run(dict(table), dict(table))
    assert run(table, table).passed == (_num(table, "memory/world/em") is not None)
