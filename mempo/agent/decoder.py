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
  between decode steps when there are more prompts than `max_batch`.

    dec = Decoder(model, tokenizer, max_batch=64)
    rows = dec.decode([prompt_ids, ...], max_new_tokens=128, temperature=1.0, stop=("</search>",))
    rows[0].token_ids, rows[0].logprobs, rows[0].reason     # "eos" | "stop" | "length"

`mempo.agent.generation.FastGenerator` wraps it in the `Generator` protocol (the stop-string
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
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Architectures whose forward `LlamaEngine` reproduces: pre-norm RMSNorm blocks, rotary
# embeddings (default rope), grouped-query attention with optional q/k/v biases, SwiGLU MLP.
LLAMA_FAMILY = ("llama", "qwen2", "mistral")


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
    softmax(scores). Returns (ids [B], log p of each id [B] or None)."""
    if greedy:
        ids = scores.argmax(dim=-1)
    else:
        probs = scores.softmax(dim=-1)
        ids = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    lps = None
    if want_logprobs:
        lps = scores.log_softmax(dim=-1).gather(1, ids[:, None]).squeeze(1)
    return ids, lps


# ------------------------------------------------------------------------------ engines


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm / Qwen2RMSNorm: statistics in float32, scale in x's dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def llama_family_reason(model: Any) -> str | None:
    """None when `LlamaEngine` reproduces `model`'s forward; otherwise why not."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in LLAMA_FAMILY:
        return f"model_type {mtype!r} is not one of {LLAMA_FAMILY}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        return f"rope_type {rope.get('rope_type')!r}"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers"
    if mtype == "mistral" and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if getattr(getattr(model, "lm_head", None), "bias", None) is not None:
        return "lm_head has a bias"
    return None


_PACKED: dict[int, tuple[tuple[Any, ...], list[tuple[Any, ...]]]] = {}


def packed_weights(model: Any, fuse: bool = True) -> list[tuple[Any, ...]]:
    """Per layer (ln1, W_qkv, b_qkv, W_o, b_o, ln2, W_gate_up, W_down) of a Llama-family
    `model`: q/k/v and gate/up stacked into one matrix each (two matmuls fewer per layer).

    The stacked copies are rebuilt whenever a parameter changed (its version counter or
    storage moved: an optimiser step, `load_state_dict`), so a trainer's updates are seen.
    """
    params = list(model.parameters())
    key = (fuse, *((p.data_ptr(), p._version) for p in params))
    hit = _PACKED.get(id(model))
    if hit is not None and hit[0] == key:
        return hit[1]

    def cat(ts: list[Any]) -> Any:
        if any(t is None for t in ts):
            return None
        return torch.cat([t.detach() for t in ts]) if fuse else tuple(t.detach() for t in ts)

    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out.append((layer.input_layernorm.weight.detach(),
                    cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                    a.o_proj.weight.detach(), None if a.o_proj.bias is None else a.o_proj.bias.detach(),
                    layer.post_attention_layernorm.weight.detach(),
                    cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight.detach()))
    _PACKED.clear()  # one model at a time: the copies cost as much memory as the weights
    _PACKED[id(model)] = (key, out)
    return out


class LlamaEngine:
    """Llama-family forward over a preallocated KV cache, one instance per batch.

    Cache: per layer K and V of [B, kv_heads, capacity, head_dim]; rows are right-aligned
    (every row's newest token is in column `length - 1`), so a decode step writes one
    column for all rows. `bias` [B, capacity] is 0 where a row has a token and -inf on its
    left padding.
    """

    def __init__(self, model: Any, fuse: bool = True) -> None:
        cfg = model.config
        self.model = model
        self.fuse = fuse
        self.eps = float(cfg.rms_norm_eps)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.scale = self.head_dim ** -0.5
        base = model.model
        self.rotary = base.rotary_emb
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.bias = torch.empty(0)
        self.pos = torch.empty(0, dtype=torch.long)  # position id of each row's next token
        self.length = 0

    def _weights(self) -> list[tuple[Any, ...]]:
        return packed_weights(self.model, self.fuse)

    def _tables(self, positions: int, dtype: torch.dtype, device: torch.device) -> None:
        # cos/sin of every position from the model's own rotary module: each entry is one
        # product inv_freq * position, so looking it up is bit-identical to its forward.
        ref = torch.empty(0, dtype=dtype, device=device)
        cos, sin = self.rotary(ref, torch.arange(positions, device=device)[None])
        self.cos, self.sin = cos[0], sin[0]

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Run `ids` [B, S] at positions `pos` [B, S], written to cache columns
        [start, start + S); attention over columns [0, start + S) with `mask` (bool or
        additive, broadcastable to [B, heads, S, start + S]). Returns the last position's
        logits [B, V] (float32)."""
        model = self.model
        bsz, s = ids.shape
        h = model.model.embed_tokens(ids)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, S, head_dim]
        end = start + s
        gqa = self.n_kv != self.n_heads
        nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        n_layers = len(self.layers)
        for i, (ln1, wqkv, bqkv, wo, bo, ln2, wgu, wd) in enumerate(self.layers):
            x = _rms_norm(h, ln1, self.eps)
            if isinstance(wqkv, tuple):
                bb = bqkv if bqkv is not None else (None, None, None)
                q, k, v = (F.linear(x, w, b) for w, b in zip(wqkv, bb, strict=True))
            else:
                qkv = F.linear(x, wqkv, bqkv)
                q, k, v = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
            q = q.view(bsz, s, self.n_heads, self.head_dim).transpose(1, 2)
            k = k.view(bsz, s, self.n_kv, self.head_dim).transpose(1, 2)
            v = v.view(bsz, s, self.n_kv, self.head_dim).transpose(1, 2)
            self.k[i][:, :, start:end] = _rotate(k, cos, sin)
            self.v[i][:, :, start:end] = v
            if i == n_layers - 1 and s > 1:
                # Only the last position's logits are wanted: the last layer needs every
                # position's keys and values (written above), but its attention output
                # and MLP for the last position only.
                q, h, qcos, qsin = q[:, :, -1:], h[:, -1:], cos[:, :, -1:], sin[:, :, -1:]
                mask = mask[..., -1:, :] if mask is not None else None
                s = 1
            else:
                qcos, qsin = cos, sin
            q = _rotate(q, qcos, qsin)
            att = F.scaled_dot_product_attention(
                q, self.k[i][:, :, :end], self.v[i][:, :, :end], attn_mask=mask, scale=self.scale,
                enable_gqa=gqa)
            h = h + F.linear(att.transpose(1, 2).reshape(bsz, s, -1), wo, bo)
            x = _rms_norm(h, ln2, self.eps)
            if isinstance(wgu, tuple):
                g, u = F.linear(x, wgu[0]), F.linear(x, wgu[1])
            else:
                gu = F.linear(x, wgu)
                g, u = gu[..., : gu.shape[-1] // 2], gu[..., gu.shape[-1] // 2:]
            h = h + F.linear(F.silu(g) * u, wd)
        last = _rms_norm(h[:, -1], model.model.norm.weight, self.eps)
        return F.linear(last, model.lm_head.weight).float()

    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int, pad_id: int) -> torch.Tensor:
        """Start a batch: left-pad `prompts` to their longest, run them, keep room for
        `capacity` columns in all. Returns the next-token logits [B, V]."""
        device = next(self.model.parameters()).device
        dtype = self.model.model.embed_tokens.weight.dtype
        self.layers = self._weights()
        width = max(len(p) for p in prompts)
        bsz = len(prompts)
        ids = torch.full((bsz, width), pad_id, dtype=torch.long)
        valid = torch.zeros((bsz, width), dtype=torch.bool)
        for r, p in enumerate(prompts):
            if len(p):
                ids[r, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
                valid[r, width - len(p):] = True
        ids, valid = ids.to(device), valid.to(device)
        # Position ids count real tokens only (as generate() derives them from the mask).
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        self._tables(width + capacity, dtype, device)
        shape = (bsz, self.n_kv, capacity, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.bias = torch.zeros((bsz, capacity), dtype=dtype, device=device)
        self.bias[:, :width].masked_fill_(~valid, -math.inf)
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        # A padding query attends to itself only, so no row of the softmax is empty (NaN).
        mask = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)[None]
        logits = self._forward(ids, pos, 0, mask[:, None])
        self.pos = pos[:, -1] + 1
        self.length = width
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row, [B]; returns the next-token logits [B, V]."""
        mask = self.bias[:, None, None, : self.length + 1]
        logits = self._forward(tokens[:, None], self.pos[:, None], self.length, mask)
        self.pos = self.pos + 1
        self.length += 1
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in `rows` (indices, ascending) and the columns that are now
        padding in all remaining rows."""
        bias = self.bias.index_select(0, rows)
        real = (bias[:, : self.length] == 0).any(0)
        first = int(real.nonzero()[0]) if bool(real.any()) else 0
        self.bias = bias[:, first:]
        self.k = [k.index_select(0, rows)[:, :, first:] for k in self.k]
        self.v = [v.index_select(0, rows)[:, :, first:] for v in self.v]
        self.pos = self.pos.index_select(0, rows)
        self.length -= first

    @property
    def capacity(self) -> int:
        return self.bias.shape[1]

    def merge(self, other: LlamaEngine, capacity: int) -> None:
        """Append the rows of `other` (prefilled separately) to this batch: both are
        right-aligned to the longer length, in a new cache of `capacity` columns."""
        length = max(self.length, other.length)

        def place(a: torch.Tensor, a_len: int, b: torch.Tensor, b_len: int, left: float) -> torch.Tensor:
            # Columns are dim 2 of K/V [B, kv, cols, hd] and dim 1 of the bias [B, cols].
            dim = 2 if a.dim() == 4 else 1
            parts = []
            for t, n in ((a, a_len), (b, b_len)):
                shape = list(t.shape)
                shape[dim] = capacity
                buf = t.new_zeros(shape)
                pad = length - n
                buf.narrow(dim, 0, pad).fill_(left)  # new left padding
                buf.narrow(dim, pad, n).copy_(t.narrow(dim, 0, n))
                parts.append(buf)
            return torch.cat(parts, 0)

        self.k = [place(a, self.length, b, other.length, 0.0) for a, b in zip(self.k, other.k, strict=True)]
        self.v = [place(a, self.length, b, other.length, 0.0) for a, b in zip(self.v, other.v, strict=True)]
        self.bias = place(self.bias, self.length, other.bias, other.length, -math.inf)
        self.pos = torch.cat([self.pos, other.pos])
        self.length = length
        if other.cos.shape[0] > self.cos.shape[0]:
            self.cos, self.sin = other.cos, other.sin


class HFEngine:
    """Any causal LM through its own forward and a `DynamicCache` (the general fallback).

    Same interface as `LlamaEngine`; the attention mask is [B, length] (1 = real token).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: Any = None
        self.mask = torch.empty(0, dtype=torch.long)
        self.pos = torch.empty(0, dtype=torch.long)
        self.length = 0
        self.capacity = 1 << 30

    def _run(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[:, -1].float()

    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int, pad_id: int) -> torch.Tensor:
        from transformers import DynamicCache

        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            if len(p):
                ids[r, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
                mask[r, width - len(p):] = 1
        self.mask = mask.to(device)
        pos = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = DynamicCache(config=self.model.config)
        logits = self._run(ids.to(device), pos)
        self.pos = pos[:, -1] + 1
        self.length = width
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        logits = self._run(tokens[:, None], self.pos[:, None])
        self.pos = self.pos + 1
        self.length += 1
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask = self.mask.index_select(0, rows)
        self.pos = self.pos.index_select(0, rows)

    def merge(self, other: HFEngine, capacity: int) -> None:
        # Left-pad the shorter side's cache and mask to the common length, then concatenate.
        length = max(self.length, other.length)
        for eng in (self, other):
            pad = length - eng.length
            if pad:
                eng.mask = F.pad(eng.mask, (pad, 0))
                for layer in eng.cache.layers:
                    layer.keys = F.pad(layer.keys, (0, 0, pad, 0))
                    layer.values = F.pad(layer.values, (0, 0, pad, 0))
        for a, b in zip(self.cache.layers, other.cache.layers, strict=True):
            a.keys = torch.cat([a.keys, b.keys])
            a.values = torch.cat([a.values, b.values])
        self.mask = torch.cat([self.mask, other.mask])
        self.pos = torch.cat([self.pos, other.pos])
        self.length = length


def make_engine(model: Any, kind: str = "auto", **options: Any) -> LlamaEngine | HFEngine:
    """`kind`: "llama" (the hand-written forward; refused for other architectures), "hf"
    (the model's forward) or "auto" (llama where it applies)."""
    reason = llama_family_reason(model)
    if kind == "llama" and reason is not None:
        raise ValueError(f"the llama-family engine cannot run this model: {reason}")
    if kind == "hf" or reason is not None:
        return HFEngine(model)
    return LlamaEngine(model, **options)


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
    """

    def __init__(self, model: Any, tokenizer: Any, max_batch: int = 64, engine: str = "auto",
                 eos_ids: set[int] | None = None, join_min: int | None = None) -> None:
        from mempo.agent.generation import eos_token_ids

        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max(1, int(max_batch))
        self.engine_kind = engine
        make_engine(model, engine)  # refuse an unsupported `engine` now, not at the first call
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
                new_logits = fresh.prefill([prompts[i] for i in take], width + need, self.pad_id)
                self.stats["prefill_s"] += time.thread_time() - t0
                self.stats["prefill_tokens"] += sum(len(prompts[i]) for i in take)
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
