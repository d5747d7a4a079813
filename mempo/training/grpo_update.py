"""The GRPO update maths: turn records to per-token advantages, and the clipped-surrogate step.

    samples = build_turn_samples(episodes, group_ids, rewards, memory_rewards, lambda_mem, mempo)
    samples = merge_turn_samples(samples)            # full history: one record per episode run
    fill_logprobs(model, samples, pad_id, temperature, "old_logp")
    stats = update_policy(model, optimizer, samples, ...)

Pure functions of the episodes and the model (no files, no tracking, no rollouts), so the
advantage and loss rules have one home that tests (and the verl parity test) check against;
`mempo.training.grpo` is the stage around them (tasks, rollouts, checkpoints, metrics).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def sample_std(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@dataclass
class TurnSample:
    """One turn record ready for the update.

    Attributes:
        episode: index of its episode in the step.
        prompt_ids, response_ids: token ids.
        advantages: per response token, [n].
        weight: loss weight of each of its tokens (1 / (episodes x tokens of its episode)).
        old_logp, ref_logp: per response token, [n] (filled before the update).
        loss_mask: per response token, [n]: 1 where the token is the policy's, 0 on the
            observations between the turns of a merged record (`merge_turn_samples`);
            None = all 1.
    """

    episode: int
    prompt_ids: list[int]
    response_ids: list[int]
    advantages: list[float]
    weight: float
    old_logp: list[float] | None = None
    ref_logp: list[float] | None = None
    loss_mask: list[float] | None = None

    def token_weights(self, scale: float = 1.0) -> list[float]:
        w = self.weight * scale
        return [w * m for m in self.loss_mask] if self.loss_mask is not None else [w] * len(self.response_ids)


def episode_memory_advantage(episodes: Sequence[Any], group_ids: Sequence[str], memory_rewards: Any,
                             mempo: Any) -> Any:
    """A^M of every turn record of `episodes` (episode / turn order) from their R^M, normalised
    within (task, turn index) with `mempo`'s options, `final_memory` included: float tensor [M]."""
    from mempo.advantage import final_memory_flags, memory_advantage

    rec_episode = [e for e, ep in enumerate(episodes) for _ in ep.turns]
    rec_turn = [t.turn_index for ep in episodes for t in ep.turns]
    answered = [episodes[e].final_answer is not None for e in rec_episode]
    return memory_advantage(memory_rewards, [group_ids[e] for e in rec_episode], rec_turn, mempo.norm_by_std,
                            mempo.mem_adv_group, mempo.adv_eps, mempo.mem_adv_min_std,
                            **final_memory_flags(mempo.final_memory, rec_episode, rec_turn, answered))


def build_turn_samples(
    episodes: Sequence[Any],
    group_ids: Sequence[str],
    outcome_rewards: Sequence[float],
    memory_rewards: Any,
    lambda_mem: float,
    mempo: Any,
) -> tuple[list[TurnSample], dict[str, Any]]:
    """Advantages for every turn record of a step, from the core advantage functions.

    Args:
        episodes: the step's episodes (`mempo.agent.rollout.Episode`), E of them.
        group_ids: the task id of each episode (its GRPO group), length E.
        outcome_rewards: R^T per episode, length E.
        memory_rewards: R^M per turn record in episode/turn order, tensor [M] (or None
            when lambda_mem == 0 and scoring was skipped).
        lambda_mem: weight of A^M on `<mem>` tokens.
        mempo: `mempo.config.MempoParams` (normalisation options).
    Returns:
        (turn samples, {"A_T": [E], "A_M": [M], "turn_index": [M]}).
    """
    import torch

    from mempo.advantage import combine, grpo_outcome_advantage

    a_t = grpo_outcome_advantage(list(outcome_rewards), list(group_ids), mempo.norm_by_std, mempo.adv_eps)
    rec_turn = [t.turn_index for ep in episodes for t in ep.turns]
    if memory_rewards is None:
        a_m = torch.zeros(len(rec_turn))
    else:
        a_m = episode_memory_advantage(episodes, group_ids, memory_rewards, mempo)
    tokens_per_episode = [sum(len(t.response_ids) for t in ep.turns) for ep in episodes]
    n_eps = len(episodes)
    samples: list[TurnSample] = []
    k = 0
    for e, ep in enumerate(episodes):
        for t in ep.turns:
            n = len(t.response_ids)
            if n:
                adv = combine(a_t[e:e + 1], a_m[k:k + 1], torch.tensor([t.mem_mask], dtype=torch.float32),
                              lambda_mem)[0]
                samples.append(TurnSample(
                    episode=e, prompt_ids=list(t.prompt_ids), response_ids=list(t.response_ids),
                    advantages=adv.tolist(), weight=1.0 / (n_eps * max(tokens_per_episode[e], 1)),
                ))
            k += 1
    return samples, {"A_T": a_t, "A_M": a_m, "turn_index": rec_turn}


def merge_turn_samples(samples: Sequence[TurnSample]) -> list[TurnSample]:
    """Merge consecutive records of one episode whose token ids extend each other (each
    record's prompt + response is a prefix of the next record's prompt): the turns of a
    full-history episode. The merged record keeps the first prompt; its "response" is the
    rest of the last turn's sequence, with the policy's tokens under `loss_mask` 1 and their
    advantages, and the observations between them masked out. Causal attention gives every
    policy token the log-prob it has in its own record, so the loss is unchanged and an
    episode of T turns is one forward pass instead of T over growing prefixes. Memory-context
    records never extend each other and come back as they are.
    """
    from mempo.training.prefix import chained_runs

    def extends(prev: TurnSample, smp: TurnSample) -> bool:
        n = len(prev.prompt_ids)
        return (smp.episode == prev.episode and smp.weight == prev.weight and smp.loss_mask is None
                and len(smp.prompt_ids) >= n + len(prev.response_ids)
                and smp.prompt_ids[:n] == prev.prompt_ids
                and smp.prompt_ids[n:n + len(prev.response_ids)] == prev.response_ids)

    out: list[TurnSample] = []
    for run in chained_runs(samples, extends):
        if len(run) == 1:
            out.append(run[0])
            continue
        first, last = run[0], run[-1]
        seq = last.prompt_ids + last.response_ids
        n0 = len(first.prompt_ids)
        adv = [0.0] * (len(seq) - n0)
        mask = [0.0] * (len(seq) - n0)
        for smp in run:
            a = len(smp.prompt_ids) - n0
            adv[a:a + len(smp.response_ids)] = smp.advantages
            mask[a:a + len(smp.response_ids)] = [1.0] * len(smp.response_ids)
        out.append(TurnSample(first.episode, list(first.prompt_ids), seq[n0:], adv, first.weight, loss_mask=mask))
    return out


def _micro_batches(samples: Sequence[TurnSample], size: int, token_budget: int) -> list[list[int]]:
    """Indices grouped by length (less padding), at most `size` records and about
    `token_budget` padded tokens per micro-batch."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].response_ids))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = len(samples[i].prompt_ids) + len(samples[i].response_ids)
        if cur and (len(cur) >= size or width * (len(cur) + 1) > token_budget):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def fill_logprobs(model: Any, samples: Sequence[TurnSample], pad_id: int, temperature: float,
                  attr: str, micro_batch: int, token_budget: int, device: Any) -> None:
    """Set `samples[i].<attr>` to the model's response-token log-probs (no grad)."""
    import torch

    from mempo.training.losses import pack_turns, response_logprobs

    with torch.no_grad():
        for idx in _micro_batches(samples, micro_batch, token_budget):
            batch = pack_turns([samples[i].prompt_ids for i in idx], [samples[i].response_ids for i in idx],
                               pad_id).to(device)
            logp, _ = response_logprobs(model, batch, temperature)
            for r, i in enumerate(idx):
                setattr(samples[i], attr, logp[r, :len(samples[i].response_ids)].float().cpu().tolist())


def update_policy(
    model: Any, optimizer: Any, samples: Sequence[TurnSample], pad_id: int, tp: Any,
    temperature: float, device: Any,
) -> dict[str, float]:
    """`tp.update_epochs` passes of `tp.num_minibatches` optimiser steps over `samples`
    (clipped surrogate + kl_coef * low_var_kl; see the module docstring). Returns means of
    loss, pg_loss, kl, entropy, clip_frac, grad_norm over the optimiser steps."""
    import torch

    from mempo.training.losses import (
        clipped_surrogate,
        low_var_kl,
        pack_turns,
        pad_rows,
        response_logprobs,
    )

    stats: dict[str, list[float]] = defaultdict(list)
    n = len(samples)
    mb = max(1, tp.num_minibatches)
    for _ in range(tp.update_epochs):
        # Minibatches are fixed slices of a length-sorted order (deterministic), each
        # re-weighted so its weights sum like a full batch's share.
        order = list(range(n))
        for j in range(mb):
            part = order[j::mb]
            if not part:
                continue
            scale = mb  # each minibatch holds ~1/mb of the total weight
            optimizer.zero_grad(set_to_none=True)
            sums = defaultdict(float)
            weight_total = sum(sum(samples[i].token_weights()) for i in part) * scale
            for idx_local in _micro_batches([samples[i] for i in part], tp.micro_batch_size, tp.token_budget):
                idx = [part[i] for i in idx_local]
                batch = pack_turns([samples[i].prompt_ids for i in idx], [samples[i].response_ids for i in idx],
                                   pad_id).to(device)
                L = batch.mask.shape[1]
                logp, ent = response_logprobs(model, batch, temperature, with_entropy=True)
                adv = pad_rows([samples[i].advantages for i in idx], L).to(device)
                w = pad_rows([samples[i].token_weights(scale) for i in idx], L).to(device) * batch.mask
                old = (pad_rows([samples[i].old_logp for i in idx], L).to(device)
                       if samples[idx[0]].old_logp is not None else logp.detach())
                pg, pg_stats = clipped_surrogate(logp, old, adv, w, tp.clip_ratio_low, tp.clip_ratio_high)
                loss = pg
                kl_sum = torch.zeros((), device=device)
                if samples[idx[0]].ref_logp is not None:
                    ref = pad_rows([samples[i].ref_logp for i in idx], L).to(device)
                    kl_sum = (low_var_kl(logp, ref) * w).sum()
                    if tp.kl_coef > 0:
                        loss = loss + tp.kl_coef * kl_sum
                ent_sum = (ent * w).sum() if ent is not None else torch.zeros((), device=device)
                loss.backward()
                sums["loss"] += float(loss.detach())
                sums["pg_loss"] += float(pg.detach())
                sums["kl"] += float(kl_sum.detach())
                sums["entropy"] += float(ent_sum)
                wsum = float(w.sum())
                sums["clip_frac"] += pg_stats["clip_frac"] * wsum
                sums["ratio_mean"] += pg_stats["ratio_mean"] * wsum
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tp.grad_clip))
            optimizer.step()
            stats["grad_norm"].append(grad_norm)
            denom = max(weight_total, 1e-12)
            # loss sums are already weighted means (weights sum to ~1 per minibatch)
            for k in ("loss", "pg_loss"):
                stats[k].append(sums[k])
            for k in ("kl", "entropy", "clip_frac", "ratio_mean"):
                stats[k].append(sums[k] / denom)
    return {k: mean(v) for k, v in stats.items()}
