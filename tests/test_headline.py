"""The headline table: a hand-worked example and what is left out when a source is missing."""

from __future__ import annotations

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
        "em.world": 0.5, "em.world-k2": 0.25, "em.world-k8": 0.0,
        "em.gain": 0.05,
        "tokens.memory": 410.5, "tokens.full_context": 2310.0,  # at the largest k (8)
        "train.reward": 0.3125, "train.kl": 0.0123,
    }
    assert list(h)[:3] == ["em.world", "em.world-k2", "em.world-k8"]  # benchmarks in k order


def test_missing_sources_leave_keys_out_never_nan() -> None:
    only_memory = {k: v for k, v in EVAL.items() if k.startswith("memory/")}
    h = headline_metrics({**only_memory, "memory/world-k2/em": float("nan")}, None)
    assert h == {"em.world": 0.5, "em.world-k8": 0.0, "tokens.memory": 410.5}
    assert headline_metrics({}, {"final_kl": float("inf")}) == {}
