"""`benchmarks/decode.py --quick` end to end on the tiny world: the JSON it writes has every
section, both decoders measured, and the fast decoder's greedy outputs equal `generate()`'s
in that run (decode rows and evaluation answers). No assertion on timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_decode_benchmark_writes_both_decoders_and_equal_greedy_outputs(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--quick", "--out", str(out),
         "--work", str(tmp_path / "work")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())

    assert res["quick"] is True and res["threads"] == 1 and res["matmul_peak_flops"] > 0
    rows = res["decode"]["tiny"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["greedy_identical"] is True, r["batch"]
        for k in ("hf", "fast"):
            assert r[k]["generated_tokens"] > 0
            assert len(r[k]["wall_s"]) == res["repeats"] == len(r[k]["cpu_s"])
            assert r[k]["tokens_per_s"] > 0 and 0 < r[k]["flop_util"]
        assert r["ratio"] == pytest.approx(r["fast"]["tokens_per_s"] / r["hf"]["tokens_per_s"])
        assert r["hf"]["generated_tokens"] == r["fast"]["generated_tokens"]

    ro = res["rollouts"]
    assert ro["batch_questions"] * ro["n_rollouts"] == ro["hf"]["episodes"] == ro["fast"]["episodes"] == 4
    assert ro["hf"]["response_tokens"] > 0 and ro["fast"]["response_tokens"] > 0
    assert ro["ratio"] == pytest.approx(ro["fast"]["tokens_per_s"] / ro["hf"]["tokens_per_s"])

    ev = res["eval"]
    assert ev["benchmarks"] == {"world": 2, "world-k2": 2}
    assert ev["hf"]["samples"] == ev["fast"]["samples"] == 2 * 2 * len(ev["agents"])
    assert ev["same_predictions"] is True  # greedy: the same answers through either decoder
    assert ev["ratio"] == pytest.approx(ev["hf"]["wall_s"] / ev["fast"]["wall_s"])

    s = res["summary"]
    assert s["greedy_identical"] is True and s["tiny_batch32_ratio"] is None  # quick runs no batch 32
    assert set(s["rollout_tokens_per_s"]) == set(s["eval_wall_s"]) == {"hf", "fast"}
