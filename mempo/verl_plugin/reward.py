"""verl's `reward.custom_reward_function` for MemPO: the core `mempo.rewards.compute_score`.

    reward:
      custom_reward_function:
        path: pkg://mempo.verl_plugin.reward
        name: compute_score

verl 0.9's reward loop scores a multi-output trajectory on its LAST output only, so the
`solution_str` it decodes is the final turn. MemPO's R^T also requires every earlier turn
to be well formed, so `MemAgentLoop` stores all turn texts in the last output's
`extra_fields["mempo_turn_texts"]`, which verl passes on inside `extra_info`. This wrapper
rejoins them and calls the core function; everything else (normalisation, multi-objective
rule, format rule) is `mempo.rewards`. Reward kwargs (`multi_rule`, `format_rule`,
`format_penalty`) come from `reward.custom_reward_function.reward_kwargs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mempo.rewards import compute_score as core_compute_score

TURN_TEXTS_KEY = "mempo_turn_texts"


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str | Sequence[str] | dict[str, Any],
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """R^T of one episode (1/0, or with a format penalty), verl's reward-function signature.

    Example: turns `["<mem> m </mem> <search> q </search>", "<mem> m2 </mem> <answer> Paris </answer>"]`
    in `extra_info["mempo_turn_texts"]` with ground_truth `["Paris"]` -> 1.0; if the first
    turn had no `<mem>`, 0.0 under format_rule=strict.
    """
    turns = (extra_info or {}).get(TURN_TEXTS_KEY)
    text = " ".join(str(t) for t in turns) if turns is not None and len(turns) else solution_str
    if hasattr(ground_truth, "tolist") and not isinstance(ground_truth, str | dict):
        ground_truth = ground_truth.tolist()
    return float(core_compute_score(data_source, text, ground_truth, extra_info, **kwargs))
