"""The settings of one evaluation and what the agents build from them: tool, rollout and
sampling configuration.

    from mempo.evaluation.settings import EvalSettings, sampling_params
    settings = EvalSettings.from_params(load_params("params.yaml").eval)
    env = ToolEnv(retriever, tokenizer, settings.tool_config())
    sampling_params(settings)          # greedy unless eval.temperature > 0

The `mempo eval` stage builds them from its `eval:` section; the GRPO trainer's periodic
validation builds them from `agent:` + `train:` (`mempo.training.grpo.val_settings`), so
both run episodes through the same code with the limits each stage asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass
class EvalSettings:
    """The knobs of one evaluation (the `eval:` params section, minus model/benchmark choice).

    Attributes:
        max_turns: turns per objective; a k-objective task gets `min(k * max_turns, max_turns_cap)`.
        max_prompt_tokens: the eval-time context window: an episode whose next prompt is
            longer stops there, is recorded as truncated and scored as wrong.
        max_new_tokens: tokens generated per turn.
        max_obs_tokens: a tool result is cut to this many tokens before it enters a prompt.
        temperature: 0 = greedy.
        access_chunk_chars, short_text_chars, check_masks: as `agent:` (`ToolConfig`,
            `RolloutConfig`); `eval:` has no such keys, so the stage keeps their defaults.
    """

    concurrency: int = 16
    max_prompt_tokens: int = 4096
    seed: int = 0
    max_turns: int = 6
    max_turns_cap: int = 64
    topk: int = 3
    max_new_tokens: int = 160
    max_obs_tokens: int = 256
    temperature: float = 0.0
    memory_probe: bool = True
    external_memory_encoder: str = "hashing"
    external_memory_snippets: int = 3
    access_chunk_chars: int = 1000
    short_text_chars: int = 100
    check_masks: bool = True

    @classmethod
    def from_params(cls, p: Any) -> EvalSettings:
        """From an `EvalParams` (or anything with the same attributes); fields it lacks keep
        their defaults."""
        return cls(**{f.name: getattr(p, f.name) for f in fields(cls) if hasattr(p, f.name)})

    def tool_config(self) -> Any:
        """The tool settings: passages per search, observation cut, `<access>` chunking."""
        from mempo.agent.tools import ToolConfig

        return ToolConfig(topk=self.topk, observation_max_tokens=self.max_obs_tokens,
                          access_chunk_chars=self.access_chunk_chars, short_text_chars=self.short_text_chars)

    def rollout_config(self) -> Any:
        """The rollout limits: `max_turns` per objective, capped at `max_turns_cap`."""
        from mempo.agent.rollout import RolloutConfig

        return RolloutConfig(max_turns=self.max_turns_cap, turns_per_objective=self.max_turns,
                             max_prompt_tokens=self.max_prompt_tokens,
                             max_concurrent_episodes=self.concurrency, check_masks=self.check_masks)


def sampling_params(settings: EvalSettings, stop: Sequence[str] | None = None) -> Any:
    """Generation settings for evaluation: greedy unless `temperature` > 0 (then seeded)."""
    from mempo.agent.generation import SamplingParams

    kw: dict[str, Any] = dict(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        seed=settings.seed if settings.temperature > 0 else None,
        logprobs=False,
    )
    if stop is not None:
        kw["stop"] = tuple(stop)
    return SamplingParams(**kw)
