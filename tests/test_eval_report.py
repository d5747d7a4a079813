"""Metric aggregation by hand, and the report printing exactly the metrics.json numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mempo.evaluation.metrics import aggregate, nested, prompt_tokens_by_turn
from mempo.evaluation.report import (
    decimals,
    format_value,
    parse_report_tables,
    write_plots,
    write_report,
)


def _row(agent: str, bench: str, k: int = 1, **kw: object) -> dict[str, object]:
    base: dict[str, object] = dict(
        agent=agent, benchmark=bench, id="x", k=k, em=0.0, f1=0.0, substring_em=0.0,
        format_valid=1.0, objective_em=float("nan"), all_correct=float("nan"), turns=2, searches=1,
        peak_prompt_tokens=100, total_prompt_tokens=150, generated_tokens=40, latency_s=0.5,
        truncated=0.0, memory_probe=float("nan"), prompt_tokens_by_turn=[50, 100],
    )
    base.update(kw)
    return base


def test_aggregate_by_hand() -> None:
    rows = [
        _row("memory", "world", em=1.0, f1=1.0, substring_em=1.0, memory_probe=0.5, peak_prompt_tokens=90),
        _row("memory", "world", em=0.0, f1=0.5, substring_em=1.0, memory_probe=0.25, peak_prompt_tokens=120,
             truncated=1.0, format_valid=0.0, turns=3),
        _row("memory", "world", em=0.0, f1=1 / 3, memory_probe=0.0, peak_prompt_tokens=60),
        _row("direct", "world", em=1.0, f1=1.0, turns=1, searches=0),
    ]
    flat = aggregate(rows)
    assert flat["memory/world/n"] == 3
    assert flat["memory/world/em"] == round(1 / 3, 4)
    assert flat["memory/world/f1"] == round((1 + 0.5 + 1 / 3) / 3, 4)   # 0.6111
    assert flat["memory/world/substring_em"] == round(2 / 3, 4)
    assert flat["memory/world/format_valid"] == round(2 / 3, 4)
    assert flat["memory/world/truncated"] == round(1 / 3, 4)
    assert flat["memory/world/turns"] == round(7 / 3, 4)
    assert flat["memory/world/peak_prompt_tokens"] == 90.0               # (90 + 120 + 60) / 3
    assert flat["memory/world/peak_prompt_tokens_max"] == 120
    assert flat["memory/world/memory_probe"] == 0.25
    # No memory -> no probe key (never NaN in metrics.json); k = 1 -> no multi-objective keys.
    assert "direct/world/memory_probe" not in flat
    assert not any(k.endswith(("objective_em", "all_correct")) for k in flat)
    assert flat["direct/world/em"] == 1.0
    assert list(flat) == sorted(flat)
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in flat.values())


def test_multi_objective_keys_only_for_k_above_one() -> None:
    rows = [
        _row("memory", "world-k4", k=4, em=0.0, objective_em=0.75, all_correct=0.0),
        _row("memory", "world-k4", k=4, em=1.0, objective_em=1.0, all_correct=1.0),
    ]
    flat = aggregate(rows)
    assert flat["memory/world-k4/objective_em"] == 0.875
    assert flat["memory/world-k4/all_correct"] == 0.5


def test_prompt_tokens_by_turn_averages_over_episodes_reaching_each_turn() -> None:
    rows = [{"prompt_tokens_by_turn": [10, 20, 30]}, {"prompt_tokens_by_turn": [20, 40]}]
    assert prompt_tokens_by_turn(rows) == {0: 15.0, 1: 30.0, 2: 30.0}


def _sample_rows() -> list[dict[str, object]]:
    rows = []
    for bench, k in (("world", 1), ("world-k1", 1), ("world-k2", 2), ("world-k4", 4)):
        for agent in ("memory", "full_context", "external_memory", "rag", "direct"):
            for i in range(3):
                turns = [100 + 10 * t for t in range(k + 1)] if agent == "memory" else [100 + 80 * t for t in range(k + 1)]
                rows.append(_row(agent, bench, k=k, em=float(i == 0), f1=0.123456 * (i + 1),
                                 objective_em=0.5 if k > 1 else float("nan"),
                                 all_correct=float(i == 0) if k > 1 else float("nan"),
                                 memory_probe=0.1 * i if agent == "memory" else float("nan"),
                                 peak_prompt_tokens=max(turns), prompt_tokens_by_turn=turns,
                                 latency_s=0.01 * (i + 1)))
    return rows


def test_report_holds_exactly_the_metrics_json_numbers(tmp_path: Path) -> None:
    rows = _sample_rows()
    flat = aggregate(rows)
    (tmp_path / "metrics.json").write_text(json.dumps(flat))
    plots = write_plots(tmp_path / "plots", flat, rows)
    md_path, html_path = write_report(tmp_path, flat, header={"model": "m"}, plots=plots)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    printed = parse_report_tables(md_path.read_text())
    # Every metrics.json key appears once in the tables, rounded for reading and no further.
    assert set(printed) == set(metrics)
    for key, value in metrics.items():
        metric = key.rsplit("/", 1)[1]
        assert float(printed[key]) == pytest.approx(value, abs=0.5 * 10 ** -decimals(metric)), key
        assert printed[key] == format_value(value, metric)
    assert format_value(301.4375, "peak_prompt_tokens") == "301.4" and format_value(0.123456, "em") == "0.123"
    assert format_value(12, "turns") == "12" and format_value(1.0, "em") == "1.000"
    assert set(plots) == {"prompt_tokens_by_turn", "em_vs_k", "peak_prompt_tokens_vs_k", "em_by_benchmark", "outcomes"}
    for p in plots.values():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = html_path.read_text()
    assert page.count("data:image/png;base64,") == len(plots)
    assert "<table>" in page and format_value(metrics["memory/world-k4/f1"], "f1") in page
    assert nested(flat)["memory"]["world-k4"]["objective_em"] == 0.5


def test_answer_scores_by_hand() -> None:
    from mempo.evaluation.metrics import answer_scores

    s = answer_scores("the Eiffel Tower!", ["Eiffel Tower"])
    assert (s["em"], s["f1"], s["substring_em"]) == (1.0, 1.0, 1.0)
    assert math.isnan(s["objective_em"]) and math.isnan(s["all_correct"])
    s = answer_scores("Eiffel Tower in Paris", ["Eiffel Tower"])
    # tokens: eiffel tower in paris vs eiffel tower: P = 2/4, R = 1 -> F1 = 2/3
    assert (s["em"], s["substring_em"]) == (0.0, 1.0) and s["f1"] == pytest.approx(2 / 3)
    assert answer_scores(None, ["x"])["em"] == 0.0
    # A plain gold answer containing ";" stays one objective.
    assert answer_scores("a; b", ["a; b"])["em"] == 1.0
    meta = [["Paris"], ["1900", "nineteen hundred"]]  # the objectives' answer lists
    s = answer_scores("Paris; 1901", ["Paris; 1900"], meta)
    assert (s["em"], s["objective_em"], s["all_correct"], s["substring_em"]) == (0.0, 0.5, 0.0, 0.0)
    assert s["f1"] == 0.5   # paris 1901 vs paris 1900: 1 common of 2 and 2
    s = answer_scores("paris ; nineteen hundred", ["Paris; 1900"], meta)
    assert (s["em"], s["objective_em"], s["all_correct"]) == (1.0, 1.0, 1.0)


def test_world_stands_for_k1_in_the_k_plots(tmp_path: Path) -> None:
    rows = [r for r in _sample_rows() if r["benchmark"] in ("world", "world-k4")]
    plots = write_plots(tmp_path, aggregate(rows), rows)
    assert "em_vs_k" in plots and "peak_prompt_tokens_vs_k" in plots
    only_world = [r for r in rows if r["benchmark"] == "world"]
    assert "em_vs_k" not in write_plots(tmp_path / "w", aggregate(only_world), only_world)


def test_episode_outcomes_by_hand(tmp_path: Path) -> None:
    from mempo.evaluation.outcomes import OUTCOMES, episode_outcome, outcome_shares

    k2 = dict(k=2, objective_em=0.0, all_correct=0.0)
    cases = {
        "correct": _row("memory", "world-k2", em=1.0, prediction="a; b", **{**k2, "objective_em": 1.0}),
        "partly correct": _row("memory", "world-k2", prediction="a; x", **{**k2, "objective_em": 0.5}),
        "wrong": _row("memory", "world-k2", prediction="x; y", **k2),
        "wrong count": _row("memory", "world-k2", prediction="a", **{**k2, "objective_em": 0.5}),
        "no answer": _row("memory", "world-k2", prediction="", format_valid=0.0, **k2),
        "turn limit": _row("memory", "world-k2", prediction="", hit_turn_limit=1.0, **k2),
        # a truncated episode is scored wrong whatever it answered
        "context limit": _row("memory", "world-k2", prediction="a; b", truncated=1.0, **k2),
    }
    for expected, row in cases.items():
        assert episode_outcome(row) == expected, expected
    # k = 1: one part is the right count, a wrong answer is "wrong"
    assert episode_outcome(_row("memory", "world", prediction="x")) == "wrong"
    assert episode_outcome(_row("memory", "world", prediction="x", em=1.0)) == "correct"
    rows = [*cases.values(), cases["turn limit"]]
    shares = outcome_shares(rows)
    assert list(shares) == list(OUTCOMES)
    assert shares["turn limit"] == 2 / 8 and shares["correct"] == 1 / 8
    assert sum(shares.values()) == pytest.approx(1.0)
    assert outcome_shares([]) == {}

    flat = aggregate(rows)
    plots = write_plots(tmp_path / "plots", flat, rows)
    assert plots["outcomes"].stat().st_size > 0
    md_path, _ = write_report(tmp_path, flat, plots=plots, rows=rows)
    md = md_path.read_text()
    line = next(x for x in md.splitlines() if x.startswith("| world-k2 | memory |"))
    assert line.split("|")[2:-1][1:] == [" 0.125 ", " 0.125 ", " 0.125 ", " 0.125 ", " 0.125 ", " 0.250 ", " 0.125 "]
    # the outcome table is not read back as metrics of a benchmark
    assert parse_report_tables(md) == {k: format_value(v, k.split("/")[2]) for k, v in flat.items()}
