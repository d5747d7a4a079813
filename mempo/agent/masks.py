"""Token masks over generated responses: which generated tokens hold the `<mem>` text.

Masks are computed on the GENERATED token ids (never on a re-tokenisation), from the
character offsets of each token in the decoded response.

    offsets = token_char_offsets(ids, tokenizer)         # [(start, end)] per token
    mask = span_token_mask(ids, tokenizer, (s, e))        # 1 where a token overlaps [s, e)
    check_mem_mask(ids, tokenizer, mask, memory)           # raises if the span is wrong
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mempo.agent.format import MEM_CLOSE, MEM_OPEN


def token_char_offsets(token_ids: Sequence[int], tokenizer: Any) -> list[tuple[int, int]]:
    """Character span of each token in `tokenizer.decode(token_ids, skip_special_tokens=True)`.

    Fast path: decode each token alone and add up lengths when that reproduces the full
    decoding. Otherwise (byte-level pieces of a multi-byte character, tokenizers that
    clean up spaces) decode growing prefixes, so a token's span is what it adds to the
    prefix text; a token ending inside a multi-byte character also covers that character
    (spans of neighbours may then overlap by one). Special tokens get an empty span.
    """
    ids = list(token_ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in ids]
    if "".join(pieces) == full:
        out, pos = [], 0
        for p in pieces:
            out.append((pos, pos + len(p)))
            pos += len(p)
        return out
    # Slow path: a token's span is what it adds to the part of the prefix decoding that
    # agrees with the full decoding. A token that ends inside a multi-byte character (its
    # prefix decodes to a trailing U+FFFD) also covers that next character, so a mask over
    # the character includes every token holding one of its bytes.
    out, prev = [], 0
    for k in range(1, len(ids) + 1):
        dec = tokenizer.decode(ids[:k], skip_special_tokens=True)
        c = prev
        limit = min(len(dec), len(full))
        while c < limit and dec[c] == full[c]:
            c += 1
        partial = len(dec) > c and c < len(full)
        out.append((prev, c + 1 if partial else c))
        prev = c
    return out


def span_token_mask(
    token_ids: Sequence[int], tokenizer: Any, char_span: tuple[int, int] | None,
    offsets: list[tuple[int, int]] | None = None,
) -> list[int]:
    """1 for each token whose characters overlap `[start, end)` of the decoded text, else 0.

    Tokens that straddle the span's edges are included (a token holding " Paris" at the
    start of a memory counts as memory). `char_span=None` gives all zeros.
    """
    if char_span is None:
        return [0] * len(token_ids)
    s, e = char_span
    offs = offsets if offsets is not None else token_char_offsets(token_ids, tokenizer)
    if e <= s:
        return [0] * len(token_ids)
    return [1 if (a < e and b > s) else 0 for a, b in offs]


def masked_text(token_ids: Sequence[int], tokenizer: Any, mask: Sequence[int]) -> str:
    """Decode only the masked tokens (they must be contiguous; returns "" for an empty mask)."""
    idx = [i for i, m in enumerate(mask) if m]
    if not idx:
        return ""
    if idx != list(range(idx[0], idx[-1] + 1)):
        raise ValueError("mask is not contiguous")
    return tokenizer.decode(list(token_ids)[idx[0]:idx[-1] + 1], skip_special_tokens=True)


def check_mem_mask(token_ids: Sequence[int], tokenizer: Any, mask: Sequence[int], memory: str | None) -> None:
    """Raise ValueError unless the masked tokens decode to the memory text.

    The decoded span must contain the (stripped) memory, and whatever else it holds must be
    whitespace or pieces of the `<mem>` / `</mem>` tags (from tokens straddling the edges).
    """
    if memory is None:
        if any(mask):
            raise ValueError("mem mask is set but the turn has no memory")
        return
    text = masked_text(token_ids, tokenizer, mask)
    mem = memory.strip()
    i = text.find(mem)
    if i < 0:
        raise ValueError(f"masked span {text!r} does not contain the memory {mem!r}")
    rest = (text[:i] + " " + text[i + len(mem):]).strip()
    for piece in rest.split():
        if piece not in MEM_OPEN and piece not in MEM_CLOSE:
            raise ValueError(f"masked span {text!r} holds {piece!r} besides the memory")
