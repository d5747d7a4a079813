"""The external-memory baseline's store and prompts, and the single-turn baselines' parsing."""

from __future__ import annotations

import numpy as np
import pytest

from mempo.agent.format import ANSWER_PROBE_PREFIX, parse_turn
from mempo.evaluation.agents import (
    ExternalMemoryContext,
    forced_answer_text,
    observation_snippets,
    observation_titles,
    single_turn_messages,
)
from mempo.evaluation.vector_store import EpisodeVectorStore, HashingEncoder

OBS1 = ("<information> Doc 1(Title: Syndkindale) Syndkindale is a city in Stutraixonia. Its mayor is Zha Traiwur.\n"
        "Doc 2(Title: Greithain Tivgroux) Greithain Tivgroux was born in Syndkindale in 1931. </information>")
OBS2 = ("<information> Doc 1(Title: Remdrer Fiarhaeth) Remdrer Fiarhaeth works for Quaevzawick.\n"
        "Doc 2(Title: Quaevzawick) Quaevzawick was founded by Thys Dreindreilvaix. </information>")


def test_observation_snippets_and_titles() -> None:
    assert observation_snippets(OBS1) == [
        "(Title: Syndkindale) Syndkindale is a city in Stutraixonia. Its mayor is Zha Traiwur.",
        "(Title: Greithain Tivgroux) Greithain Tivgroux was born in Syndkindale in 1931.",
    ]
    assert observation_titles(OBS2) == ["Remdrer Fiarhaeth", "Quaevzawick"]
    assert observation_snippets(None) == [] and observation_snippets("<information> No results. </information>") == ["No results."]


def test_hashing_encoder_is_deterministic_unit_and_lexical() -> None:
    enc = HashingEncoder(dim=256)
    a, b, c = enc.encode(["mayor of Syndkindale", "Syndkindale mayor is Zha Traiwur", "Quaevzawick founder"])
    assert np.allclose(np.linalg.norm([a, b, c], axis=1), 1.0)
    assert float(a @ b) > float(a @ c)
    assert np.array_equal(enc.encode(["mayor of Syndkindale"])[0], a)


def test_episode_store_recalls_most_similar_and_skips_duplicates_and_excluded() -> None:
    store = EpisodeVectorStore(HashingEncoder())
    assert store.add(observation_snippets(OBS1)) == 2
    assert store.add(observation_snippets(OBS1)) == 0          # exact repeats stored once
    store.add(observation_snippets(OBS2))
    assert len(store) == 4
    top = store.top("who is the mayor of Syndkindale", k=1)
    assert top == ["(Title: Syndkindale) Syndkindale is a city in Stutraixonia. Its mayor is Zha Traiwur."]
    assert top[0] not in store.top("mayor of Syndkindale", k=2, exclude=top)
    assert store.top("anything", k=0) == [] and EpisodeVectorStore(HashingEncoder()).top("x", 3) == []


def _turn(text: str):  # noqa: ANN202 - a ParsedTurn
    return parse_turn(text)


def test_external_memory_prompt_holds_question_last_result_and_recalled_snippets_only() -> None:
    ctx = ExternalMemoryContext("Who is the mayor of the city where Greithain Tivgroux was born?",
                                HashingEncoder(), n_snippets=1)
    first = ctx.messages()
    assert len(first) == 2 and "Your memory" not in first[1]["content"]
    t1 = "<mem> MODEL MEMORY ONE </mem> <think> t </think> <search> Greithain Tivgroux born </search>"
    ctx.record_turn(t1, _turn(t1), OBS1)
    user = ctx.messages()[1]["content"]
    # Turn 2: nothing earlier than the last result yet; the model's own <mem> is never shown.
    assert "MODEL MEMORY ONE" not in user and "Greithain Tivgroux was born in Syndkindale" in user
    assert "<search> Greithain Tivgroux born </search>" in user
    t2 = "<mem> MODEL MEMORY TWO </mem> <think> t </think> <search> Syndkindale mayor </search>"
    ctx.record_turn(t2, _turn(t2), OBS2)
    user = ctx.messages()[1]["content"]
    memory_part = user.split("<mem>", 1)[1].split("</mem>", 1)[0]
    # The snippet most similar to the latest query ("Syndkindale mayor") from the earlier result.
    assert memory_part.strip() == "(Title: Syndkindale) Syndkindale is a city in Stutraixonia. Its mayor is Zha Traiwur."
    assert "Thys Dreindreilvaix" in user.split("</mem>", 1)[1]       # the last result, in full
    assert "MODEL MEMORY" not in user


def test_single_turn_layouts_and_forced_answer_parsing() -> None:
    direct = single_turn_messages("Q?", None)
    rag = single_turn_messages("Q?", OBS1)
    assert "<information>" not in direct[1]["content"]
    assert "<search> Q? </search>" in rag[1]["content"] and "Zha Traiwur" in rag[1]["content"]
    assert forced_answer_text(" Zha Traiwur </answer>") == ("Zha Traiwur", True)
    assert forced_answer_text(" Zha Traiwur and more") == ("Zha Traiwur and more", False)
    assert forced_answer_text(" Zha <search> q </search>") == ("Zha", False)


@pytest.mark.slow  # loading sentence-transformers takes 10-60 s on the shared CPUs
def test_sentence_encoder_option_uses_the_retrieval_encoder_and_memoises() -> None:
    from mempo.evaluation.vector_store import make_encoder

    enc = make_encoder("all-MiniLM-L6-v2")
    vecs = enc.encode(["Syndkindale mayor", "The mayor of Syndkindale is Zha Traiwur.", "Syndkindale mayor"])
    assert vecs.shape == (3, enc.dim) and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    assert np.array_equal(vecs[0], vecs[2])
    store = EpisodeVectorStore(enc)
    store.add(observation_snippets(OBS1) + observation_snippets(OBS2))
    assert store.top("who founded Quaevzawick", 1) == ["(Title: Quaevzawick) Quaevzawick was founded by Thys Dreindreilvaix."]


def test_forced_answer_prefix_keeps_the_turns_own_memory_and_reasoning() -> None:
    from mempo.evaluation.agents import forced_answer_prefix

    searched = _turn("<mem> Answer 1: Paris. </mem> <think> need 2 </think> <search> q </search>")
    prefix = forced_answer_prefix(searched)
    assert prefix == "<mem> Answer 1: Paris. </mem> <think> need 2 </think> " + ANSWER_PROBE_PREFIX
    done = parse_turn(prefix + " Paris; 1900 </answer>")
    assert done.valid and done.action == "answer" and done.argument == "Paris; 1900"
    assert forced_answer_prefix(_turn("garbage")) == "<mem>  </mem> " + ANSWER_PROBE_PREFIX
