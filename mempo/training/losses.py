"""Token log-probabilities and the GRPO objective pieces (clipped surrogate, low_var_kl).

    batch = pack_turns(prompts, responses, pad_id)                   # right-padded
    logp, entropy = response_logprobs(model, batch, temperature=1.0)  # [m, L] each
    loss_sum, stats = clipped_surrogate(logp, old_logp, adv, weight, 0.2, 0.2)

Shapes: m turn records in a micro-batch, L = the longest response among them. Response
token j of record r sits at column j; `batch.mask` is 1 on real response tokens.
Losses are returned as weighted SUMS: the trainer gives each token the weight
1 / (episodes in the step x tokens in its episode), so summing over micro-batches gives the
token-mean per trajectory, averaged over trajectories, exactly as one big batch would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TurnBatch:
    """Right-padded prompt+response sequences of m turn records.

    Attributes:
        input_ids: [m, T] token ids (pad on the right).
        attention_mask: [m, T] 1 on real tokens.
        mask: [m, L] 1 on real response tokens (response token j at column j).
        response_lengths: [m] tokens per response.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    response_lengths: list[int]

    def to(self, device: Any) -> TurnBatch:
        return TurnBatch(self.input_ids.to(device), self.attention_mask.to(device), self.mask.to(device),
                         self.response_lengths)


def pack_turns(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int) -> TurnBatch:
    """Concatenate each prompt with its response and right-pad to the longest sequence (so
    `response_logprobs` runs without a mask: `mempo.training.forward.logits_at`)."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(len(s) for s in seqs)
    m = len(seqs)
    ids = torch.full((m, width), pad_id, dtype=torch.long)
    att = torch.zeros((m, width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        att[i, :len(s)] = 1
    lengths = [len(r) for r in responses]
    max_len = max(max(lengths), 1)
    mask = torch.zeros((m, max_len), dtype=torch.float32)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    return TurnBatch(ids, att, mask, lengths)


def pad_rows(rows: Sequence[Sequence[float]], width: int, value: float = 0.0) -> torch.Tensor:
    """Right-pad per-record float lists to [m, width]."""
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    for i, r in enumerate(rows):
        if len(r):
            out[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.float32)[:width]
    return out


def response_logprobs(
    model: Any, batch: TurnBatch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token | prefix) for every response token, [m, L] (0 on padding).

    Logits are computed at the response positions only, without a mask for the right-padded
    batch (`mempo.training.forward.logits_at`), so neither the LM head's cost nor the
    attention's padding grows with the prompt. Logits are divided by `temperature` (the
    rollout's sampling temperature, as verl does). With `with_entropy`, also the entropy of
    each predictive distribution, [m, L] (computed without grad).
    """
    from mempo.training.forward import logits_at

    m, width = batch.input_ids.shape
    L = batch.mask.shape[1]
    where = torch.zeros((m, width), dtype=torch.bool, device=batch.input_ids.device)
    targets = torch.zeros((m, L), dtype=torch.long, device=batch.input_ids.device)
    ends = batch.attention_mask.sum(-1).tolist()
    for r, n in enumerate(batch.response_lengths):
        if n:
            end = int(ends[r])  # response token j sits at end - n + j, predicted at end - n + j - 1
            where[r, end - n - 1:end - 1] = True
            targets[r, :n] = batch.input_ids[r, end - n:end]
    logits = logits_at(model, batch.input_ids, batch.attention_mask, where).float()  # [response tokens, V]
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    real = batch.mask.bool()  # row-major, as `where`: row r's response tokens in order
    logsm = logits.log_softmax(-1)
    lp = logsm.gather(-1, targets[real][:, None])[:, 0]
    logp = torch.zeros((m, L), dtype=lp.dtype, device=lp.device).masked_scatter(real, lp)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logsm.exp() * logsm).sum(-1)
            entropy = torch.zeros((m, L), dtype=ent.dtype, device=ent.device).masked_scatter(real, ent)
    return logp, entropy


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, clamped
    to [-10, 10] (verl's `low_var_kl`). Non-negative, unbiased, low variance. Shape of inputs."""
    diff = (ref_logp - logp).clamp(-20.0, 20.0)
    return (diff.exp() - diff - 1.0).clamp(-10.0, 10.0)


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate, as a weighted token sum (see module docstring).

    Args:
        logp: current log-probs, [m, L] (with grad).
        old_logp: log-probs of the sampling policy, [m, L].
        advantages: per-token advantages, [m, L].
        weights: per-token loss weights (0 on padding), [m, L].
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
    Returns:
        (loss: scalar tensor, {"clip_frac": fraction of weighted tokens clipped,
        "ratio_mean": mean ratio over real tokens}).
    """
    ratio = (logp - old_logp).clamp(-20.0, 20.0).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = (per_token * weights).sum()
    real = weights > 0
    n = max(int(real.sum()), 1)
    with torch.no_grad():
        was_clipped = (clipped > unclipped) & real
        stats = {"clip_frac": float(was_clipped.sum()) / n,
                 "ratio_mean": float((ratio * real).sum()) / n}
    return loss, stats
