"""Forgetting rate on hand-built transcripts (mempo.forgetting) and the paper's memory-reward
defaults."""

from __future__ import annotations

import pytest

from mempo.forgetting import (
    FATES,
    SEEN,
    MemoryStep,
    episode_forgot,
    forgetting_rate,
    objective_fates,
    objective_forgotten,
)

OBJ = [["Paris", "City of Paris"], ["1900"]]


def test_keeping_every_answer_until_the_end_is_not_forgetting():
    steps = [
        MemoryStep("Nothing found yet.", "<information> Doc 1(Title: X) X was born in Paris. </information>"),
        MemoryStep("Answer 1: Paris.", "<information> Doc 1(Title: Y) Y was founded in 1900. </information>"),
        MemoryStep("Answer 1: Paris. Answer 2: 1900.", None),
    ]
    assert objective_forgotten(OBJ, steps) == [False, False]
    assert not episode_forgot(OBJ, steps)


def test_an_answer_seen_in_an_observation_and_missing_from_a_later_memory_is_forgotten():
    steps = [
        MemoryStep("Nothing found yet.", "... born in Paris ..."),
        MemoryStep("Answer 1: Paris.", "... founded in 1900 ..."),
        MemoryStep("Answer 2: 1900.", None),  # dropped Paris before answering
    ]
    assert objective_forgotten(OBJ, steps) == [True, False]
    assert episode_forgot(OBJ, steps)


def test_seen_but_never_memorised_counts_only_under_the_seen_rule_and_aliases_count_as_kept():
    # Paris is in the observation of turn 0; the memory of turn 1 never holds it.
    steps = [MemoryStep("nothing", "born in Paris"), MemoryStep("searching 1900", None)]
    assert objective_forgotten(OBJ, steps) == [False, False]  # never stored, so not forgotten
    assert objective_forgotten(OBJ, steps, SEEN) == [True, False]
    # an accepted alias keeps the objective; the timing rule: turn 0's memory is written
    # before its observation, so it is not checked
    steps = [MemoryStep("nothing", "born in Paris"), MemoryStep("It is the City of Paris", None)]
    assert objective_forgotten(OBJ, steps, SEEN) == [False, False]


def test_a_turn_without_memory_loses_what_was_kept_and_words_must_match_whole():
    steps = [MemoryStep("Answer 1: Paris.", None), MemoryStep(None, None), MemoryStep("Answer 1: Paris.", None)]
    assert objective_forgotten(OBJ, steps) == [True, False]
    # "Parisian" does not contain the answer "Paris"; the answer never appeared at all
    steps = [MemoryStep("a Parisian cafe", "Parisian"), MemoryStep("none", None)]
    assert objective_forgotten(OBJ, steps) == [False, False]


def test_the_last_memory_counts_and_an_answer_seen_only_at_the_end_does_not():
    steps = [MemoryStep("Answer 1: Paris.", "1900"), MemoryStep("Answer 2: 1900.", None)]
    assert objective_forgotten(OBJ, steps, SEEN) == [True, False]
    steps = [MemoryStep("x", None), MemoryStep("y", "Paris 1900")]  # seen after the last memory
    assert objective_forgotten(OBJ, steps, SEEN) == [False, False]


def test_rate_is_over_multi_objective_episodes_only():
    kept = [MemoryStep("Paris 1900", None), MemoryStep("Paris 1900", None)]
    lost = [MemoryStep("Paris", None), MemoryStep("1900", None)]
    single = ([["Paris"]], [MemoryStep("Paris", None), MemoryStep("gone", None)])
    assert forgetting_rate([(OBJ, kept), (OBJ, lost), single]) == 0.5
    assert forgetting_rate([single]) is None
    seen_only = [MemoryStep("x", "Paris"), MemoryStep("1900", None)]
    assert forgetting_rate([(OBJ, kept), (OBJ, seen_only)]) == 0.0
    assert forgetting_rate([(OBJ, kept), (OBJ, seen_only)], SEEN) == 0.5


def test_each_objectives_fate_follows_its_answer_from_retrieval_to_the_last_memory():
    objs = [["Paris", "City of Paris"], ["1900"], ["Rome"], ["Oslo"], ["Lima"]]
    steps = [
        MemoryStep("Nothing yet.", "... born in Paris ... visited Rome ... met in Oslo ..."),
        MemoryStep("Answer 1: City of Paris. Answer 4: Oslo.", "... in 1901 ..."),
        MemoryStep("Answer 1: Paris.", None),  # Oslo dropped; Rome never written; 1900, Lima never shown
    ]
    assert objective_fates(objs, steps, [1.0, 0.0, 0.0, 0.0, 0.0]) == [
        "right", "never retrieved", "retrieved, never in a memory", "in a memory, then dropped", "never retrieved"]
    # held in the last memory and still answered wrong; a right answer is right whatever the memory
    assert objective_fates(objs[:2], steps, [0.0, 1.0]) == ["in the last memory, answered wrong", "right"]
    assert set(objective_fates(objs, steps, [0] * 5)) <= set(FATES)


def test_a_last_turn_without_memory_has_dropped_what_it_held_and_scores_must_match_objectives():
    steps = [MemoryStep("Answer 1: Paris.", "... 1900 ..."), MemoryStep(None, None)]
    assert objective_fates(OBJ, steps, [0.0, 0.0]) == ["in a memory, then dropped", "retrieved, never in a memory"]
    with pytest.raises(ValueError, match="1 objective scores for 2 objectives"):
        objective_fates(OBJ, steps, [1.0])


def test_memory_reward_defaults_are_the_methods():
    # R^M = mean log P(a*|q, mem_t) - mean log P(a*|q, full history): eps full_context, form logprob,
    # in the params models, the repository's params.yaml and the verl overlay.
    from pathlib import Path

    import yaml

    from mempo.config import MempoParams, load_params
    from mempo.verl_plugin.advantage import MempoAdvantageConfig

    root = Path(__file__).resolve().parents[1]
    for p in (MempoParams(), load_params(root / "params.yaml").mempo, MempoAdvantageConfig()):
        assert (p.eps, p.form) == ("full_context", "logprob")
    overlay = yaml.safe_load((root / "configs" / "verl" / "mempo_trainer.yaml").read_text())["mempo"]
    assert (overlay["eps"], overlay["form"]) == ("full_context", "logprob")
