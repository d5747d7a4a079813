"""`<mem>` token masks align with the decoded memory span for real tokenizers: a plain
byte-level BPE (tags split into pieces, as in SmolLM2/Qwen) and the project's tiny-policy
tokenizer (tags as whole added tokens), including non-canonical token sequences."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_agent_helpers import build_bpe_tokenizer

from mempo.agent.format import TAGS, parse_turn
from mempo.agent.masks import check_mem_mask, masked_text, span_token_mask, token_char_offsets
from mempo.policy.tiny import train_tiny_tokenizer

TEXTS = [
    "Gaki Baizound was born in Quaevzawick. The mayor of Quaevzawick is Caenwo Shusdrioth.",
    "Liol Shusdrioth works for Raenzial Foundry, founded by Laithsy Tivgroux in 1901.",
    "Nothing found yet. Next I need the birth city of Pus Jourkwirk.",
] * 10


@pytest.fixture(scope="module", params=["plain_bpe", "tiny_policy"])
def tokenizer(request):
    if request.param == "plain_bpe":
        return build_bpe_tokenizer(TEXTS, vocab_size=400)
    return train_tiny_tokenizer(iter(TEXTS), TAGS, vocab_size=400)


_memory_text = st.lists(
    st.sampled_from(list("abcXYZ019 .,;'-éü中\n") + [" the ", " Quaevzawick", " was born in ", "  "]),
    max_size=25,
).map("".join)


def _check(tok, ids, memory):
    text = tok.decode(ids, skip_special_tokens=True)
    parsed = parse_turn(text)
    assert parsed.mem == memory.strip()
    mask = span_token_mask(ids, tok, parsed.mem_span)
    check_mem_mask(ids, tok, mask, parsed.mem)
    if parsed.mem:
        assert memory.strip() in masked_text(ids, tok, mask)
        # nothing after </mem> is masked
        offs = token_char_offsets(ids, tok)
        close = text.index("</mem>")
        assert all(not m or a < close for m, (a, _) in zip(mask, offs, strict=True))
    return mask


@settings(max_examples=60, deadline=None)
@given(memory=_memory_text, query=_memory_text)
@example(memory="é", query="")  # a multi-byte character split over byte-level tokens
@example(memory=" 中 ü. ", query="x")
def test_mask_aligns_with_decoded_memory(tokenizer, memory, query):
    text = f"<mem>{memory}</mem> <think> next </think> <search> {query or 'q'} </search>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    _check(tokenizer, ids, memory)


@settings(max_examples=40, deadline=None)
@given(memory=_memory_text)
@example(memory="é中")
def test_mask_on_non_canonical_token_sequences(tokenizer, memory):
    # A sampler can produce token sequences the tokenizer would never produce from the text:
    # encode pieces separately and concatenate.
    pieces = ["<mem>", f" {memory}", " </mem>", " <answer>", " x", " </answer>"]
    ids = [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)]
    eos = tokenizer.eos_token_id
    _check(tokenizer, ids + [eos], memory)


def test_check_mem_mask_rejects_a_wrong_span(tokenizer):
    text = "<mem> Quaevzawick was born </mem> <answer> x </answer>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    parsed = parse_turn(text)
    wrong = span_token_mask(ids, tokenizer, (text.index("<answer>"), len(text)))
    with pytest.raises(ValueError):
        check_mem_mask(ids, tokenizer, wrong, parsed.mem)
    with pytest.raises(ValueError):
        check_mem_mask(ids, tokenizer, [0] * len(ids), parsed.mem)
    assert span_token_mask(ids, tokenizer, None) == [0] * len(ids)
