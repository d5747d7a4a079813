"""The verl trainer's MemPO advantage step, as a pure function over a flattened batch.

verl 0.9's multi-trajectory agent loops put one row per TURN in the batch, keyed
`{uid}_{session_id}_{turn}` (uid: the prompt; session_id: which of the n rollouts). MemPO
needs, per row:

- A^T: GRPO over EPISODES (one outcome score per multi-turn trajectory, grouped by prompt
  uid), broadcast to every turn row of the episode;
- A^M: the memory reward of that turn, normalised within (prompt group, turn index),
  added with weight lambda_mem on the `<mem>` tokens only.

All maths is `mempo.advantage` (the same functions the local trainer calls); this module
only regroups verl's rows into episodes and turns. `MempoTrainerSync._compute_advantage`
fetches the tensors from TransferQueue and calls `mempo_advantages`.

    adv, metrics = mempo_advantages(keys, uids, token_level_rewards, response_mask,
                                    mem_mask, mem_scores, turn_index, MempoAdvantageConfig())
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from mempo.advantage import (
    EpsMode,
    FinalMemoryMode,
    MemGroupMode,
    RewardForm,
    combine,
    final_memory_flags,
    grpo_outcome_advantage,
    memory_advantage,
    memory_reward_from_scores,
)
from mempo.config.base import default_of
from mempo.config.episodes import MempoParams


@dataclass(frozen=True)
class MempoAdvantageConfig:
    """MemPO's advantage settings (the Hydra `mempo:` section of configs/verl/mempo_trainer.yaml,
    which the launcher fills from params.yaml `mempo:`).

    Attributes:
        lambda_mem: weight of A^M on `<mem>` tokens.
        eps: memory-reward baseline: previous | full_context | none.
        form: prob (geometric-mean probability) | logprob (mean log-probability).
        norm_by_std: divide A^T and A^M by the group std.
        mem_adv_group: per_turn | per_group normalisation of A^M.
        adv_eps: added to the std.
        mem_adv_min_std: floor of the std that divides A^M (see `mempo.advantage.memory_advantage`).
        final_memory: score | skip (each episode's last turn row gets no A^M) | closing (the last
            rows of episodes that answered normalised among their task's; needs `answered`).
        rm_max: upper bound of R^M (None = none; 0 with eps full_context: a retention penalty).
    """

    lambda_mem: float = default_of(MempoParams, "lambda_mem")
    eps: EpsMode = default_of(MempoParams, "eps")
    form: RewardForm = default_of(MempoParams, "form")
    norm_by_std: bool = default_of(MempoParams, "norm_by_std")
    mem_adv_group: MemGroupMode = default_of(MempoParams, "mem_adv_group")
    adv_eps: float = default_of(MempoParams, "adv_eps")
    mem_adv_min_std: float = default_of(MempoParams, "mem_adv_min_std")
    final_memory: FinalMemoryMode = default_of(MempoParams, "final_memory")
    rm_max: float | None = default_of(MempoParams, "rm_max")

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any] | None) -> MempoAdvantageConfig:
        """Build from a mapping (e.g. the Hydra `mempo` DictConfig); unknown keys are ignored
        because the same section also holds the agent loop's settings."""
        if not section:
            return cls()
        names = {f.name for f in fields(cls)}
        return cls(**{k: section[k] for k in names if k in section})


def parse_output_key(key: str) -> tuple[str, str, int]:
    """Split verl's TransferQueue key `{uid}_{session_id}_{index}` into (uid, session_id, index).

    uids may themselves contain underscores; the last two fields never do.
    """
    parts = str(key).rsplit("_", 2)
    if len(parts) != 3 or not parts[2].lstrip("-").isdigit():
        raise ValueError(f"unexpected verl output key {key!r} (want uid_session_index)")
    return parts[0], parts[1], int(parts[2])


def mempo_advantages(
    batch_keys: Sequence[str],
    uids: Sequence[Any],
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    mem_mask: torch.Tensor,
    mem_scores: torch.Tensor,
    turn_index: torch.Tensor,
    config: MempoAdvantageConfig,
    full_context_scores: torch.Tensor | None = None,
    is_padding: Sequence[bool] | None = None,
    answered: Sequence[bool] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token MemPO advantages for a batch of turn rows.

    Args:
        batch_keys: B TransferQueue keys `{uid}_{session}_{turn}`.
        uids: B prompt ids (the GRPO group of each row).
        token_level_rewards: [B, L]; the episode's outcome score R^T is the sum over the
            episode's LAST turn row (verl copies the score to every turn row).
        response_mask: [B, L], 1 on generated tokens.
        mem_mask: [B, L], 1 on the tokens inside that turn's `<mem>` span.
        mem_scores: [B], S(a* | q, mem_t): P (form=prob) or mean log P (form=logprob).
        turn_index: [B], the turn number of each row within its episode.
        config: lambda_mem, eps, normalisation.
        full_context_scores: [B], S(a* | full history up to turn t) (eps=full_context).
        is_padding: B flags for verl's synthetic padding rows (they get 0 advantage).
        answered: B flags, True on a row that carries its episode's final answer (the agent loop
            writes it on the last row); needed with final_memory closing, where only episodes
            that answered close.
    Returns:
        (advantages [B, L] float32, metrics) where metrics holds means of A^T, A^M, R^M.
    """
    b = len(batch_keys)
    if not (len(uids) == b == token_level_rewards.shape[0] == mem_scores.shape[0] == turn_index.shape[0]):
        raise ValueError("batch_keys, uids, rewards, mem_scores and turn_index must have the same length")
    pad = [bool(p) for p in is_padding] if is_padding is not None else [False] * b

    # 1. episodes: {uid}_{session}; the outcome score is read on the last turn row.
    episode_of_row: list[str] = []
    last_row: dict[str, tuple[int, int]] = {}
    episode_uid: dict[str, Any] = {}
    for row, key in enumerate(batch_keys):
        _, session, index = parse_output_key(key)
        episode = f"{uids[row]}_{session}"
        episode_of_row.append(episode)
        episode_uid[episode] = uids[row]
        if episode not in last_row or last_row[episode][0] < index:
            last_row[episode] = (index, row)
    episodes = list(last_row)
    row_scores = token_level_rewards.sum(dim=-1)
    scores = row_scores[torch.tensor([last_row[e][1] for e in episodes], dtype=torch.long)]
    a_t_episode = grpo_outcome_advantage(
        scores, [episode_uid[e] for e in episodes], norm_by_std=config.norm_by_std, eps=config.adv_eps)
    position = {e: i for i, e in enumerate(episodes)}
    a_t = a_t_episode[[position[e] for e in episode_of_row]]

    # 2. memory reward and advantage per turn row (padding rows excluded from the statistics).
    real = [r for r in range(b) if not pad[r]]
    a_m = torch.zeros(b, dtype=torch.float32)
    r_m = torch.zeros(b, dtype=torch.float32)
    if real:
        idx = torch.tensor(real, dtype=torch.long)
        full = full_context_scores[idx] if full_context_scores is not None else None
        r_m_real = memory_reward_from_scores(
            mem_scores[idx], [episode_of_row[r] for r in real], turn_index[idx], config.eps, full, config.rm_max)
        a_m_real = memory_advantage(
            r_m_real, [uids[r] for r in real], turn_index[idx],
            norm_by_std=config.norm_by_std, group=config.mem_adv_group, eps=config.adv_eps,
            min_std=config.mem_adv_min_std,
            **final_memory_flags(config.final_memory, [episode_of_row[r] for r in real], turn_index[idx],
                                 _episode_answered(answered, episode_of_row, last_row, real)))
        r_m[idx] = r_m_real
        a_m[idx] = a_m_real

    keep = torch.tensor([0.0 if p else 1.0 for p in pad])[:, None]
    mask = mem_mask.to(torch.float32) * response_mask.to(torch.float32) * keep
    adv = combine(a_t, a_m, mask, lambda_mem=config.lambda_mem, response_mask=response_mask * keep)
    n_real = max(len(real), 1)
    metrics = {
        "mempo/outcome_score/mean": float(scores.mean()) if len(scores) else 0.0,
        "mempo/outcome_adv/mean": float(a_t[real].mean()) if real else 0.0,
        "mempo/memory_reward/mean": float(r_m.sum() / n_real),
        "mempo/memory_adv/abs_mean": float(a_m.abs().sum() / n_real),
        "mempo/mem_tokens/mean": float(mask.sum() / n_real),
        "mempo/episodes": float(len(episodes)),
    }
    return adv, metrics


def _episode_answered(answered: Sequence[bool] | None, episode_of_row: Sequence[str],
                      last_row: Mapping[str, tuple[int, int]], rows: Sequence[int]) -> list[bool] | None:
    """For each of `rows`: whether its episode's last row is flagged `answered` (None: unknown)."""
    if answered is None:
        return None
    if len(answered) != len(episode_of_row):
        raise ValueError(f"answered has {len(answered)} flags for {len(episode_of_row)} rows")
    return [bool(answered[last_row[episode_of_row[r]][1]]) for r in rows]


def mem_tensors_from_extra_fields(
    extra_fields: Sequence[Mapping[str, Any] | None],
    width: int,
    form: RewardForm = "prob",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Turn the agent loop's per-row `extra_fields` into tensors for `mempo_advantages`.

    Each row's extra_fields (written by `MemAgentLoop`) holds `mem_mask` (list[int] over its
    response tokens), `turn_index`, `mem_prob` / `mem_logprob` and, with eps=full_context,
    `full_prob` / `full_logprob`. Rows without them (e.g. verl's padding rows) get zeros.

    Returns:
        (mem_mask [B, width] int64 right-padded like verl's responses, mem_scores [B],
        turn_index [B] int64, full_context_scores [B] or None).
    """
    key = "mem_prob" if form == "prob" else "mem_logprob"
    full_key = "full_prob" if form == "prob" else "full_logprob"
    # one numpy buffer and plain lists, one tensor each at the end (per-row tensors are slow)
    masks = np.zeros((len(extra_fields), width), dtype=np.int64)
    scores: list[float] = []
    full: list[float] = []
    turns: list[int] = []
    have_full = False
    for r, ef in enumerate(extra_fields):
        ef = ef or {}
        m = list(ef.get("mem_mask") or [])[:width]
        if m:
            masks[r, : len(m)] = m
        scores.append(float(ef.get(key, 0.0) or 0.0))
        turns.append(int(ef.get("turn_index", 0) or 0))
        has = ef.get(full_key) is not None
        have_full = have_full or has
        full.append(float(ef[full_key]) if has else 0.0)
    return (
        torch.from_numpy(masks),
        torch.tensor(scores, dtype=torch.float32),
        torch.tensor(turns, dtype=torch.long),
        torch.tensor(full, dtype=torch.float32) if have_full else None,
    )
