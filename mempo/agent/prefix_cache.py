"""Keys and values of finished decode rows, kept for the prompts that extend them.

A full-history (Search-R1 style) agent's next prompt is its last prompt, its response and
the observation: thousands of tokens that the decoder prefilled last turn and would prefill
again. `Decoder` stores each finished row's keys and values here (the prompt and the tokens it
generated, all but the last, whose keys were never computed) and, when a new prompt starts
with a stored sequence, prefills only the rest (`mempo.agent.engines.LlamaEngine.prefill`'s
`prefixes`). The match is on token ids, so a response re-tokenised differently, or cut at a
stop string, reuses what still agrees. A memory agent's prompts rewrite the memory and share
only the question: below `MIN_REUSE_TOKENS`, they are prefilled as before.

Keys and values depend on the weights: the cache empties itself when any parameter of the
model was changed in place since it was filled (an optimiser step, a loaded state dict;
`torch.Tensor._version`). Entries are evicted least recently stored first beyond `max_bytes`.

    cache = PrefixCache(model, max_bytes=256 << 20)
    cache.put(ids, keys, values)          # keys / values: per layer [kv_heads, len(ids), head_dim]
    hit = cache.take(prompt)              # None, or (n, keys, values) for prompt[:n]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Entries are looked up by their first KEY_TOKENS ids (then the longest common prefix decides).
KEY_TOKENS = 32
# Reuse only this many tokens or more: below it, copying the entry costs about what it saves.
MIN_REUSE_TOKENS = 64


@dataclass
class _Entry:
    ids: np.ndarray
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixCache:
    """Finished rows' keys and values by token ids, bounded by `max_bytes` (module docstring)."""

    def __init__(self, model: Any, max_bytes: int) -> None:
        self.model = model
        self.max_bytes = int(max_bytes)
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.by_key: dict[tuple[int, ...], set[int]] = {}
        self.bytes = 0
        self._next = 0
        self._weights = self._fingerprint()
        self.stats = {"hits": 0, "misses": 0, "reused_tokens": 0}

    def _fingerprint(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.model.parameters())

    def check_weights(self) -> None:
        """Empty the cache if the model's weights changed since it was filled."""
        now = self._fingerprint()
        if now != self._weights:
            self.clear()
            self._weights = now

    def clear(self) -> None:
        self.entries.clear()
        self.by_key.clear()
        self.bytes = 0

    def _drop(self, handle: int) -> None:
        entry = self.entries.pop(handle)
        self.bytes -= entry.nbytes
        key = tuple(entry.ids[:KEY_TOKENS].tolist())
        self.by_key[key].discard(handle)
        if not self.by_key[key]:
            del self.by_key[key]

    def put(self, ids: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep the keys and values of `ids` (per layer [kv_heads, len(ids), head_dim])."""
        if len(ids) < MIN_REUSE_TOKENS or self.max_bytes <= 0:
            return
        entry = _Entry(np.asarray(ids, dtype=np.int64), keys, values)
        if entry.nbytes > self.max_bytes:
            return
        handle = self._next
        self._next += 1
        self.entries[handle] = entry
        self.by_key.setdefault(tuple(entry.ids[:KEY_TOKENS].tolist()), set()).add(handle)
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def take(self, prompt: Sequence[int]) -> tuple[int, list[torch.Tensor], list[torch.Tensor]] | None:
        """The longest stored prefix of `prompt` (at least MIN_REUSE_TOKENS, at most all but its
        last token, which must run to give the next-token logits): (n, keys, values) for
        prompt[:n], per layer [kv_heads, n, head_dim]. The entry leaves the cache (the row
        that extends it stores the longer sequence when it finishes)."""
        handles = self.by_key.get(tuple(prompt[:KEY_TOKENS]), ())
        best, best_n = -1, 0
        ids = np.asarray(prompt, dtype=np.int64)
        for h in handles:
            stored = self.entries[h].ids
            n = min(len(stored), len(ids))
            diff = np.flatnonzero(stored[:n] != ids[:n])
            shared = int(diff[0]) if len(diff) else n
            if shared > best_n:
                best, best_n = h, shared
        best_n = min(best_n, len(prompt) - 1)
        if best < 0 or best_n < MIN_REUSE_TOKENS:
            self.stats["misses"] += 1
            return None
        entry = self.entries[best]
        self._drop(best)
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += best_n
        return best_n, [k[:, :best_n] for k in entry.keys], [v[:, :best_n] for v in entry.values]
