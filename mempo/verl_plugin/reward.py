"""verl's `reward.custom_reward_function` for MemPO: R^T from the episode's structured outcome.

    reward:
      custom_reward_function:
        path: pkg://mempo.verl_plugin.reward
        name: compute_score

verl 0.9's reward loop scores a multi-output trajectory on its LAST output, and passes that
output's `extra_fields` on inside `extra_info` (`AgentLoopWorker._compute_score` ->
`tool_extra_fields` -> the reward manager's `extra_info.update(...)`). `MemAgentLoop` writes
the episode's final answer and format validity there (`FINAL_ANSWER_KEY`,
`FORMAT_VALID_KEY`), decided by the same turn step as the local trainer
(`mempo.agent.step`), so nothing is parsed again here and R^T is the local trainer's
(`mempo.rewards.episode_score`). A row without them (an agent other than `mem_agent`) is
scored from its decoded response by `mempo.rewards.compute_score`. Reward kwargs
(`multi_rule`, `format_rule`, `format_penalty`, `no_answer_penalty`) come from
`reward.custom_reward_function.reward_kwargs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mempo.rewards import compute_score as score_text
from mempo.rewards import episode_score

FINAL_ANSWER_KEY = "mempo_final_answer"
FORMAT_VALID_KEY = "mempo_format_valid"
TERMINATION_KEY = "mempo_termination"


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str | Sequence[str] | dict[str, Any],
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """R^T of one episode (1/0, or with a format penalty), verl's reward-function signature.

    Example: `extra_info={"mempo_final_answer": "Paris", "mempo_format_valid": True}` with
    ground_truth `["Paris"]` -> 1.0; with `"mempo_format_valid": False` -> 0.0 under
    format_rule=strict.
    """
    info = extra_info or {}
    if FORMAT_VALID_KEY in info:
        answer = info.get(FINAL_ANSWER_KEY)
        return float(episode_score(None if answer is None else str(answer), bool(info[FORMAT_VALID_KEY]),
                                   ground_truth, info, **kwargs))
    return float(score_text(data_source, solution_str, ground_truth, info, **kwargs))
