"""The headline table: a hand-worked example and what is left out when a source is missing."""

from __future__ import annotations

from pathlib import Path

from mempo.headline import headline_metrics

EVAL = {
    # memory (MemPO) on three benchmarks, plus two baselines on the same three
    "memory/world/em": 0.5, "memory/world-k2/em": 0.25, "memory/world-k8/em": 0.0,
    "memory/world/peak_prompt_tokens": 300.0, "memory/world-k8/peak_prompt_tokens": 410.5,
    "full_context/world/em": 0.25, "full_context/world-k2/em": 0.25, "full_context/world-k8/em": 0.1,
    "full_context/world-k8/peak_prompt_tokens": 2310.0,
    "rag/world/em": 0.5, "rag/world-k2/em": 0.0, "rag/world-k8/em": 0.0,
    # a baseline that skipped a benchmark is not compared
    "direct/world/em": 0.9,
    "memory/world/n": 16, "memory/world/latency_s": 1.5,
}


def test_headline_worked_example() -> None:
    h = headline_metrics(EVAL, {"final_reward_mean": 0.3125, "final_kl": 0.0123, "steps": 20,
                                "mlflow_run_id": "abc"})
    # memory mean EM = (0.5 + 0.25 + 0) / 3 = 0.25; full_context 0.2, rag 0.1667: best baseline 0.2
    assert h == {
        "em.world": 0.5, "em.k2": 0.25, "em.k8": 0.0,
        "em.gain": 0.05,
        "tok.memory": 410.5, "tok.full": 2310.0,  # at the largest k (8)
        "reward": 0.3125, "kl": 0.0123,
    }
    assert list(h)[:3] == ["em.world", "em.k2", "em.k8"]  # benchmarks in k order


def test_missing_sources_leave_keys_out_never_nan() -> None:
    only_memory = {k: v for k, v in EVAL.items() if k.startswith("memory/")}
    h = headline_metrics({**only_memory, "memory/world-k2/em": float("nan")}, None)
    assert h == {"em.world": 0.5, "em.k8": 0.0, "tok.memory": 410.5}
    assert headline_metrics({}, {"final_kl": float("inf")}) == {}


def test_the_default_runs_headline_fits_a_terminal_in_dvc_metrics_show(tmp_path: Path) -> None:
    """Real DVC on the default run's shape (5 agents x world, k2, k4, k8): one row, <= 125 columns."""
    import json
    import subprocess
    import sys

    dvc = Path(sys.executable).parent / "dvc"
    agents = ["memory", "full_context", "external_memory", "rag", "direct"]
    table = {f"{a}/{b}/{m}": v for a in agents for b in ("world", "world-k2", "world-k4", "world-k8")
             for m, v in (("em", 0.123), ("peak_prompt_tokens", 3744.25))}
    h = headline_metrics(table, {"final_reward_mean": 0.151, "final_kl": 0.00123})
    assert len(h) == 9
    out = tmp_path / "outputs" / "register" / "headline.json"
    out.parent.mkdir(parents=True)
    out.write_text(json.dumps(h))
    (tmp_path / "dvc.yaml").write_text("metrics:\n  - outputs/register/headline.json\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([str(dvc), "init", "-q"], cwd=tmp_path, check=True)
    shown = subprocess.run([str(dvc), "metrics", "show"], cwd=tmp_path, check=True, capture_output=True,
                           text=True).stdout.rstrip().splitlines()
    assert len(shown) == 2 and shown[1].startswith("outputs/register/headline.json"), shown
    assert max(len(line) for line in shown) <= 125, shown
