"""Advantages: hand-worked numbers (2 prompts x 3 rollouts x up to 3 turns), properties, and
`answer_probability` against an unbatched reference on a tiny Qwen2 model."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_agent_helpers import build_bpe_tokenizer, tiny_qwen2

from mempo.advantage import (
    MemoryTurn,
    answer_probability,
    combine,
    final_memory_flags,
    grpo_outcome_advantage,
    last_turn_flags,
    memory_advantage,
    memory_reward,
    memory_reward_from_scores,
)

# ---------------------------------------------------------------- the hand-worked batch
# Prompt P1 has rollouts a (3 turns), b (2 turns), c (1 turn); prompt P2 has d (2), e (2), f (3).
ROLLOUT = ["a", "a", "a", "b", "b", "c", "d", "d", "e", "e", "f", "f", "f"]
GROUP = ["P1"] * 6 + ["P2"] * 7
TURN = [0, 1, 2, 0, 1, 0, 0, 1, 0, 1, 0, 1, 2]
# P(a* | q, mem_t) per turn record (form=prob)
PROB = [0.2, 0.5, 0.9, 0.1, 0.3, 0.4, 0.5, 0.7, 0.3, 0.6, 0.2, 0.2, 0.8]
# P(a* | full context up to t) per turn record (eps=full_context)
FULL = [0.3, 0.6, 0.9, 0.2, 0.5, 0.4, 0.5, 0.9, 0.5, 0.6, 0.4, 0.4, 0.8]
# mean log P(a* | q, mem_t) (form=logprob)
LOGP = [-2.0, -1.0, -0.5, -3.0, -1.5, -1.0, -1.0, -0.5, -2.0, -1.0, -2.5, -2.5, -0.25]

# Normalised values that recur: for deviations (1, -4, 5)/30 etc. the unbiased std gives
# 5/sqrt(21) = 1.091089, 1/sqrt(21) = 0.218218, 4/sqrt(21) = 0.872872; two items -> +-1/sqrt(2).
A = 1 / math.sqrt(21)
H = 1 / math.sqrt(2)


def test_grpo_outcome_advantage_hand_worked():
    # P1 rewards (1, 0, 0): mean 1/3, unbiased std sqrt(1/3) -> (2/3, -1/3, -1/3) / 0.57735
    # P2 rewards (1, 1, 0): mean 2/3 -> (1/3, 1/3, -2/3) / 0.57735
    adv = grpo_outcome_advantage([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], ["P1"] * 3 + ["P2"] * 3)
    expected = [1.154701, -0.577350, -0.577350, 0.577350, 0.577350, -1.154701]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)
    centred = grpo_outcome_advantage([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], ["P1"] * 3 + ["P2"] * 3, norm_by_std=False)
    assert centred.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3], abs=1e-6)
    # a group of one, and a group with equal rewards, give 0
    assert grpo_outcome_advantage([1.0, 0.5, 0.5], ["x", "y", "y"]).tolist() == [0.0, 0.0, 0.0]


def test_memory_reward_previous_prob_hand_worked():
    # R = P(mem_t) - P(mem_{t-1}); 0 before the first memory
    r = memory_reward_from_scores(PROB, ROLLOUT, TURN, eps="previous")
    expected = [0.2, 0.3, 0.4, 0.1, 0.2, 0.4, 0.5, 0.2, 0.3, 0.3, 0.2, 0.0, 0.6]
    assert r.tolist() == pytest.approx(expected, abs=1e-6)
    adv = memory_advantage(r, GROUP, TURN)
    # P1 t0: (0.2, 0.1, 0.4) mean 0.2333 -> dev (-1, -4, 5)/30, std sqrt(0.07/3)
    # P1 t1: (0.3, 0.2) -> +-1/sqrt(2); P1 t2: alone -> 0
    # P2 t0: (0.5, 0.3, 0.2) -> dev (5, -1, -4)/30; P2 t1: (0.2, 0.3, 0.0) -> dev (1, 4, -5)/30
    # P2 t2: alone -> 0
    expected_adv = [-A, H, 0.0, -4 * A, -H, 5 * A, 5 * A, A, -A, 4 * A, -4 * A, -5 * A, 0.0]
    assert adv.tolist() == pytest.approx(expected_adv, abs=1e-4)


def test_memory_reward_none_prob_hand_worked():
    r = memory_reward_from_scores(PROB, ROLLOUT, TURN, eps="none")
    assert r.tolist() == pytest.approx(PROB, abs=1e-6)
    adv = memory_advantage(r, GROUP, TURN)
    # P1 t1: (0.5, 0.3) -> +-1/sqrt(2); P2 t1: (0.7, 0.6, 0.2) mean 0.5, dev (0.2, 0.1, -0.3),
    # unbiased std sqrt(0.07) = 0.264575 -> (0.755929, 0.377964, -1.133893)
    expected = [-A, H, 0.0, -4 * A, -H, 5 * A, 5 * A, 0.755929, -A, 0.377964, -4 * A, -1.133893, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-4)


def test_memory_reward_full_context_prob_hand_worked():
    r = memory_reward_from_scores(PROB, ROLLOUT, TURN, eps="full_context", full_context_scores=FULL)
    expected = [-0.1, -0.1, 0.0, -0.1, -0.2, 0.0, 0.0, -0.2, -0.2, 0.0, -0.2, -0.2, 0.0]
    assert r.tolist() == pytest.approx(expected, abs=1e-6)
    adv = memory_advantage(r, GROUP, TURN)
    # P1 t0: (-0.1, -0.1, 0.0): dev (-1, -1, 2)/30, std 0.057735 -> (-0.57735, -0.57735, 1.154701)
    # P1 t1: (-0.1, -0.2) -> +-1/sqrt(2)
    # P2 t0: (0.0, -0.2, -0.2) -> (1.154701, -0.57735, -0.57735); P2 t1: (-0.2, 0.0, -0.2) -> (-0.57735, 1.154701, -0.57735)
    expected_adv = [-0.57735, H, 0.0, -0.57735, -H, 1.154701, 1.154701, -0.57735, -0.57735, 1.154701,
                    -0.57735, -0.57735, 0.0]
    assert adv.tolist() == pytest.approx(expected_adv, abs=1e-4)
    with pytest.raises(ValueError, match="full_context_scores"):
        memory_reward_from_scores(PROB, ROLLOUT, TURN, eps="full_context")


def test_memory_reward_logprob_forms_hand_worked():
    prev = memory_reward_from_scores(LOGP, ROLLOUT, TURN, eps="previous")
    expected = [-2.0, 1.0, 0.5, -3.0, 1.5, -1.0, -1.0, 0.5, -2.0, 1.0, -2.5, 0.0, 2.25]
    assert prev.tolist() == pytest.approx(expected, abs=1e-6)
    adv = memory_advantage(prev, GROUP, TURN)
    # P1 t0: (-2, -3, -1): std 1 -> (0, -1, 1); P1 t1: (1.0, 1.5) -> -+1/sqrt(2)
    # P2 t0: (-1, -2, -2.5): dev (5, -1, -4)/6, std 0.763763 -> 5A, -A, -4A
    # P2 t1: (0.5, 1.0, 0.0): std 0.5 -> (0, 1, -1)
    expected_adv = [0.0, -H, 0.0, -1.0, H, 1.0, 5 * A, 0.0, -A, 1.0, -4 * A, -1.0, 0.0]
    assert adv.tolist() == pytest.approx(expected_adv, abs=1e-4)
    # logprob with full context: log P(mem) - log P(full), here with log of the FULL probabilities
    full_lp = [math.log(x) for x in FULL]
    mem_lp = [math.log(x) for x in PROB]
    r = memory_reward_from_scores(mem_lp, ROLLOUT, TURN, eps="full_context", full_context_scores=full_lp)
    assert r[0].item() == pytest.approx(math.log(0.2 / 0.3), abs=1e-6)  # -0.405465
    assert r[7].item() == pytest.approx(math.log(0.7 / 0.9), abs=1e-6)  # -0.251314
    assert r[2].item() == pytest.approx(0.0, abs=1e-6)


def test_rm_max_zero_makes_the_memory_reward_a_retention_penalty_hand_worked():
    """One task, one turn, three rollouts: a closing memory that restates the answers (log P
    5 above the history's), a search's memory that keeps what it found (+2) and one that
    dropped it (-1). Unbounded, A^M ranks closing first; with rm_max 0 closing and keeping
    tie (0, 0, -1): mean -1/3, unbiased std sqrt(1/3), A^M (+0.57735, +0.57735, -1.154701)."""
    mem, full = [-1.0, -4.0, -7.0], [-6.0, -6.0, -6.0]
    rollouts, turns, groups = ["a", "b", "c"], [2, 2, 2], ["q", "q", "q"]
    free = memory_reward_from_scores(mem, rollouts, turns, eps="full_context", full_context_scores=full)
    assert free.tolist() == pytest.approx([5.0, 2.0, -1.0])
    assert memory_advantage(free, groups, turns).argmax().item() == 0
    capped = memory_reward_from_scores(mem, rollouts, turns, eps="full_context", full_context_scores=full,
                                       rm_max=0.0)
    assert capped.tolist() == pytest.approx([0.0, 0.0, -1.0])
    assert memory_advantage(capped, groups, turns).tolist() == pytest.approx([0.57735, 0.57735, -1.154701], abs=1e-5)
    # every memory at least as good as the history: no memory signal at all (the std floor)
    none_lost = memory_reward_from_scores([-1.0, -4.0], ["a", "b"], [0, 0], eps="full_context",
                                          full_context_scores=[-6.0, -6.0], rm_max=0.0)
    assert memory_advantage(none_lost, ["q", "q"], [0, 0], min_std=0.01).tolist() == [0.0, 0.0]
    # the cap applies to every baseline (here eps previous, scores 0.1 -> 0.4: +0.3 capped at 0.2)
    assert memory_reward_from_scores([0.1, 0.4], ["a", "a"], [0, 1], rm_max=0.2).tolist() == pytest.approx([0.1, 0.2])


def test_memory_advantage_per_group_and_unnormalised_hand_worked():
    r = memory_reward_from_scores(PROB, ROLLOUT, TURN, eps="previous")
    adv = memory_advantage(r, GROUP, TURN, group="per_group")
    # P1 all six records (0.2, 0.3, 0.4, 0.1, 0.2, 0.4): mean 0.266667, unbiased std 0.121106
    expected_p1 = [-0.550482, 0.275241, 1.100964, -1.376205, -0.550482, 1.100964]
    assert adv[:6].tolist() == pytest.approx(expected_p1, abs=1e-4)
    centred = memory_advantage(r, GROUP, TURN, norm_by_std=False)
    assert centred[:3].tolist() == pytest.approx([-1 / 30, 0.05, 0.0], abs=1e-6)


def test_last_turn_flags_and_skipping_final_memories_hand_worked():
    flags = last_turn_flags(ROLLOUT, TURN)
    # a: turns 0-2, b: 0-1, c: 0, d: 0-1, e: 0-1, f: 0-2 -> each rollout's highest turn index
    assert flags.tolist() == [False, False, True, False, True, True, False, True, False, True, False, False, True]
    r = memory_reward_from_scores(PROB, ROLLOUT, TURN, eps="none")
    adv = memory_advantage(r, GROUP, TURN, skip=flags)
    assert adv[flags].tolist() == [0.0] * 6
    # P1 turn 0 without c (the last memory of a one-turn rollout): a 0.2, b 0.1 -> +-1/sqrt(2);
    # with c (0.4) in the set, a would be below the mean instead (-0.218).
    assert adv[[0, 3]].tolist() == pytest.approx([H, -H], abs=1e-4)
    assert memory_advantage(r, GROUP, TURN)[0].item() == pytest.approx(-A, abs=1e-5)
    # P2 turn 1: d, e, f reach it but only f continues -> alone in its set -> 0
    assert adv[11].item() == 0.0
    # group ids as a tensor of codes give the same sets
    codes = torch.tensor([0] * 6 + [1] * 7)
    assert torch.equal(memory_advantage(r, codes, torch.tensor(TURN), skip=flags), adv)
    # skipping nothing is the plain advantage; a flag per reward is required
    assert torch.equal(memory_advantage(r, GROUP, TURN, skip=[False] * 13), memory_advantage(r, GROUP, TURN))
    with pytest.raises(ValueError, match="12 flags for 13"):
        memory_advantage(r, GROUP, TURN, skip=[False] * 12)


def test_closing_memories_normalised_among_their_tasks_closes_hand_worked():
    """final_memory closing: each rollout's last memory competes with the task's other last
    memories (any turn), the rest within (task, turn) without them."""
    rollout = ["a", "a", "b", "b", "b", "c", "d", "d"]
    group = ["P"] * 6 + ["Q"] * 2
    turn = [0, 1, 0, 1, 2, 0, 0, 1]
    r = [1.0, 5.0, 2.0, 3.0, 4.0, 6.0, 7.0, 9.0]
    close = last_turn_flags(rollout, turn)
    assert close.tolist() == [False, True, False, False, True, True, False, True]
    adv = memory_advantage(r, group, turn, closing=close, eps=0.0)
    # P's closes 5, 4, 6 (turns 1, 2, 0): mean 5, std 1 -> 0, -1, +1
    assert adv[[1, 4, 5]].tolist() == pytest.approx([0.0, -1.0, 1.0], abs=1e-6)
    # P turn 0 without c's close: 1, 2 -> -+1/sqrt(2); P turn 1 open: b's 3 alone -> 0
    assert adv[[0, 2, 3]].tolist() == pytest.approx([-H, H, 0.0], abs=1e-4)
    # Q: one rollout, its open and its closing memory each alone -> 0
    assert adv[[6, 7]].tolist() == [0.0, 0.0]
    # per turn (score), c's close at turn 0 sits with the open memories 1, 2: mean 3, std sqrt(7)
    assert memory_advantage(r, group, turn, eps=0.0)[0].item() == pytest.approx(-2 / 7 ** 0.5, abs=1e-5)
    assert torch.equal(memory_advantage(r, group, turn, closing=[False] * 8), memory_advantage(r, group, turn))
    with pytest.raises(ValueError, match="7 flags for 8"):
        memory_advantage(r, group, turn, closing=[False] * 7)
    # with records skipped too, the closing sets are formed among the records kept
    skip = [False, False, False, False, False, True, False, False]  # c's close left out
    both = memory_advantage(r, group, turn, closing=close, skip=skip, eps=0.0)
    assert both[5].item() == 0.0 and both[[1, 4]].tolist() == pytest.approx([2 ** -0.5, -(2 ** -0.5)], abs=1e-5)
    # the trainers' keyword per mode
    assert final_memory_flags("score", rollout, turn) == {}
    answered = [r != "b" for r in rollout]  # b stopped at the turn limit: its last memory is no close
    got = final_memory_flags("closing", rollout, turn, answered)["closing"]
    assert got.tolist() == [False, True, False, False, False, True, False, True]
    with pytest.raises(ValueError, match="needs `answered`"):
        final_memory_flags("closing", rollout, turn)
    with pytest.raises(ValueError, match="7 flags for 8"):
        final_memory_flags("closing", rollout, turn, answered[:7])
    assert torch.equal(final_memory_flags("skip", rollout, turn)["skip"], close)
    with pytest.raises(ValueError, match="unknown final_memory mode 'last'"):
        final_memory_flags("last", rollout, turn)


def test_combine_hand_worked():
    a_t = torch.tensor([1.154701, -0.57735])
    a_m = torch.tensor([-0.218218, 0.707107])
    mem_mask = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    resp_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    out = combine(a_t, a_m, mem_mask, lambda_mem=0.5, response_mask=resp_mask)
    expected = [[1.154701, 1.045592, 1.045592, 1.154701, 0.0],
                [-0.223797, -0.223797, -0.57735, -0.57735, -0.57735]]
    assert out.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]


# ---------------------------------------------------------------- properties

_sizes = st.integers(min_value=1, max_value=4)


@st.composite
def _batch(draw):
    n_groups = draw(_sizes)
    rows = []
    for g in range(n_groups):
        for _ in range(draw(_sizes)):
            rows.append((g, draw(st.integers(0, 2))))
    rewards = draw(st.lists(st.floats(-5, 5, allow_nan=False), min_size=len(rows), max_size=len(rows)))
    return rows, rewards


@settings(max_examples=60, deadline=None)
@given(_batch(), st.floats(-100, 100, allow_nan=False))
def test_adding_a_constant_to_a_group_changes_nothing(batch, shift):
    rows, rewards = batch
    groups = [g for g, _ in rows]
    turns = [t for _, t in rows]
    shifted = [r + (shift if g == 0 else 0.0) for (g, _), r in zip(rows, rewards, strict=True)]
    for norm in (True, False):
        a = grpo_outcome_advantage(rewards, groups, norm_by_std=norm)
        b = grpo_outcome_advantage(shifted, groups, norm_by_std=norm)
        assert torch.allclose(a, b, atol=1e-3)
        for mode in ("per_turn", "per_group"):
            m1 = memory_advantage(rewards, groups, turns, norm_by_std=norm, group=mode)
            m2 = memory_advantage(shifted, groups, turns, norm_by_std=norm, group=mode)
            assert torch.allclose(m1, m2, atol=1e-3)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.data())
def test_memory_advantage_only_on_mem_tokens_and_lambda_zero_is_grpo(m, length, data):
    a_t = torch.tensor(data.draw(st.lists(st.floats(-3, 3, allow_nan=False), min_size=m, max_size=m)))
    a_m = torch.tensor(data.draw(st.lists(st.floats(-3, 3, allow_nan=False), min_size=m, max_size=m)))
    mask = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=length, max_size=length),
                                           min_size=m, max_size=m)))
    lam = data.draw(st.floats(0.1, 2.0))
    out = combine(a_t, a_m, mask, lambda_mem=lam)
    plain = a_t[:, None].expand(m, length)
    assert torch.allclose(out[mask == 0], plain[mask == 0])  # A^M is zero outside mem tokens
    assert torch.allclose(out - plain, lam * a_m[:, None] * mask, atol=1e-6)
    assert torch.equal(combine(a_t, a_m, mask, lambda_mem=0.0), plain)  # lambda_mem=0 -> plain GRPO


# ---------------------------------------------------------------- answer_probability


@pytest.fixture(scope="module")
def tiny_lm():
    texts = [
        "Paris is the capital of France.", "Quaevzawick was founded in 1058.",
        "The mayor of Gristead is Shainbrae Tivgroux.", "Who founded Taessesk Logistics?",
    ] * 5
    tok = build_bpe_tokenizer(texts, vocab_size=400)
    model = tiny_qwen2(len(tok), seed=1)
    return model, tok


def _reference(model, tok, prompt: str, answer: str) -> tuple[float, float]:
    p = tok.encode(prompt, add_special_tokens=False)
    a = tok.encode(answer, add_special_tokens=False)
    ids = torch.tensor([p + a])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = [logits[len(p) - 1 + i].log_softmax(-1)[tok_id].item() for i, tok_id in enumerate(a)]
    mean = sum(lp) / len(lp)
    return math.exp(mean), mean


@pytest.mark.parametrize("side", ["left", "right"])
def test_answer_probability_matches_unbatched_reference(tiny_lm, side):
    model, tok = tiny_lm
    prompts = ["Question: capital of France?\n<answer>", "Q: founded?",
               "A much longer prompt about Quaevzawick and its mayor, with more tokens in it. <answer>",
               "x"]
    answers = [" Paris", " 1058", " Shainbrae Tivgroux of Gristead", " France"]
    got = answer_probability(model, tok, prompts, answers, batch_size=3, padding_side=side)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        prob, mean = _reference(model, tok, p, a)
        assert got.prob[i].item() == pytest.approx(prob, abs=1e-5)
        assert got.mean_logprob[i].item() == pytest.approx(mean, abs=1e-5)
        assert got.n_tokens[i].item() == len(tok.encode(a, add_special_tokens=False))
    assert ((got.prob > 0) & (got.prob < 1)).all()


def test_packed_answer_probability_matches_unbatched_reference(tiny_lm):
    """Probes that extend each other (one episode's full histories), share only a question, or
    nothing: packed (`mempo.training.packing`) they run each shared prefix once and score what
    their own rows score."""
    from mempo.training.packing import pack_sequences

    model, tok = tiny_lm
    history = "Question: who is the mayor of Gristead? " + " ".join(
        f"<search> Gristead mayor {i} </search> <information> Doc {i} Gristead is a town; its mayor is someone. "
        "</information>" for i in range(4))
    cuts = [history.index("<search>", 60 * i) for i in range(1, 5)]
    prompts = [history[:c] + "<answer>" for c in cuts] + [history + "<answer>"]
    prompts += ["Question: who is the mayor of Gristead? <mem> nothing yet </mem> <answer>",
                "Question: who is the mayor of Gristead? <mem> the mayor is Shainbrae </mem> <answer>",
                "x", "Q: founded?"]
    answers = [" Shainbrae Tivgroux"] * 5 + [" Shainbrae Tivgroux", " Shainbrae", " France", " 1058"]
    seqs = [tok.encode(p, add_special_tokens=False) + tok.encode(a, add_special_tokens=False)
            for p, a in zip(prompts, answers, strict=True)]
    firsts = [len(tok.encode(p, add_special_tokens=False)) - 1 for p in prompts]
    packs = pack_sequences(seqs, firsts)
    assert sorted([pk.trunk for pk in packs] + [b.seq for pk in packs for b in pk.branches]) == list(range(len(seqs)))
    assert len(packs) < len(seqs) - 3  # the four shorter histories ride on the longest one
    for pk in packs:
        for b in pk.branches:
            assert b.shared <= firsts[b.seq] and seqs[b.seq][:b.shared] == seqs[pk.trunk][:b.shared]
    got = answer_probability(model, tok, prompts, answers, batch_size=2, packed=True)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        prob, mean = _reference(model, tok, p, a)
        assert got.mean_logprob[i].item() == pytest.approx(mean, abs=1e-5)
        assert got.prob[i].item() == pytest.approx(prob, abs=1e-5)
        assert got.n_tokens[i].item() == len(tok.encode(a, add_special_tokens=False))


def test_memory_reward_uses_question_and_memory_only(tiny_lm):
    from mempo.agent.format import (
        ANSWER_PROBE_PREFIX,
        answer_continuation,
        answer_probe_messages,
        render_prompt,
    )

    model, tok = tiny_lm
    turns = [
        MemoryTurn("r1", 0, "Who is the mayor of Gristead?", "Nothing found yet.", "Shainbrae Tivgroux"),
        MemoryTurn("r1", 1, "Who is the mayor of Gristead?", "The mayor of Gristead is Shainbrae Tivgroux.",
                   "Shainbrae Tivgroux"),
        MemoryTurn("r2", 0, "Who is the mayor of Gristead?", None, "Shainbrae Tivgroux"),
    ]
    probs = [
        answer_probability(model, tok, [render_prompt(tok, answer_probe_messages(t.question, t.memory),
                                                      ANSWER_PROBE_PREFIX)],
                           [answer_continuation(t.answer)]).prob[0].item()
        for t in turns
    ]
    r = memory_reward(model, tok, turns, eps="previous", form="prob")
    assert r.tolist() == pytest.approx([probs[0], probs[1] - probs[0], probs[2]], abs=1e-5)
    r_none = memory_reward(model, tok, turns, eps="none", form="logprob")
    assert r_none.tolist() == pytest.approx([math.log(p) for p in probs], abs=1e-4)
    with pytest.raises(ValueError, match="full_context_prompt"):
        memory_reward(model, tok, turns, eps="full_context")


def test_memory_advantage_std_floor_keeps_noise_out_and_signal_in() -> None:
    from mempo.advantage import memory_advantage

    groups, turns = ["a", "a", "a", "a"], [0, 0, 0, 0]
    noise = [1e-5, 2e-5, 0.5e-5, 1.5e-5]  # a policy that never finds the answer
    raw = memory_advantage(noise, groups, turns)
    floored = memory_advantage(noise, groups, turns, min_std=0.01)
    assert float(raw.abs().max()) > 0.5            # unit-size advantages out of noise
    assert float(floored.abs().max()) < 2e-3       # ... which the floor removes
    signal = [0.1, 0.6, 0.3, 0.9]                  # real differences: std 0.35 > floor, unchanged
    assert memory_advantage(signal, groups, turns, min_std=0.01).allclose(memory_advantage(signal, groups, turns))
