"""`benchmarks/memory_credit.py`: each turn record's class (what its episode does at that turn)
and the per-class summary, on hand-built episodes. The end-to-end run on the tiny policy is in
tests/test_training_grpo.py (it shares that module's SFT fixture)."""

from __future__ import annotations

import pytest
from benchmark_helpers import load_benchmark


def memory_credit():
    return load_benchmark("memory_credit")


def _episode(answer: str | None, n_turns: int):
    from mempo.agent.rollout import Episode, TurnRecord

    ep = Episode(episode_id="t#0", item_id="t", question="q1?; q2?", golden_answers=["Paris; 1900"],
                 objectives=[["Paris"], ["1900", "nineteen hundred"]], context="memory", final_answer=answer)
    for t in range(n_turns):
        ep.turns.append(TurnRecord(turn_index=t, prompt_ids=[1], response_ids=[2], response_mask=[1], mem_mask=[1],
                                   memory="m", prompt_length=1, response_text="x", action="search", argument="a",
                                   valid=True, error=""))
    return ep


@pytest.mark.parametrize(("answer", "last_class"), [
    ("Paris; nineteen hundred", "answer: all right"),
    ("Paris; 1901", "answer: some right"),
    ("Lyon", "answer: none right"),
    (None, "last turn, no answer"),
])
def test_turn_class(answer, last_class):
    mod = memory_credit()
    ep = _episode(answer, 3)
    assert [mod.turn_class(ep, t) for t in range(3)] == ["continuing", "continuing", last_class]


def test_summarise_per_class():
    mod = memory_credit()
    classes = ["continuing", "continuing", "answer: some right", "continuing", "answer: all right"]
    out = mod.summarise(classes, [1.0, 2.0, 6.0, 0.0, 9.0], [-0.5, 0.5, 0.8, -1.0, 1.2], [-1.0, 1.0, 0.0, 0.0, 0.0],
                        [-1.0, 1.0, -0.4, 0.0, 0.4])
    assert list(out) == ["answer: all right", "answer: some right", "continuing"]  # CLASSES order, empty ones left out
    cont = out["continuing"]
    assert cont["n"] == 3 and cont["r_m_mean"] == pytest.approx(1.0) and cont["a_m_mean"] == pytest.approx(-1 / 3)
    assert cont["a_m_positive_share"] == pytest.approx(1 / 3)
    assert out["answer: some right"]["a_m_mean_final_memory_skip"] == 0.0
    assert out["answer: some right"]["a_m_mean_final_memory_closing"] == pytest.approx(-0.4)
    assert out["answer: all right"]["a_m_positive_share_final_memory_closing"] == 1.0
    assert cont["a_m_positive_share_final_memory_closing"] == pytest.approx(1 / 3)
