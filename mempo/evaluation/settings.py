"""The settings of one evaluation and what the agents build from them: tool, rollout and
sampling configuration.

    from mempo.evaluation.settings import EvalSettings, sampling_params
    settings = EvalSettings.from_params(load_params("params.yaml").eval)
    env = ToolEnv(retriever, tokenizer, settings.tool_config())
    sampling_params(settings)          # greedy unless eval.rollout.temperature > 0
    generator_policy(settings, generator)   # the TurnPolicy the multi-turn agents run

The `mempo eval` stage builds them from its `eval:` section; the GRPO trainer's periodic
validation builds them from the training episodes' (`mempo.training.grpo.val_settings`), so
both run episodes through the same code with the limits each stage asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EvalSettings:
    """The knobs of one evaluation: its episode settings and the eval-only ones.

    It has no defaults of its own (the one source is `mempo.config`); build it with
    `from_params`.

    Attributes:
        rollout: the resolved episode settings (`RolloutParams`: `rollout:` with
            `eval.rollout` over it): turn budget (`turns_per_objective` per objective,
            capped at `max_turns`), `max_prompt_tokens` (an episode whose next prompt is
            longer stops there, truncated and scored wrong; 0 = no limit),
            `max_concurrent_episodes`, `max_new_tokens`, `observation_max_tokens`,
            `temperature` (0 = greedy), tools.
        seed, memory_probe, external_memory_encoder, external_memory_snippets: as `eval:`.
    """

    rollout: Any
    seed: int
    memory_probe: bool
    external_memory_encoder: str
    external_memory_snippets: int

    @classmethod
    def from_params(cls, p: Any, rollout: Any | None = None) -> EvalSettings:
        """From an `EvalParams`; `rollout` (a `RolloutParams`) replaces its resolved
        `p.rollout_params()` (the GRPO trainer's validation runs the training episodes)."""
        return cls(rollout=rollout if rollout is not None else p.rollout_params(), seed=p.seed,
                   memory_probe=p.memory_probe, external_memory_encoder=p.external_memory_encoder,
                   external_memory_snippets=p.external_memory_snippets)

    def describe(self) -> dict[str, Any]:
        """A JSON-able view (eval.json)."""
        return {**self.rollout.model_dump(mode="json"), "seed": self.seed, "memory_probe": self.memory_probe,
                "external_memory_encoder": self.external_memory_encoder,
                "external_memory_snippets": self.external_memory_snippets}

    def tool_config(self) -> Any:
        """The tool settings: passages per search, observation cut, `<access>` chunking."""
        from mempo.agent.tools import ToolConfig

        return ToolConfig.from_params(self.rollout)

    def rollout_config(self) -> Any:
        """The rollout limits: `turns_per_objective` per objective, capped at `max_turns`."""
        from mempo.agent.rollout import RolloutConfig

        return RolloutConfig.from_params(self.rollout)


def generator_policy(settings: EvalSettings, generator: Any, max_batch: int | None = None) -> Any:
    """The evaluation's `TurnPolicy` over `generator`: `sampling_params`, turns of up to
    `max_batch` episodes batched (default `max_concurrent_episodes`), and a repeated prompt
    sampled at `repeat_temperature` (see `mempo.agent.rollout.GeneratorPolicy`)."""
    from mempo.agent.rollout import GeneratorPolicy

    return GeneratorPolicy(generator, sampling_params(settings),
                           max_batch=max_batch or settings.rollout.max_concurrent_episodes,
                           repeat_temperature=settings.rollout.repeat_temperature, seed=settings.seed)


def sampling_params(settings: EvalSettings, stop: Sequence[str] | None = None) -> Any:
    """Generation settings for evaluation: greedy unless `temperature` > 0 (then seeded)."""
    from mempo.agent.generation import SamplingParams

    kw: dict[str, Any] = dict(
        max_new_tokens=settings.rollout.max_new_tokens,
        temperature=settings.rollout.temperature,
        seed=settings.seed if settings.rollout.temperature > 0 else None,
        logprobs=False,
    )
    if stop is not None:
        kw["stop"] = tuple(stop)
    return SamplingParams(**kw)
