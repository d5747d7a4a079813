"""`algorithm.adv_estimator=mempo`: MemPO's outcome advantage in verl's estimator registry.

A registered estimator in verl 0.9.1 only receives `token_level_rewards`, `response_mask`,
`index` (uid) and `config`: it cannot see the agent loop's per-turn memory masks and
memory rewards. So this estimator is the A^T part (GRPO over the rows it is given, via
`mempo.advantage.grpo_outcome_advantage`); the full MemPO advantage (episode-level A^T +
lambda_mem * A^M on `<mem>` tokens) is computed by the `mempo_sync` trainer, which
recognises this estimator name and never calls verl's generic path for it. Selecting the
estimator with another trainer therefore gives GRPO on the outcome reward only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from verl.trainer.ppo.core_algos import register_adv_est

from mempo.advantage import grpo_outcome_advantage
from mempo.verl_plugin import ADV_ESTIMATOR_NAME


@register_adv_est(ADV_ESTIMATOR_NAME)
def mempo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A^T broadcast over the response tokens: (advantages, returns), both [B, L].

    Args:
        token_level_rewards: [B, L]; each row's score is its sum.
        response_mask: [B, L], 1 on generated tokens.
        index: [B] prompt uids (the GRPO groups).
        epsilon: added to the group std.
        norm_adv_by_std_in_grpo: divide by the group std (verl's flag; `config` wins).
        config: verl's AlgoConfig (its `norm_adv_by_std_in_grpo` is used when present).
    """
    norm = bool(getattr(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)) if config is not None \
        else norm_adv_by_std_in_grpo
    scores = token_level_rewards.sum(dim=-1)
    a_t = grpo_outcome_advantage(scores, list(index), norm_by_std=norm, eps=epsilon)
    adv = a_t.to(token_level_rewards.dtype)[:, None] * response_mask
    return adv, adv
