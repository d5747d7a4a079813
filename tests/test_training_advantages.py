"""mempo.training.grpo_update.build_turn_samples: A^T everywhere, lambda_mem * A^M on <mem> tokens only."""

from __future__ import annotations

import pytest
import torch


def _episode(item: str, r: int, turns: list[tuple[list[int], list[int]]]):
    from mempo.agent.rollout import Episode, TurnRecord

    ep = Episode(episode_id=f"{item}#{r}", item_id=item, question="q?", golden_answers=["a"],
                 objectives=[["a"]], context="memory")
    for t, (ids, mem_mask) in enumerate(turns):
        ep.turns.append(TurnRecord(
            turn_index=t, prompt_ids=[1, 2, 3], response_ids=ids, response_mask=[1] * len(ids),
            mem_mask=mem_mask, memory="m", prompt_length=3, response_text="x", action="search",
            argument="q", valid=True, error=""))
    return ep


@pytest.fixture()
def step_batch():
    from mempo.config import MempoParams

    eps = [
        _episode("A", 0, [([5, 6, 7, 8], [0, 1, 1, 0]), ([5, 6, 7], [0, 1, 0])]),
        _episode("A", 1, [([5, 6, 7, 8, 9], [0, 1, 1, 1, 0])]),
        _episode("B", 0, [([5, 6], [0, 1]), ([5, 6, 7], [0, 1, 0])]),
        _episode("B", 1, [([5, 6, 7], [0, 1, 0]), ([5, 6], [0, 1])]),
    ]
    groups = [ep.item_id for ep in eps]
    outcome = [1.0, 0.0, 0.0, 1.0]
    mem_r = torch.tensor([0.3, -0.2, 0.5, 0.1, 0.9, 0.2, 0.4])  # one per turn record, in order
    return eps, groups, outcome, mem_r, MempoParams()


def test_lambda_mem_zero_leaves_mem_tokens_with_exactly_a_t(step_batch) -> None:
    from mempo.advantage import grpo_outcome_advantage
    from mempo.training.grpo_update import build_turn_samples

    eps, groups, outcome, mem_r, mp = step_batch
    samples, adv = build_turn_samples(eps, groups, outcome, mem_r, 0.0, mp)
    a_t = grpo_outcome_advantage(outcome, groups)
    assert torch.any(adv["A_M"] != 0)  # there IS a memory advantage to leave out
    for s in samples:
        assert s.advantages == [float(a_t[s.episode])] * len(s.response_ids)


def test_lambda_mem_adds_memory_advantage_on_mem_tokens_only(step_batch) -> None:
    from mempo.training.grpo_update import build_turn_samples

    eps, groups, outcome, mem_r, mp = step_batch
    lam = 0.5
    samples, adv = build_turn_samples(eps, groups, outcome, mem_r, lam, mp)
    masks = [t.mem_mask for ep in eps for t in ep.turns]
    assert len(samples) == len(masks) == 7
    for k, (s, mask) in enumerate(zip(samples, masks, strict=True)):
        a_t = float(adv["A_T"][s.episode])
        for a, m in zip(s.advantages, mask, strict=True):
            expect = a_t + lam * float(adv["A_M"][k]) if m else a_t
            assert a == pytest.approx(expect, abs=1e-6)


def test_weights_make_a_token_mean_per_trajectory(step_batch) -> None:
    from mempo.training.grpo_update import build_turn_samples

    eps, groups, outcome, mem_r, mp = step_batch
    samples, _ = build_turn_samples(eps, groups, outcome, mem_r, 1.0, mp)
    per_episode = [0.0] * len(eps)
    for s in samples:
        per_episode[s.episode] += s.weight * len(s.response_ids)
    # each trajectory contributes 1/E in total, whatever its length
    assert per_episode == pytest.approx([1 / len(eps)] * len(eps))


def test_step_tasks_cover_each_epoch_without_repeats() -> None:
    from mempo.training.grpo import step_tasks

    seen = [i for step in range(5) for i in step_tasks(10, 2, step, seed=3)]
    assert sorted(seen) == list(range(10))
    assert step_tasks(10, 2, 7, seed=3) == step_tasks(10, 2, 7, seed=3)


def test_episode_metrics_split_em_and_format_by_number_of_objectives() -> None:
    from mempo.agent.rollout import Episode, TurnRecord
    from mempo.training.grpo import episode_metrics

    def ep(objectives: list[list[str]], answer: str) -> Episode:
        e = Episode(episode_id=answer, item_id=answer, question="q?", golden_answers=["; ".join(o[0] for o in objectives)],
                    objectives=objectives, context="memory", final_answer=answer)
        e.turns.append(TurnRecord(turn_index=0, prompt_ids=[1], response_ids=[5], response_mask=[1], mem_mask=[0],
                                  memory="m", prompt_length=1, response_text=f"<mem> m </mem> <answer> {answer} </answer>",
                                  action="answer", argument=answer, valid=True, error=""))
        return e

    single_right, single_wrong = ep([["Paris"]], "Paris"), ep([["Paris"]], "Rome")
    k2_half = ep([["Paris"], ["1900"]], "Paris; 1901")
    got = episode_metrics([single_right, single_wrong, k2_half], [1.0, 0.0, 0.0], "all")
    assert got["em_k1"] == 0.5 and got["em_k2"] == 0.0 and got["format_valid_k2"] == 1.0
    assert episode_metrics([single_right, k2_half], [1.0, 0.5], "mean")["em_k2"] == 0.5  # the training rule
    assert "em_k1" not in episode_metrics([single_right, single_wrong], [1.0, 0.0], "all")  # no mixture, no split


def test_final_memory_skip_gives_each_episodes_last_memory_only_a_t(step_batch) -> None:
    from mempo.training.grpo_update import build_turn_samples

    eps, groups, outcome, mem_r, mp = step_batch
    samples, adv = build_turn_samples(eps, groups, outcome, mem_r, 1.0, mp.model_copy(update={"final_memory": "skip"}))
    last = [t.turn_index == len(ep.turns) - 1 for ep in eps for t in ep.turns]
    assert last == [False, True, True, False, True, False, True]
    assert [float(a) for a, is_last in zip(adv["A_M"], last, strict=True) if is_last] == [0.0] * 4
    for s, is_last in zip(samples, last, strict=True):
        if is_last:  # the answer turn's memory tokens get the outcome advantage alone
            assert s.advantages == [float(adv["A_T"][s.episode])] * len(s.response_ids)
    # B's turn-0 memories (both episodes continue) keep their advantage: 0.1 vs 0.2 -> -+1/sqrt(2);
    # A's turn-0 set now holds only episode A#0 (A#1's one memory is its last) -> 0.
    assert float(adv["A_M"][3]) == pytest.approx(-(2 ** -0.5), abs=1e-4)
    assert float(adv["A_M"][5]) == pytest.approx(2 ** -0.5, abs=1e-4)
    assert float(adv["A_M"][0]) == 0.0
    _, scored = build_turn_samples(eps, groups, outcome, mem_r, 1.0, mp)
    assert float(scored["A_M"][0]) != 0.0  # with final memories scored, A#1's one memory joins A's turn-0 set


def test_final_memory_closing_normalises_the_last_memories_among_their_tasks_closes(step_batch) -> None:
    from mempo.advantage import last_turn_flags, memory_advantage
    from mempo.training.grpo_update import build_turn_samples

    eps, groups, outcome, mem_r, mp = step_batch
    for ep in eps[:3]:  # B#1 stops at the turn limit: no answer, so its last memory is no close
        ep.final_answer = "a"
    closing = mp.model_copy(update={"final_memory": "closing"})
    _, adv = build_turn_samples(eps, groups, outcome, mem_r, 1.0, closing)
    rec_episode = [e for e, ep in enumerate(eps) for _ in ep.turns]
    rec_turn = [t.turn_index for ep in eps for t in ep.turns]
    last = last_turn_flags(rec_episode, rec_turn)
    closes = last & torch.tensor([e < 3 for e in rec_episode])
    want = memory_advantage(mem_r, [groups[e] for e in rec_episode], rec_turn, mp.norm_by_std, mp.mem_adv_group,
                            mp.adv_eps, mp.mem_adv_min_std, closing=closes)
    assert torch.equal(adv["A_M"], want)
    # B's close (B#0, 0.9) and B#1's last memory (0.4) are each alone in their sets -> 0; had the
    # turn-limit memory counted as a close, the two would share a set and get -+1/sqrt(2)
    assert float(adv["A_M"][4]) == 0.0 and float(adv["A_M"][6]) == 0.0
    as_closes = memory_advantage(mem_r, [groups[e] for e in rec_episode], rec_turn, mp.norm_by_std,
                                 mp.mem_adv_group, mp.adv_eps, mp.mem_adv_min_std, closing=last)
    assert float(as_closes[4]) == pytest.approx(2 ** -0.5, abs=1e-4)
    # A's closes (A#0 turn 1, A#1 turn 0) share one set; A#0's open memory is alone at turn 0
    assert float(adv["A_M"][1]) == pytest.approx(-(2 ** -0.5), abs=1e-4) and float(adv["A_M"][0]) == 0.0
    _, skipped = build_turn_samples(eps, groups, outcome, mem_r, 1.0, mp.model_copy(update={"final_memory": "skip"}))
    # the open memories' sets are the skip mode's where every rollout answered (task A)
    assert torch.equal(adv["A_M"][:3][~last[:3]], skipped["A_M"][:3][~last[:3]])
