"""Turn format: the parser (never raises), prompts, observations, and the context builders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo.agent.context import FullContext, MemoryContext, make_context
from mempo.agent.format import (
    INFO_OPEN,
    STOP_SEQUENCES,
    SYSTEM_PROMPT,
    TAGS,
    build_messages,
    format_observation,
    invalid_turn_observation,
    parse_turn,
    truncate_tokens,
)


def test_tags_and_stops():
    assert TAGS == ["<mem>", "</mem>", "<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>",
                    "<access>", "</access>", "<information>", "</information>"]
    assert STOP_SEQUENCES == ["</search>", "</answer>", "</access>"]


@pytest.mark.parametrize("text, action, argument, valid", [
    ("<mem> A was born in B. </mem> <think> next </think> <search> B mayor </search>", "search", "B mayor", True),
    ("<mem>m</mem><answer> x; y </answer>", "answer", "x; y", True),  # think is optional
    ("  <mem> m </mem>\n<think> t </think>\n<access> Gristead </access>\n", "access", "Gristead", True),
    ("<mem> m </mem> <answer> x </answer> trailing words", "answer", "x", False),
    ("<think> t </think> <search> q </search>", "search", "q", False),  # no memory
    ("preamble <mem> m </mem> <search> q </search>", "search", "q", False),
    ("<mem> m </mem> <search> q </search> <answer> a </answer>", "search", "q", False),  # two actions
    ("<mem> m </mem> <search>   </search>", "search", "", False),
    ("<mem> m </mem> <search> q", None, None, False),  # unclosed
    ("<mem> m </mem> <information> x </information> <answer> a </answer>", "answer", "a", False),
    ("<mem> m </mem> <search> q </search> <mem> again </mem>", "search", "q", False),
    ("", None, None, False),
])
def test_parse_turn_cases(text, action, argument, valid):
    t = parse_turn(text)
    assert (t.action, t.argument, t.valid) == (action, argument, valid)
    assert (t.error == "") == valid


def test_parse_turn_mem_span_points_at_memory():
    text = "<mem>  keep this fact </mem> <search> q </search>"
    t = parse_turn(text)
    s, e = t.mem_span
    assert text[s:e].strip() == t.mem == "keep this fact"


_tag_soup = st.lists(st.one_of(st.sampled_from(TAGS + ["<", ">", "/", " ", "\n"]), st.text(max_size=8)), max_size=30)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(), _tag_soup.map("".join)))
def test_parser_never_raises(text):
    t = parse_turn(text)
    assert isinstance(t.valid, bool)
    assert t.valid == (t.error == "")
    if t.valid:
        assert t.action in ("search", "answer", "access") and t.argument and t.mem is not None


def test_messages_and_observations():
    first = build_messages("Who founded X?")
    assert first == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Question: Who founded X?"}]
    later = build_messages("Q?", memory="m1", last_action="<search> q </search>",
                           last_observation=format_observation("Doc 1(Title: A) text"))
    assert "<mem> m1 </mem>" in later[1]["content"]
    assert later[1]["content"].endswith("<information> Doc 1(Title: A) text </information>")
    assert truncate_tokens("a b c d e", None, 3) == "a b c ..."
    assert format_observation("a b c d e", None, 2) == "<information> a b ... </information>"
    assert invalid_turn_observation("no <mem> ... </mem>").startswith(INFO_OPEN)


def _turn(i: int) -> str:
    return f"<mem> MEMORY-{i}. </mem> <think> THINK-{i}. </think> <search> QUERY-{i}. </search>"


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.booleans())
def test_memory_context_never_contains_turns_before_t_minus_1(n_turns, with_bad_turn):
    ctx = MemoryContext("the question")
    full = FullContext("the question")
    for i in range(n_turns):
        text = _turn(i) if not (with_bad_turn and i == n_turns - 1) else f"QUERY-{i}. without tags"
        obs = f"<information> OBS-{i}. </information>"
        ctx.record_turn(text, parse_turn(text), obs)
        full.record_turn(text, parse_turn(text), obs)
    prompt = "\n".join(m["content"] for m in ctx.messages())
    last = n_turns - 1
    for i in range(last):
        for piece in (f"MEMORY-{i}.", f"THINK-{i}.", f"QUERY-{i}.", f"OBS-{i}."):
            assert piece not in prompt
    assert f"OBS-{last}." in prompt
    if not with_bad_turn:
        assert f"MEMORY-{last}." in prompt and f"QUERY-{last}." in prompt
        assert f"THINK-{last}." not in prompt  # reasoning is never carried over
    else:
        assert "<mem>  </mem>" in prompt  # a forgotten memory is not repaired from older turns
    # the full-history baseline keeps everything
    full_prompt = "\n".join(m["content"] for m in full.messages())
    assert all(f"OBS-{i}." in full_prompt for i in range(n_turns))


def test_full_context_short_observations_once_not_last():
    full = make_context("full", "q")
    t = _turn(0)
    full.record_turn(t, parse_turn(t), "<information> LONG CHUNK </information>", "<information> SHORT </information>")
    assert "LONG CHUNK" in full.messages()[-1]["content"]
    full.record_turn(_turn(1), parse_turn(_turn(1)), "<information> next </information>")
    contents = [m["content"] for m in full.messages()]
    assert "<information> SHORT </information>" in contents and not any("LONG CHUNK" in c for c in contents)
    assert [m["role"] for m in full.messages()] == ["system", "user", "assistant", "user", "assistant", "user"]
    with pytest.raises(ValueError):
        make_context("other", "q")  # type: ignore[arg-type]
