"""The GPU smoke script (scripts/gpu_smoke.py) on CPU, as a bare GPU machine would run it:
only torch, transformers, tokenizers, sentence-transformers and their dependencies
importable (tests/bare_python.py), pydantic removed too, so every fallback is exercised."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from bare_python import run

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_smoke_runs_on_cpu_with_only_the_bare_machines_packages(tmp_path):
    out = tmp_path / "gpu_smoke.json"
    proc = run(["scripts/gpu_smoke.py", "--device", "cpu", "--quick", "--out", str(out), "--work", str(tmp_path / "w")],
               blocked={"pydantic"}, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["gpu"] is None
    assert {"pydantic", "faiss", "bm25s", "mlflow"} <= set(result["missing_optional"])
    assert "PyYAML" in result["fallbacks"]["params"]
    phases = result["phases"]
    assert phases["sft"]["steps"] == 3 and phases["sft"]["tokens"] > 0 and phases["sft"]["teacher_samples"] > 0
    assert phases["grpo"]["steps"] == 1 and phases["grpo"]["generated_tokens"] > 0 and phases["grpo"]["turns"] > 0
    assert phases["probe"]["probes"] == phases["grpo"]["turns"]  # one probe per rollout turn
    assert phases["grpo"]["decoder"] == "fast"  # the GRPO stage's generator, not generate()
    dec = phases["decoder"]  # the fast decoder against generate() on the rollouts' prompts, greedy
    assert dec["batches"]["8"]["fast"]["tokens"] == dec["batches"]["8"]["hf"]["tokens"] > 0
    assert dec["greedy_identical"] == f"{dec['prompts']}/{dec['prompts']}"
    for key in ("sft_tokens_per_s", "rollout_tokens_per_s", "probe_tokens_per_s", "encoder_passages_per_s"):
        assert result["summary"][key] > 0, key
    assert result["summary"]["peak_gpu_mib"] is None  # no GPU here: nothing invented


def test_bare_site_really_lacks_the_project_stack():
    proc = run(["-c", "import importlib.util as u; print([m for m in ('torch', 'transformers', 'tokenizers', "
                "'sentence_transformers', 'faiss', 'bm25s', 'mlflow', 'pandas', 'pydantic') if u.find_spec(m)])"],
               blocked={"pydantic"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['torch', 'transformers', 'tokenizers', 'sentence_transformers']"


def test_make_target_needs_no_venv():
    text = (REPO / "Makefile").read_text()
    rule = re.search(r"^gpu-smoke:(.*)\n\t(.+)$", text, re.M)
    assert rule and "setup" not in rule.group(1).split("##")[0]
    assert "scripts/gpu_smoke.py --device cuda" in rule.group(2) and "$(BIN)" not in rule.group(2)
    dry = subprocess.run(["make", "-n", "gpu-smoke"], cwd=REPO, capture_output=True, text=True, check=True)
    assert "scripts/gpu_smoke.py --device cuda" in dry.stdout and "pip install" not in dry.stdout
