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
  prompt, padding and retrieved-passage positions get none.

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


def logits_at(model: Any, input_ids: Any, attention_mask: Any, where: Any) -> Any:
    """Logits at the positions where `where` ([B, T] bool) is True, [N, V] in row-major order,
    in the model's dtype. A right-padded batch needs no position ids (they are 0..n-1 per row);
    a left-padded one gets them from the mask."""
    if right_padded(attention_mask):
        kwargs: dict[str, Any] = {"attention_mask": None}
    else:
        kwargs = {"attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)}
    if has_plain_head(model):
        hidden = model.model(input_ids=input_ids, **kwargs).last_hidden_state
        return model.lm_head(hidden[where])
    return model(input_ids=input_ids, **kwargs).logits[where]
