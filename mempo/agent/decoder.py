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
    softmax(scores). Returns (ids [B], log p of each id [B] or None).

    A draw is one uniform number per row looked up in the row's cumulative distribution
    (float64): the same distribution as `torch.multinomial`, which draws one exponential
    number per vocabulary entry and cost 6-10x more here (B x V random numbers a step).
    """
    if greedy:
        ids = scores.argmax(dim=-1)
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


# ------------------------------------------------------------------------------ engines


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, W] and attention mask [B, W] of `prompts`, right-aligned (left-padded
    with `pad_id`) to the longest one, W; on the CPU."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        if len(p):
            ids[r, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[r, width - len(p):] = 1
    return ids, mask


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm / Qwen2RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, the
    # statistics in float32 (the same values here in float32: tested against `generate()`).
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x * cos + rotate_half(x) * sin, with rotate_half(x) * sin written as
    # roll(x, half) * [-sin_1, sin_2]: the same products (negation is exact), fewer kernels.
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


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


class LlamaEngine:
    """Llama-family forward over a preallocated KV cache, one instance per batch.

    Cache: per layer K and V of [B, kv_heads, capacity, head_dim]; rows are right-aligned
    (every row's newest token is in column `length - 1`), so a decode step writes one
    column for all rows. `bias` [B, capacity] is 0 where a row has a token and -inf on its
    left padding. The weights are the model's own tensors, read at every prefill, so the
    updates of a trainer between calls are used at once.

    Prefill is packed: the prompts' tokens are concatenated (no padding reaches the
    matmuls), each prompt attends causally to itself, and the last layer runs attention
    and MLP for each prompt's last token only (its keys and values for all of them).
    """

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        self.eps = float(cfg.rms_norm_eps)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.scale = self.head_dim ** -0.5
        self.gqa = self.n_kv != self.n_heads
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.bias = torch.empty(0)
        self.pos = torch.empty(0, dtype=torch.long)  # position id of each row's next token
        self.length = 0

    def _weights(self) -> list[tuple[Any, ...]]:
        out = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            out.append((layer.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight,
                        a.k_proj.bias, a.v_proj.weight, a.v_proj.bias, a.o_proj.weight, a.o_proj.bias,
                        layer.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight,
                        m.down_proj.weight))
        return out

    def _tables(self, positions: int, dtype: torch.dtype, device: torch.device) -> None:
        # cos/sin of every position from the model's own rotary module: each entry is one
        # product inv_freq * position, so looking it up is bit-identical to its forward.
        ref = torch.empty(0, dtype=dtype, device=device)
        cos, sin = self.model.model.rotary_emb(ref, torch.arange(positions, device=device)[None])
        half = self.head_dim // 2
        self.cos = cos[0]
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    def _mlp(self, h: torch.Tensor, ln2: Any, wg: Any, wu: Any, wd: Any) -> torch.Tensor:
        x = _rms_norm(h, ln2, self.eps)
        return h + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        last = _rms_norm(h, self.model.model.norm.weight, self.eps)
        return F.linear(last, self.model.lm_head.weight).float()

    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int, pad_id: int) -> torch.Tensor:
        """Start a batch with `prompts` (right-aligned in `capacity` cache columns).
        Returns the next-token logits [B, V]."""
        device = next(self.model.parameters()).device
        dtype = self.model.model.embed_tokens.weight.dtype
        layers = self._weights()
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1:
            raise ValueError("empty prompt")
        bsz, width, total = len(prompts), max(lengths), sum(lengths)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
        pos = torch.cat([torch.arange(n) for n in lengths]).to(device)        # [T]
        row = torch.repeat_interleave(torch.arange(bsz), torch.tensor(lengths)).to(device)
        col = pos + torch.tensor([width - n for n in lengths], device=device)[row]
        ends = torch.tensor(lengths).cumsum(0)
        last = (ends - 1).to(device)                                          # [B] last token of each
        bounds = [(int(e) - n, int(e)) for e, n in zip(ends, lengths, strict=True)]
        self._tables(width + capacity, dtype, device)
        shape = (bsz, self.n_kv, capacity, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.bias = torch.zeros((bsz, capacity), dtype=dtype, device=device)
        for r, n in enumerate(lengths):
            self.bias[r, : width - n] = -math.inf
        h = self.model.model.embed_tokens(ids)                                # [T, D]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]              # [T, 1, hd]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        for i, (ln1, wq, bq, wk, bk, wv, bv, wo, bo, ln2, wg, wu, wd) in enumerate(layers):
            x = _rms_norm(h, ln1, self.eps)
            k = _rope(F.linear(x, wk, bk).view(total, nkv, hd), cos, sin)
            self.k[i][row, :, col] = k
            self.v[i][row, :, col] = F.linear(x, wv, bv).view(total, nkv, hd)
            if i == len(layers) - 1:
                # Only the last tokens' logits are wanted: attention as one decode step
                # over the cache just written, then the MLP of B rows instead of T.
                q = _rope(F.linear(x[last], wq, bq).view(bsz, nh, hd), cos[last], sin[last])
                att = F.scaled_dot_product_attention(
                    q[:, :, None], self.k[i][:, :, :width], self.v[i][:, :, :width],
                    attn_mask=self.bias[:, None, None, :width], scale=self.scale, enable_gqa=self.gqa)
                h = h[last] + F.linear(att.reshape(bsz, nh * hd), wo, bo)
            else:
                q = _rope(F.linear(x, wq, bq).view(total, nh, hd), cos, sin)
                v = self.v[i]
                att = torch.cat([
                    F.scaled_dot_product_attention(
                        q[a:b].transpose(0, 1)[None], self.k[i][r, :, width - (b - a):width][None],
                        v[r, :, width - (b - a):width][None], is_causal=True, scale=self.scale,
                        enable_gqa=self.gqa)[0].transpose(0, 1)
                    for r, (a, b) in enumerate(bounds)])                       # [T, nh, hd]
                h = h + F.linear(att.reshape(total, nh * hd), wo, bo)
            h = self._mlp(h, ln2, wg, wu, wd)
        self.layers = layers
        self.pos = torch.tensor(lengths, device=device)
        self.length = width
        return self._logits(h)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row, [B]; returns the next-token logits [B, V]."""
        bsz, col, end = tokens.shape[0], self.length, self.length + 1
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        h = self.model.model.embed_tokens(tokens)                             # [B, D]
        cos, sin = self.cos[self.pos][:, None], self.sin[self.pos][:, None]    # [B, 1, hd]
        mask = self.bias[:, None, None, :end]
        for i, (ln1, wq, bq, wk, bk, wv, bv, wo, bo, ln2, wg, wu, wd) in enumerate(self.layers):
            x = _rms_norm(h, ln1, self.eps)
            q = _rope(F.linear(x, wq, bq).view(bsz, nh, hd), cos, sin)
            self.k[i][:, :, col] = _rope(F.linear(x, wk, bk).view(bsz, nkv, hd), cos, sin)
            self.v[i][:, :, col] = F.linear(x, wv, bv).view(bsz, nkv, hd)
            att = F.scaled_dot_product_attention(
                q[:, :, None], self.k[i][:, :, :end], self.v[i][:, :, :end], attn_mask=mask,
                scale=self.scale, enable_gqa=self.gqa)
            h = h + F.linear(att.reshape(bsz, nh * hd), wo, bo)
            h = self._mlp(h, ln2, wg, wu, wd)
        self.pos = self.pos + 1
        self.length = end
        return self._logits(h)

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
        ids, mask = left_pad(prompts, pad_id)
        self.mask = mask.to(device)
        pos = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = DynamicCache(config=self.model.config)
        logits = self._run(ids.to(device), pos)
        self.pos = pos[:, -1] + 1
        self.length = ids.shape[1]
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


def make_engine(model: Any, kind: str = "auto") -> LlamaEngine | HFEngine:
    """`kind`: "llama" (the hand-written forward; refused for other architectures), "hf"
    (the model's forward) or "auto" (llama where it applies)."""
    reason = llama_family_reason(model)
    if kind == "llama" and reason is not None:
        raise ValueError(f"the llama-family engine cannot run this model: {reason}")
    if kind == "hf" or reason is not None:
        return HFEngine(model)
    return LlamaEngine(model)


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
