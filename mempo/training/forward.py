"""Causal-LM forwards that compute only what a loss or a score reads.

`logits_at(model, input_ids, attention_mask, where)` gives the logits at the chosen
positions of a batch, the same numbers the model's own forward has there, cheaper:

- a right-padded batch runs without its attention mask: under causal attention a real token
  attends only to the real tokens before it, so the mask changes nothing it computes, and
  without one SDPA runs its causal kernel, which skips the masked half of the score blocks,
  instead of building an explicit [B, 1, T, T] mask and reading it in every layer (long
  full-history sequences spend most of their time there);
- the LM head (hidden x vocabulary) runs only at the chosen positions where the
  architecture's logits are exactly `lm_head(last hidden state)` (`has_plain_head`), so
  prompt, padding and retrieved-passage positions get none;
- the leading tokens every row of a right-padded batch shares (the chat template and the
  system prompt where the template keeps it, as real models' templates do; the question of
  one task's turns) run once, as a batch of one, and the rest of each row attends to their
  keys and values
  (`shared_prefix_length`, `prefix_hidden`). Under causal attention a row's first P hidden
  states depend only on its first P tokens, so they are the same in every row; gradients
  from every row meet in the one prefix pass, as they would sum over the B copies.

Used by the SFT loss (`mempo.training.sft.token_loss`), the GRPO update's response
log-probs (`mempo.training.losses.response_logprobs`) and the memory reward's answer
probabilities (`mempo.advantage.answer_probability`).
"""

from __future__ import annotations

from typing import Any

# Causal LMs whose logits are exactly `lm_head(model(...).last_hidden_state)`: nothing after the
# head (no soft-capping or logit scaling), so the head can run on chosen positions only.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def has_plain_head(model: Any) -> bool:
    """Whether the LM head may run on chosen positions only (`PLAIN_HEAD_MODEL_TYPES`; a
    wrapped model, e.g. DDP, has no `config` and is not)."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES
            and hasattr(model, "model") and hasattr(model, "lm_head"))


def right_padded(attention_mask: Any) -> bool:
    """Every row's ones come first (no left padding, no holes)."""
    return bool((attention_mask.cumprod(-1) == attention_mask).all())


def logits_at(model: Any, input_ids: Any, attention_mask: Any, where: Any, share_prefix: bool = True) -> Any:
    """Logits at the positions where `where` ([B, T] bool) is True, [N, V] in row-major order,
    in the model's dtype. A right-padded batch needs no position ids (they are 0..n-1 per row);
    a left-padded one gets them from the mask. A right-padded batch's shared leading tokens
    run once (`prefix_hidden`) unless `share_prefix` is False."""
    import torch

    if right_padded(attention_mask):
        kwargs: dict[str, Any] = {"attention_mask": None}
    else:
        kwargs = {"attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)}
    if has_plain_head(model):
        shared = (shared_prefix_length(input_ids, attention_mask)
                  if share_prefix and kwargs["attention_mask"] is None else 0)
        if shared:
            head, tail = prefix_hidden(model, input_ids, shared)
            rows = input_ids.shape[0]
            # Positions in the prefix are rare in `where` (GRPO and the memory probe choose
            # response tokens); they get the shared hidden state, one copy per row.
            hidden = torch.cat([head[None].expand(rows, -1, -1), tail], 1)
        else:
            hidden = model.model(input_ids=input_ids, **kwargs).last_hidden_state
        return model.lm_head(hidden[where])
    return model(input_ids=input_ids, **kwargs).logits[where]


# Below this many shared leading tokens the second forward call costs more than it saves.
MIN_SHARED_PREFIX = 16


def shared_prefix_length(input_ids: Any, attention_mask: Any, min_length: int = MIN_SHARED_PREFIX) -> int:
    """How many leading columns of a right-padded [B, T] batch every row has, real and with
    the same ids, capped one short of the shortest row (every row keeps a token of its own);
    0 for one row or fewer than `min_length` shared tokens."""
    import torch

    if input_ids.shape[0] < 2:
        return 0
    lengths = attention_mask.sum(-1)
    cap = int(lengths.min()) - 1
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)
    diff = torch.nonzero(~same)
    n = int(diff[0, 0]) if len(diff) else input_ids.shape[1]
    n = min(n, cap)
    return n if n >= min_length else 0


def prefix_hidden(model: Any, input_ids: Any, n_prefix: int) -> tuple[Any, Any]:
    """Last hidden states of a right-padded [B, T] batch whose first `n_prefix` columns are
    the same in every row (`shared_prefix_length`): the prefix's, [n_prefix, H], computed
    once, and the rest's, [B, T - n_prefix, H], attending to the prefix's keys and values
    repeated per row. Equal to the rows' own forward at those positions; differentiable.
    Needs `has_plain_head(model)` (it runs the base model)."""
    import torch
    from transformers import DynamicCache

    rows, width = input_ids.shape
    head = model.model(input_ids=input_ids[:1, :n_prefix], use_cache=True,
                       past_key_values=DynamicCache(config=model.config))
    cache = head.past_key_values
    cache.batch_repeat_interleave(rows)
    positions = torch.arange(n_prefix, width, device=input_ids.device)[None].expand(rows, -1)
    tail = model.model(input_ids=input_ids[:, n_prefix:], past_key_values=cache, position_ids=positions,
                       use_cache=True)
    return head.last_hidden_state[0], tail.last_hidden_state
