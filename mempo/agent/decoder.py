"""Batched KV-cache decoding for Hugging Face causal LMs: the engine behind `FastGenerator`.

At the policy sizes the local trainer runs (0.6M-135M parameters on CPU), `generate()` spends
most of every step outside the arithmetic: logits processors, stopping criteria that decode
text, masks rebuilt from scratch, cache bookkeeping, and finished rows that stay in the batch
until the longest one ends. This decoder keeps only what a rollout needs:

- left-padded prompts of mixed lengths, prefilled in one forward pass, logits of the last
  position only;
- a preallocated KV cache written in place (`LlamaEngine`: the forward of Llama-family
  models, Llama / Qwen2 / Mistral without sliding windows, written over the model's own
  weights, so a trainer's updates are seen at once), or the model's own forward with a
  `DynamicCache` for any other architecture (`HFEngine`);
- greedy or temperature / top-p sampling with the same maths as `generate()` (processed
  logits, then `torch.multinomial` from an optional seeded `torch.Generator`), and the
  log-probability of each chosen token under that processed distribution;
- stop strings checked on the text of the newest token only (a whole-text decode confirms a
  hit), eos, and a max-new-tokens per sequence;
- finished rows dropped from the batch (the cache is compacted), and waiting prompts joining
  between decode steps when there are more prompts than `max_batch`;
- optionally, finished rows' keys and values kept for the prompts that extend them (a
  full-history agent's next turn), which then prefill only their new tokens
  (`prefix_cache_bytes`, `mempo.agent.prefix_cache`).

    dec = Decoder(model, tokenizer, max_batch=64)
    rows = dec.decode([prompt_ids, ...], max_new_tokens=128, temperature=1.0, stop=("</search>",))
    rows[0].token_ids, rows[0].logprobs, rows[0].reason     # "eos" | "stop" | "length"

The engines (the forward passes and their caches) are in `mempo.agent.engines`; this module
is the scheduling around them: sampling, stop strings, dropping finished rows, admitting
waiting prompts. `mempo.agent.generation.FastGenerator` wraps it in the `Generator` protocol (the stop-string
cut and the `Generation` contract are the same as `HFGenerator`'s).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mempo.agent.engines import make_engine

log = logging.getLogger(__name__)


@dataclass
class DecodedRow:
    """What one prompt produced.

    Attributes:
        token_ids: generated ids, [n] (the eos, when generated, is the last one).
        logprobs: log p of each id under the processed sampling distribution, [n]
            (empty when not requested).
        reason: "eos", "stop" (a stop string was completed) or "length".
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str = "length"


# ------------------------------------------------------------------------------ sampling


def process_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The scores `generate()` samples from: logits / temperature, then top-p filtering
    (tokens outside the nucleus set to -inf). `logits` [B, V] float32 -> [B, V].

    Greedy (temperature <= 0) returns the logits unchanged, as `generate()` does.
    """
    if temperature <= 0:
        return logits
    scores = logits / temperature if temperature != 1.0 else logits
    if top_p < 1.0:
        # Same rule as transformers' TopPLogitsWarper: drop the low tail whose mass is
        # <= 1 - top_p, always keep the most likely token.
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    return scores


def choose_tokens(
    scores: torch.Tensor, greedy: bool, generator: torch.Generator | None, want_logprobs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next token per row from processed `scores` [B, V]: argmax, or a draw from
    softmax(scores). Returns (ids [B], log p of each id [B] or None).

    A draw is one uniform number per row looked up in the row's cumulative distribution
    (float64): the same distribution as `torch.multinomial`, which draws one exponential
    number per vocabulary entry and cost 6-10x more here (B x V random numbers a step).
    """
    if greedy:
        # max(dim) picks the first of equal maxima, as argmax does, at ~2/3 of its cost here.
        ids = scores.max(dim=-1).indices
    else:
        cdf = scores.softmax(dim=-1).double().cumsum_(dim=-1)
        u = torch.rand((cdf.shape[0], 1), generator=generator, dtype=torch.float64, device=cdf.device)
        ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        # u * total < total, so the index is in range unless rounding put it at the very end.
        ids = ids.clamp_(max=cdf.shape[1] - 1)
    lps = None
    if want_logprobs:
        lps = scores.log_softmax(dim=-1).gather(1, ids[:, None]).squeeze(1)
    return ids, lps


# ------------------------------------------------------------------------------ stop strings


class StopChecker:
    """Says when a row's text has completed a stop string, looking at the newest token's
    text only (a table of each token's decoded text, built once per tokenizer).

    A token-by-token concatenation can differ from decoding the whole sequence (multi-byte
    characters, skipped special tokens, clean-up of spaces), so a hit is confirmed by a
    real decode; a miss costs only extra tokens, which `cut_at_stop` removes afterwards.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.keep_chars = max((len(s) for s in self.stop), default=0)
        self.last_chars = {s[-1] for s in self.stop}
        self.pieces: dict[int, str] = {}

    def piece(self, token: int) -> str:
        text = self.pieces.get(token)
        if text is None:
            text = self.tokenizer.decode([token], skip_special_tokens=True)
            self.pieces[token] = text
        return text

    def update(self, tail: str, token: int, ids: list[int]) -> tuple[str, bool]:
        """The new tail text (the last few characters) and whether `ids` (which ends with
        `token`) now holds a stop string."""
        piece = self.piece(token)
        tail = (tail + piece)[-(self.keep_chars + len(piece)):]
        if not self.stop or not any(c in piece for c in self.last_chars):
            return tail, False
        if not any(s in tail for s in self.stop):
            return tail, False
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return tail, any(s in text for s in self.stop)


# ------------------------------------------------------------------------------ decoder


@dataclass
class _Row:
    index: int          # position in the caller's prompt list
    budget: int         # max new tokens
    out: DecodedRow
    tail: str = ""


class Decoder:
    """Batched decoding with finished rows dropped and waiting prompts joining.

    Args:
        model: a transformers causal LM in eval mode, on its device.
        tokenizer: its tokenizer (for stop strings; pad id from it or eos).
        max_batch: rows decoded together; more prompts wait and join as rows finish.
        engine: "auto" | "llama" | "hf" (see `make_engine`).
        eos_ids: token ids that end a sequence (default: the model's and tokenizer's eos).
        join_min: waiting prompts join once this many rows are free (or the batch is empty):
            each join copies the cache, so joining one row at a time would cost more
            than it saves.
        prefix_cache_bytes: keep finished rows' keys and values up to this many bytes, and
            prefill a prompt that extends one only past it (`mempo.agent.prefix_cache`: a
            full-history agent's next turn); 0 = off. `LlamaEngine` only.
    """

    def __init__(self, model: Any, tokenizer: Any, max_batch: int = 64, engine: str = "auto",
                 eos_ids: set[int] | None = None, join_min: int | None = None,
                 prefix_cache_bytes: int = 0) -> None:
        from mempo.agent.generation import eos_token_ids
        from mempo.agent.prefix_cache import PrefixCache

        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max(1, int(max_batch))
        self.engine_kind = engine
        probe = make_engine(model, engine)  # refuse an unsupported `engine` now, not at the first call
        self.prefix_cache = (PrefixCache(model, prefix_cache_bytes)
                             if prefix_cache_bytes > 0 and probe.takes_prefixes else None)
        self.eos_ids = set(eos_ids) if eos_ids is not None else eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self.join_min = join_min if join_min is not None else max(1, self.max_batch // 4)
        self._stops: dict[tuple[str, ...], StopChecker] = {}
        # Running totals (thread CPU seconds and token counts), read by benchmarks/decode.py.
        self.stats = {"prefill_s": 0.0, "step_s": 0.0, "prefill_tokens": 0, "prefill_padded": 0,
                      "steps": 0, "row_steps": 0}

    def _checker(self, stop: Sequence[str]) -> StopChecker:
        key = tuple(stop)
        if key not in self._stops:
            self._stops[key] = StopChecker(self.tokenizer, key)
        return self._stops[key]

    @torch.inference_mode()
    def decode(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] = (),
        logprobs: bool = True,
        generator: torch.Generator | None = None,
    ) -> list[DecodedRow]:
        """Decode every prompt (token id lists) to eos, a stop string or its budget.

        Args:
            max_new_tokens: one budget for all, or one per prompt.
            temperature: 0 = greedy; otherwise sample from softmax(logits / temperature).
            top_p: nucleus mass (1.0 = off; ignored when greedy).
            generator: RNG for sampling (None = torch's global RNG).

        Returns one `DecodedRow` per prompt, in order.
        """
        n = len(prompts)
        budgets = [int(max_new_tokens)] * n if isinstance(max_new_tokens, int) else [int(b) for b in max_new_tokens]
        if len(budgets) != n:
            raise ValueError(f"{len(budgets)} budgets for {n} prompts")
        results = [DecodedRow() for _ in range(n)]
        queue = [i for i in range(n) if budgets[i] > 0]
        for i in range(n):
            if budgets[i] <= 0:
                results[i].reason = "length"
        checker = self._checker(stop)
        cache = self.prefix_cache
        if cache is not None:
            cache.check_weights()
        greedy = temperature <= 0
        eos = self.eos_ids
        engine: Any = None
        rows: list[_Row] = []
        logits: torch.Tensor | None = None

        while queue or rows:
            free = self.max_batch - len(rows)
            if queue and (not rows or free >= min(self.join_min, len(queue))):
                take, queue = queue[:free], queue[free:]
                new_rows = [_Row(i, budgets[i], results[i]) for i in take]
                fresh = make_engine(self.model, self.engine_kind)
                width = max(len(prompts[i]) for i in take)
                need = max(r.budget for r in new_rows + rows)
                t0 = time.thread_time()
                prefixes = [cache.take(prompts[i]) for i in take] if cache is not None else None
                new_logits = fresh.prefill([prompts[i] for i in take], width + need, self.pad_id, prefixes)
                self.stats["prefill_s"] += time.thread_time() - t0
                self.stats["prefill_tokens"] += (sum(len(prompts[i]) for i in take)
                                                 - sum(pf[0] for pf in prefixes or () if pf is not None))
                self.stats["prefill_padded"] += width * len(take)
                if engine is None or not rows:
                    engine, rows, logits = fresh, new_rows, new_logits
                else:
                    left = max([r.budget - len(r.out.token_ids) for r in rows] + [r.budget for r in new_rows])
                    engine.merge(fresh, max(engine.length, fresh.length) + left)
                    rows = rows + new_rows
                    logits = torch.cat([logits, new_logits])  # type: ignore[list-item]
            assert logits is not None and engine is not None
            scores = process_logits(logits, temperature, top_p)
            ids_t, lps_t = choose_tokens(scores, greedy, generator, logprobs)
            ids = ids_t.tolist()
            lps = lps_t.tolist() if lps_t is not None else None
            done: list[int] = []
            for r, row in enumerate(rows):
                t = ids[r]
                out = row.out
                out.token_ids.append(t)
                if lps is not None:
                    out.logprobs.append(lps[r])
                if t in eos:
                    out.reason = "eos"
                    done.append(r)
                    continue
                row.tail, hit = checker.update(row.tail, t, out.token_ids)
                if hit:
                    out.reason = "stop"
                    done.append(r)
                elif len(out.token_ids) >= row.budget:
                    out.reason = "length"
                    done.append(r)
            if done and cache is not None:
                for r in done:  # the cache holds the prompt and every token but the newest
                    seq = list(prompts[rows[r].index]) + rows[r].out.token_ids[:-1]
                    cache.put(seq, *engine.row_cache(r, len(seq)))
            if done:
                if len(done) == len(rows):
                    rows = []
                    continue
                gone = set(done)
                keep = [r for r in range(len(rows)) if r not in gone]
                rows = [rows[r] for r in keep]
                keep_t = torch.tensor(keep, dtype=torch.long, device=ids_t.device)
                engine.keep(keep_t)
                ids_t = ids_t.index_select(0, keep_t)
            if engine.length >= engine.capacity:
                raise RuntimeError("decoder cache overflow (budget bookkeeping bug)")
            t0 = time.thread_time()
            logits = engine.step(ids_t)
            self.stats["step_s"] += time.thread_time() - t0
            self.stats["steps"] += 1
            self.stats["row_steps"] += len(rows)
        return results
