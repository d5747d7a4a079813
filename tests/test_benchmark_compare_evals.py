"""`benchmarks/compare_evals.py` on two hand-built `mempo eval` folders: paired differences
over the shared tasks, outcome shares, and a clear error for a folder without samples."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from benchmark_helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return load_benchmark("compare_evals")


def _write(folder: Path, k2_em: list[float], k2_obj: list[float], limit: list[int]) -> Path:
    rows = []
    for i, (em, obj, lim) in enumerate(zip(k2_em, k2_obj, limit, strict=True)):
        rows.append({"agent": "memory", "benchmark": "world-k2", "id": f"t{i}", "k": 2, "em": em,
                     "objective_em": obj, "all_correct": em, "format_valid": 1.0, "turns": 4,
                     "peak_prompt_tokens": 300, "hit_turn_limit": float(lim), "truncated": 0.0,
                     "prediction": "" if lim else "a; b"})
    rows.append({"agent": "rag", "benchmark": "world-k2", "id": "t0", "k": 2, "em": 1.0, "objective_em": 1.0,
                 "all_correct": 1.0, "format_valid": 1.0, "turns": 1, "peak_prompt_tokens": 10,
                 "hit_turn_limit": 0.0, "truncated": 0.0, "prediction": "a; b"})
    folder.mkdir()
    pd.DataFrame(rows).to_parquet(folder / "samples.parquet")
    return folder


def test_paired_differences_over_shared_tasks_and_outcomes(tmp_path: Path) -> None:
    mod = _module()
    base = _write(tmp_path / "base", [0, 0, 1, 0], [0.5, 0, 1, 0], [0, 1, 0, 1])
    better = _write(tmp_path / "better", [1, 0, 1, 1], [1, 0.5, 1, 1], [0, 1, 0, 0])
    out = tmp_path / "cmp.json"
    assert mod.main(["--base", f"b={base}", "--runs", f"x={better}", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["benchmarks"]["world-k2"]
    assert res["b"]["n"] == 4 and res["b"]["em"] == pytest.approx(0.25)  # the rag row is not counted
    assert res["x"]["em_minus_b"]["mean"] == pytest.approx(0.5)
    assert res["x"]["objective_em_minus_b"]["mean"] == pytest.approx(0.5)
    assert res["x"]["em_minus_b"]["ci95_low"] <= 0.5 <= res["x"]["em_minus_b"]["ci95_high"]
    assert res["b"]["outcomes"]["turn limit"] == pytest.approx(0.5)
    assert res["x"]["outcomes"]["correct"] == pytest.approx(0.75)


def test_several_folders_of_one_policy_are_joined(tmp_path: Path) -> None:
    mod = _module()
    base = _write(tmp_path / "base", [0, 1], [0.5, 1], [0, 0])
    extra = tmp_path / "k4"
    extra.mkdir()
    pd.DataFrame([{"agent": "memory", "benchmark": "world-k4", "id": "q0", "k": 4, "em": 0.0,
                   "objective_em": 0.25, "all_correct": 0.0, "prediction": "a; b; c; d"}]).to_parquet(
        extra / "samples.parquet")
    rows = mod.load_rows([base, extra], "memory")
    assert sorted(rows) == ["world-k2", "world-k4"] and len(rows["world-k2"]) == 2
    assert rows["world-k4"]["q0"]["objective_em"] == pytest.approx(0.25)


def test_a_folder_without_samples_is_named(tmp_path: Path) -> None:
    mod = _module()
    base = _write(tmp_path / "base", [1], [1], [0])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="empty/samples.parquet"):
        mod.main(["--base", f"b={base}", "--runs", f"x={tmp_path / 'empty'}", "--out", str(tmp_path / "o.json")])
    assert not (tmp_path / "o.json").exists()
