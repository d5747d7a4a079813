"""Rewards: the one answer normaliser, EM / substring / F1, multi-objective scoring, R^T and
verl's compute_score, with worked examples."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo.rewards import (
    answer_correctness,
    compute_score,
    episode_format_valid,
    episode_score,
    exact_match,
    multi_objective_scores,
    normalize_answer,
    objective_answers,
    outcome_reward,
    substring_match,
    token_f1,
)


@pytest.mark.parametrize("raw, norm", [
    ("The  Eiffel-Tower!", "eiffeltower"),  # punctuation is deleted, not made a space
    ("  An apple a day ", "apple day"),
    ("Thebes", "thebes"),  # "the" only as a whole word
    ("1,337,000", "1337000"),
    ("U.S.", "us"),
    ("O'Keefe", "okeefe"),
    ("", ""),
])
def test_normalize_answer_is_the_standard_one(raw, norm):
    assert normalize_answer(raw) == norm


@pytest.mark.parametrize("raw, norm", [
    ("The  Eiffel-Tower!", "eiffel tower"),
    ("1,337,000", "1 337 000"),
    ("O'Keefe", "o keefe"),
])
def test_punctuation_to_space_is_an_option(raw, norm):
    assert normalize_answer(raw, punct="space") == norm
    with pytest.raises(ValueError, match="punctuation rule"):
        normalize_answer(raw, punct="drop")  # type: ignore[arg-type]


@pytest.mark.parametrize("pred, gold", [("US", "U.S."), ("1000", "1,000"), ("OKeefe", "O'Keefe")])
def test_examples_that_score_in_every_paper_score_here(pred, gold):
    # The examples: EM 0 under the old punctuation-to-space rule, 1 under the standard.
    assert exact_match(pred, [gold]) == 1.0
    assert substring_match(pred, [gold]) == 1.0
    assert token_f1(pred, [gold]) == 1.0
    assert exact_match(pred, [gold], punct="space") == 0.0


def test_exact_substring_and_f1():
    assert exact_match("the Eiffel Tower", ["Louvre", "Eiffel Tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel Tower"]) == 0.0
    assert exact_match(None, ["x"]) == 0.0
    assert substring_match("It is the Eiffel Tower.", ["eiffel tower"]) == 1.0
    assert substring_match("Eiffel Towers", ["eiffel tower"]) == 1.0  # a plain substring (FlashRAG, Search-R1)
    assert substring_match("Eiffel", ["eiffel tower"]) == 0.0
    # "Eiffel Tower Paris" vs "Eiffel Tower": P = 2/3, R = 1 -> F1 = 0.8
    assert token_f1("Eiffel Tower Paris", ["Eiffel Tower"]) == pytest.approx(0.8)
    assert token_f1("London", ["Eiffel Tower", "London"]) == 1.0
    assert token_f1("", ["x"]) == 0.0


@pytest.mark.parametrize("pred, golds, f1", [
    # "the cat sat on a mat" -> [cat, sat, on, mat]; gold "cat on mat" -> [cat, on, mat]:
    # common 3, P = 3/4, R = 3/3, F1 = 2 * 0.75 * 1 / 1.75 = 6/7
    ("the cat sat on a mat", ["cat on mat"], 6 / 7),
    # "new york city" vs "New York": common 2, P = 2/3, R = 1 -> 0.8; vs "NYC": 0 -> max 0.8
    ("new york city", ["NYC", "New York"], 0.8),
    # repeated tokens count with multiplicity: "x x y" vs "x y y": common = min(2,1) +
    # min(1,2) = 2, P = R = 2/3 -> 2/3
    ("x x y", ["x y y"], 2 / 3),
    # yes / no / noanswer only match themselves
    ("no", ["no idea"], 0.0),
    ("yes and no", ["yes"], 0.0),
    ("Yes.", ["yes"], 1.0),
    ("noanswer", ["no answer"], 0.0),
    # an empty prediction or gold scores 0
    ("", [""], 0.0),
    ("!!!", ["Paris"], 0.0),
])
def test_token_f1_hand_worked(pred, golds, f1):
    assert token_f1(pred, golds) == pytest.approx(f1)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab .,'-!Th e")), max_size=12),
       st.lists(st.text(alphabet=st.sampled_from(list("ab .,'-!Th e")), min_size=1, max_size=12),
                min_size=1, max_size=3))
def test_em_and_substring_em_equal_search_r1s_own_scorer(pred, golds):
    # verl ships Search-R1's scorer (verl.utils.reward_score.search_r1_like_qa_em): ours must agree.
    from verl.utils.reward_score.search_r1_like_qa_em import em_check, subem_check
    from verl.utils.reward_score.search_r1_like_qa_em import normalize_answer as r1_norm

    assert normalize_answer(pred) == r1_norm(pred)
    assert exact_match(pred, golds) == float(em_check(pred, golds))
    assert substring_match(pred, golds) == float(subem_check(pred, golds))


def test_multi_objective_scores():
    s = multi_objective_scores("Paris; 1900", ["Paris", ["1901", "1900"]])
    assert (s.per_objective, s.mean, s.all_correct) == ([1.0, 1.0], 1.0, 1.0)
    s = multi_objective_scores("Paris; 1899; extra", ["Paris", "1900", "Rome"])
    assert s.per_objective == [1.0, 0.0, 0.0]
    assert s.mean == pytest.approx(1 / 3)
    assert (s.score("all"), s.score("any")) == (0.0, 1.0)
    assert multi_objective_scores(None, ["a"]).per_objective == [0.0]


def test_mean_k_pays_partial_credit_only_for_one_part_per_objective():
    objs = ["Paris", "1900", "Rome", "Oslo"]
    two_right_of_four = multi_objective_scores("Paris; 1900; Lyon; Bergen", objs)
    assert two_right_of_four.parts == 4
    assert two_right_of_four.score("mean_k") == two_right_of_four.score("mean") == 0.5
    dropped = multi_objective_scores("Paris; 1900", objs)  # the same two right, two objectives dropped
    assert (dropped.parts, dropped.score("mean"), dropped.score("mean_k")) == (2, 0.5, 0.0)
    extra = multi_objective_scores("Paris; 1900; Rome; Oslo; Bern", objs)  # one part too many
    assert (extra.score("all"), extra.score("mean"), extra.score("mean_k")) == (1.0, 1.0, 0.0)
    assert multi_objective_scores(None, objs).score("mean_k") == 0.0
    assert answer_correctness("Paris; 1900", ["x"], [["Paris"], ["1900"], ["Rome"]], multi_rule="mean_k") == 0.0
    assert compute_score("world", "<mem> m </mem> <answer> Paris; 1901 </answer>", ["Paris; 1900"],
                         multi_rule="mean_k") == 0.5
    with pytest.raises(ValueError, match="mean_k"):
        dropped.score("median")  # type: ignore[arg-type]


def test_objective_answers_and_correctness_rules():
    assert objective_answers(["a; b"]) == [["a"], ["b"]]
    meta = {"metadata": {"objectives": [{"golden_answers": ["x", "ex"]}, {"golden_answers": ["y"]}]}}
    assert objective_answers(["x; y"], meta) == [["x", "ex"], ["y"]]
    assert answer_correctness("ex; nope", ["x; y"], [["x", "ex"], ["y"]], multi_rule="mean") == 0.5
    assert answer_correctness("ex; nope", ["x; y"], [["x", "ex"], ["y"]], multi_rule="all") == 0.0
    assert answer_correctness("ex; y", ["x; y"], [["x", "ex"], ["y"]]) == 1.0


def test_no_answer_penalty_scores_an_unanswered_episode_below_a_wrong_answer():
    # default 0: no answer and a wrong answer score the same (MemPO's R^T)
    assert outcome_reward(None, ["Paris"], format_valid=False) == 0.0
    for rule in ("strict", "penalty", "ignore"):
        assert outcome_reward(None, ["Paris"], False, format_rule=rule, format_penalty=0.2,
                              no_answer_penalty=0.5) == pytest.approx(-0.5)
    # an answer, right or wrong, is untouched by it
    assert outcome_reward("Rome", ["Paris"], True, no_answer_penalty=0.5) == 0.0
    assert outcome_reward("Paris", ["Paris"], True, no_answer_penalty=0.5) == 1.0
    assert outcome_reward("Paris; Rome", ["Paris; Rome"], True, no_answer_penalty=0.5) == 1.0
    # verl's reward kwargs reach it, from structured fields and from a decoded transcript
    assert episode_score(None, False, ["Paris"], no_answer_penalty=0.25) == pytest.approx(-0.25)
    assert episode_score("Rome", True, ["Paris"], no_answer_penalty=0.25) == 0.0
    searching = "<mem> looking </mem> <search> Paris </search> <information> x </information>"
    assert compute_score("world", searching, ["Paris"], no_answer_penalty=0.25) == pytest.approx(-0.25)
    assert compute_score("world", searching, ["Paris"]) == 0.0


def test_outcome_reward_format_rules():
    # correct but an invalid turn: strict -> 0, penalty 0.2 -> 0.8, ignore -> 1
    assert outcome_reward("Paris", ["Paris"], format_valid=True) == 1.0
    assert outcome_reward("Paris", ["Paris"], format_valid=False) == 0.0
    assert outcome_reward("Paris", ["Paris"], False, format_rule="penalty", format_penalty=0.2) == pytest.approx(0.8)
    assert outcome_reward("Rome", ["Paris"], False, format_rule="penalty", format_penalty=0.2) == pytest.approx(-0.2)
    assert outcome_reward("Paris", ["Paris"], False, format_rule="ignore") == 1.0
    assert outcome_reward("Rome", ["Paris"], True) == 0.0


def test_episode_format_and_compute_score():
    good = ["<mem> m </mem> <think> t </think> <search> q </search>", "<mem> m2 </mem> <answer> Paris </answer>"]
    assert episode_format_valid(good)
    assert not episode_format_valid(good[:1])  # never answered
    assert not episode_format_valid(["<search> q </search>", good[1]])  # first turn has no memory
    trajectory = good[0] + " <information> Doc 1(Title: P) Paris is ... </information> " + good[1]
    assert compute_score("world", trajectory, ["Paris"]) == 1.0
    assert compute_score("world", trajectory, {"target": ["Rome"]}) == 0.0
    assert compute_score("world", "<answer> Paris </answer>", ["Paris"]) == 0.0  # no memory: invalid
    assert compute_score("world", "<answer> Paris </answer>", ["Paris"], format_rule="ignore") == 1.0
    multi = "<mem> a </mem> <answer> Paris; 1900 </answer>"
    assert compute_score("world", multi, ["Paris; 1900"]) == 1.0
    assert compute_score("world", "<mem> a </mem> <answer> Paris; 1901 </answer>", ["Paris; 1900"],
                         multi_rule="mean") == 0.5


@settings(max_examples=200, deadline=None)
@given(st.text(), st.lists(st.text(min_size=1), min_size=1, max_size=3))
def test_scores_are_bounded_and_compute_score_never_raises(text, golds):
    for f in (exact_match, substring_match, token_f1):
        assert 0.0 <= f(text, golds) <= 1.0
    assert compute_score("x", text, golds) in (0.0, 1.0)
    assert exact_match(text, [text]) == 1.0


def test_compute_score_with_verl_parquet_values():
    # verl hands parquet columns over as numpy arrays; objectives come from extra_info
    import numpy as np

    extra = {"objectives": [{"golden_answers": np.array(["Paris", "City of Paris"])},
                            {"golden_answers": np.array(["1900"])}]}
    text = "<mem> m </mem> <answer> city of paris; 1900 </answer>"
    assert compute_score("world", text, {"target": np.array(["Paris; 1900"])}, extra) == 1.0
    assert compute_score("world", text, {"target": np.array(["Paris; 1900"])}) == 0.0  # no aliases known
