"""The forward passes `Decoder` drives: a preallocated KV cache written in place, per architecture.

    from mempo.agent.engines import make_engine
    engine = make_engine(model, "auto")   # LlamaEngine for Llama / Qwen2 / Mistral, else HFEngine

- `LlamaEngine`: the forward of Llama-family models (pre-norm RMSNorm blocks, default rope,
  grouped-query attention with optional q/k/v biases, SwiGLU MLP, no sliding window), written
  over the model's own weights, so a trainer's updates are seen at once; one preallocated
  cache per layer, rows dropped and merged in place.
- `HFEngine`: the model's own forward with a `DynamicCache`, for any other architecture.

`llama_family_reason` says why a model is not one `LlamaEngine` reproduces. Both engines
prefill left-padded prompts (`left_pad`) in one pass and return last-position logits only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

# Architectures whose forward `LlamaEngine` reproduces: pre-norm RMSNorm blocks, rotary
# embeddings (default rope), grouped-query attention with optional q/k/v biases, SwiGLU MLP.
LLAMA_FAMILY = ("llama", "qwen2", "mistral")
# Models whose q/k/v and gate/up matrices hold at most this many elements together get them
# fused for decode steps (`LlamaEngine._fuse`): the tiny policy (0.4M), not SmolLM2-135M (70M).
FUSE_MAX_ELEMENTS = 4_000_000

# On the CPU, prefill runs its packed prompts through every layer in groups of about this many
# tokens: a group's activations stay in the CPU cache between the layer's matmuls and
# element-wise kernels (the tiny policy's MLP over 7,300 tokens: 44 ms in one piece, 21 ms in
# groups of 1,024). A matmul over fewer rows may pick another kernel, so logits move by float
# rounding (~4e-6 here); greedy outputs are tested identical to `generate()`. On an accelerator
# the whole prefill is one group (no CPU cache to keep it in; smaller launches only cost).
PREFILL_GROUP_TOKENS = 1024

# A cached prompt prefix (`mempo.agent.prefix_cache`): n tokens, per layer keys and values
# [kv_heads, n, head_dim].
Prefix = tuple[int, list[torch.Tensor], list[torch.Tensor]]


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


def prefill_groups(sizes: Sequence[int], max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive ranges [r0, r1) of prompts whose `sizes` add up to at most `max_tokens`
    (a longer prompt is a range of its own); together they cover every prompt once."""
    out: list[tuple[int, int]] = []
    r0, acc = 0, 0
    for r, n in enumerate(sizes):
        if r > r0 and acc + n > max_tokens:
            out.append((r0, r))
            r0, acc = r, 0
        acc += n
    if sizes:
        out.append((r0, len(sizes)))
    return out


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
    and MLP for each prompt's last token only (its keys and values for all of them). The
    packed tokens go through all layers a group of prompts at a time (`PREFILL_GROUP_TOKENS`).
    """

    takes_prefixes = True  # prefill(prefixes=...) and row_cache: the decoder's prefix cache

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

    @staticmethod
    def _fuse(layers: list[tuple[Any, ...]]) -> list[tuple[Any, ...] | None]:
        """Per layer, the weights of decode steps with q, k, v as one matrix and gate, up as
        one (wqkv, bqkv, wgu), so a step calls 2 matmuls fewer per layer: at the tiny
        policy's size a step is mostly the cost of calling its kernels. Each output is still
        its own row's dot product (greedy outputs unchanged, tested). Built at every prefill
        (a trainer's updates are seen) and only for small models (`FUSE_MAX_ELEMENTS`): for
        larger ones the matmuls dominate and the copies would only take memory. None = use
        the separate matrices."""
        size = sum(w.numel() for layer in layers for w in (layer[1], layer[3], layer[5], layer[10], layer[11]))
        if size > FUSE_MAX_ELEMENTS:
            return [None] * len(layers)
        out: list[tuple[Any, ...] | None] = []
        for _ln1, wq, bq, wk, bk, wv, bv, _wo, _bo, _ln2, wg, wu, _wd in layers:
            biases = (bq, bk, bv)
            bqkv = None
            if any(b is not None for b in biases):
                rows = (wq.shape[0], wk.shape[0], wv.shape[0])
                bqkv = torch.cat([b if b is not None else wq.new_zeros(n) for b, n in zip(biases, rows, strict=True)])
            out.append((torch.cat([wq, wk, wv]), bqkv, torch.cat([wg, wu])))
        return out

    def _attend_last(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query token per row, q [B, nh, hd], over the cache k, v [B, nkv, L, hd] with
        the additive `mask` [B, 1, 1, L]; returns [B, nh * hd].

        The query heads that share a key/value head go in as that head's query positions
        ([B, nkv, nh / nkv, hd]), so each cached key and value is read once per step rather
        than once per query head (`enable_gqa` reads them for every head): 20 % less time
        in attention at batch 32 here, and attention is most of a decode step's time."""
        bsz = q.shape[0]
        att = F.scaled_dot_product_attention(q.view(bsz, self.n_kv, -1, self.head_dim), k, v,
                                             attn_mask=mask, scale=self.scale)
        return att.reshape(bsz, self.n_heads * self.head_dim)

    def _mlp(self, h: torch.Tensor, ln2: Any, wg: Any, wu: Any, wd: Any, wgu: Any = None) -> torch.Tensor:
        # wgu: gate and up as one matrix (`_fuse`), one matmul instead of two.
        x = _rms_norm(h, ln2, self.eps)
        gate, up = (F.linear(x, wg), F.linear(x, wu)) if wgu is None else F.linear(x, wgu).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, wd)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        last = _rms_norm(h, self.model.model.norm.weight, self.eps)
        return F.linear(last, self.model.lm_head.weight).float()

    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int, pad_id: int,
                prefixes: Sequence[Prefix | None] | None = None) -> torch.Tensor:
        """Start a batch with `prompts` (right-aligned in `capacity` cache columns).
        `prefixes[r]`, when given, holds the keys and values of prompt r's first n tokens
        (`mempo.agent.prefix_cache`): only the rest of that prompt runs, attending to them.
        Returns the next-token logits [B, V]."""
        device = next(self.model.parameters()).device
        dtype = self.model.model.embed_tokens.weight.dtype
        layers = self._weights()
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1:
            raise ValueError("empty prompt")
        cached = [pf[0] if pf is not None else 0 for pf in (prefixes or [None] * len(prompts))]
        if any(c >= n for c, n in zip(cached, lengths, strict=True)):
            raise ValueError("a cached prefix must leave at least one prompt token to run")
        new = [n - c for n, c in zip(lengths, cached, strict=True)]             # tokens each prompt runs
        bsz, width = len(prompts), max(lengths)
        ids = torch.tensor([t for p, c in zip(prompts, cached, strict=True) for t in p[c:]], dtype=torch.long,
                           device=device)
        pos = torch.cat([torch.arange(c, n) for c, n in zip(cached, lengths, strict=True)]).to(device)   # [T]
        ends = torch.tensor(new).cumsum(0)
        bounds = [(int(e) - m, int(e)) for e, m in zip(ends, new, strict=True)]
        self._tables(width + capacity, dtype, device)
        shape = (bsz, self.n_kv, capacity, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.bias = torch.zeros((bsz, capacity), dtype=dtype, device=device)
        for r, n in enumerate(lengths):
            self.bias[r, : width - n] = -math.inf
            if cached[r]:
                pk, pv = prefixes[r][1], prefixes[r][2]  # type: ignore[index]
                for i in range(len(layers)):
                    self.k[i][r, :, width - n:width - n + cached[r]] = pk[i].to(device, dtype)
                    self.v[i][r, :, width - n:width - n + cached[r]] = pv[i].to(device, dtype)
        # A prompt that runs only its last m of n tokens attends to all n keys: query j sees
        # keys up to n - m + j (causal, aligned at the bottom right).
        masks = [None if c == 0 else torch.ones((m, c + m), dtype=torch.bool, device=device).tril(c)
                 for c, m in zip(cached, new, strict=True)]
        h = self.model.model.embed_tokens(ids)                                # [T, D]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]              # [T, 1, hd]
        outs = []
        group_tokens = PREFILL_GROUP_TOKENS if device.type == "cpu" else sum(new)
        for r0, r1 in prefill_groups(new, group_tokens):
            a, b = bounds[r0][0], bounds[r1 - 1][1]
            outs.append(self._prefill_group(
                layers, h[a:b], cos[a:b], sin[a:b], r0, r1,
                [(x - a, y - a) for x, y in bounds[r0:r1]], lengths, width, masks))
        h = outs[0] if len(outs) == 1 else torch.cat(outs)                    # [B, D]
        self.layers = layers
        self.fused = self._fuse(layers)
        self.pos = torch.tensor(lengths, device=device)
        self.length = width
        return self._logits(h)

    def _prefill_group(self, layers: list[tuple[Any, ...]], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       r0: int, r1: int,
                       bounds: list[tuple[int, int]], lengths: list[int], width: int,
                       masks: list[torch.Tensor | None]) -> torch.Tensor:
        """Every layer for prompts r0..r1-1, whose packed tokens are `h` [t, D] (`bounds`
        their ranges in it): writes their keys and values into the cache and returns the last
        layer's output at their last tokens [r1 - r0, D]."""
        total, bsz = h.shape[0], r1 - r0
        last = torch.tensor([b - 1 for _, b in bounds], device=h.device)    # each prompt's last token
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        for i, (ln1, wq, bq, wk, bk, wv, bv, wo, bo, ln2, wg, wu, wd) in enumerate(layers):
            x = _rms_norm(h, ln1, self.eps)
            k = _rope(F.linear(x, wk, bk).view(total, nkv, hd), cos, sin).transpose(0, 1)   # [nkv, t, hd]
            v = F.linear(x, wv, bv).view(total, nkv, hd).transpose(0, 1)
            for r, (a, b) in zip(range(r0, r1), bounds, strict=True):
                # A prompt's new tokens fill the columns just left of `width`, one slice copy each.
                self.k[i][r, :, width - (b - a):width] = k[:, a:b]
                self.v[i][r, :, width - (b - a):width] = v[:, a:b]
            if i == len(layers) - 1:
                # Only the last tokens' logits are wanted: attention as one decode step
                # over the cache just written, then the MLP of B rows instead of T.
                q = _rope(F.linear(x[last], wq, bq).view(bsz, nh, hd), cos[last], sin[last])
                att = self._attend_last(q, self.k[i][r0:r1, :, :width], self.v[i][r0:r1, :, :width],
                                        self.bias[r0:r1, None, None, :width])
                h = h[last] + F.linear(att, wo, bo)
            else:
                q = _rope(F.linear(x, wq, bq).view(total, nh, hd), cos, sin)
                kc, vc = self.k[i], self.v[i]
                att = torch.cat([
                    F.scaled_dot_product_attention(
                        q[a:b].transpose(0, 1)[None], kc[r, :, width - lengths[r]:width][None],
                        vc[r, :, width - lengths[r]:width][None], attn_mask=masks[r], is_causal=masks[r] is None,
                        scale=self.scale, enable_gqa=self.gqa)[0].transpose(0, 1)
                    for r, (a, b) in zip(range(r0, r1), bounds, strict=True)])  # [t, nh, hd]
                h = h + F.linear(att.reshape(total, nh * hd), wo, bo)
            h = self._mlp(h, ln2, wg, wu, wd)
        return h

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row, [B]; returns the next-token logits [B, V]."""
        bsz, col, end = tokens.shape[0], self.length, self.length + 1
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        h = self.model.model.embed_tokens(tokens)                             # [B, D]
        cos, sin = self.cos[self.pos][:, None], self.sin[self.pos][:, None]    # [B, 1, hd]
        mask = self.bias[:, None, None, :end]
        for i, (ln1, wq, bq, wk, bk, wv, bv, wo, bo, ln2, wg, wu, wd) in enumerate(self.layers):
            fused = self.fused[i]
            x = _rms_norm(h, ln1, self.eps)
            if fused is None:
                q, k, v = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)
            else:
                q, k, v = F.linear(x, fused[0], fused[1]).split((nh * hd, nkv * hd, nkv * hd), dim=-1)
            q = _rope(q.reshape(bsz, nh, hd), cos, sin)
            self.k[i][:, :, col] = _rope(k.reshape(bsz, nkv, hd), cos, sin)
            self.v[i][:, :, col] = v.reshape(bsz, nkv, hd)
            att = self._attend_last(q, self.k[i][:, :, :end], self.v[i][:, :, :end], mask)
            h = h + F.linear(att, wo, bo)
            h = self._mlp(h, ln2, wg, wu, wd, None if fused is None else fused[2])
        self.pos = self.pos + 1
        self.length = end
        return self._logits(h)

    def row_cache(self, r: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row r's keys and values of its newest n tokens, per layer [kv_heads, n, head_dim]."""
        return ([k[r, :, self.length - n:self.length].clone() for k in self.k],
                [v[r, :, self.length - n:self.length].clone() for v in self.v])

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

    takes_prefixes = False

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

    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int, pad_id: int,
                prefixes: Sequence[Prefix | None] | None = None) -> torch.Tensor:
        from transformers import DynamicCache

        if prefixes is not None and any(pf is not None for pf in prefixes):
            raise ValueError("HFEngine runs whole prompts (takes_prefixes is False)")

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
