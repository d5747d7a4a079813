"""Rollout health on the verl path: the failures that would otherwise train on quietly.

Two failures do not stop a verl step by themselves:
- a retriever the workers cannot reach: every `<search>` becomes a "search failed"
  observation (`RetrievalTool.execute`), and the policy learns from a broken environment;
- an exception in an agent-loop session: verl 0.9.1 logs it, marks the prompt's group
  "failure" and trains on the sessions that finished, so GRPO groups shrink unnoticed.

`rollout_health` measures both on one training batch (turn rows keyed `{uid}_{session}_{turn}`
with the agent loop's `extra_fields`), and `check_rollout_health` raises when a rate passes
its limit, once there are enough calls / sessions to judge. The `mempo_sync` trainer runs
both every step and logs the numbers as `mempo/*` metrics.

    health = rollout_health(keys, extra_fields, n_rollouts=5)
    check_rollout_health(health, HealthLimits(max_tool_failure_rate=0.2))
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from mempo.verl_plugin.advantage import parse_output_key


class RolloutHealthError(RuntimeError):
    """A training step's rollouts are too broken to learn from (see module docstring)."""


@dataclass(frozen=True)
class HealthLimits:
    """The Hydra `mempo:` keys that bound rollout failures (configs/verl/mempo_trainer.yaml)."""

    max_tool_failure_rate: float = 0.2
    max_failed_session_rate: float = 0.1
    min_health_samples: int = 32

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any] | None) -> HealthLimits:
        names = {f.name for f in fields(cls)}
        return cls(**{k: section[k] for k in names if section and k in section})


def rollout_health(
    keys: Sequence[str], extra_fields: Sequence[Mapping[str, Any] | None], n_rollouts: int,
    is_padding: Sequence[bool] | None = None, n_prompts: int = 0,
) -> dict[str, float]:
    """Health numbers of one batch of turn rows.

    Args:
        keys: verl's TransferQueue keys, `{uid}_{session}_{turn}`, one per row.
        extra_fields: the rows' agent-loop extra fields (`tool_called`, `tool_ok`,
            `logprobs_filled`).
        n_rollouts: sessions each prompt was rolled out with (`rollout.n`).
        is_padding: rows verl added to fill the batch (ignored).
        n_prompts: prompts the step sampled (a prompt whose every session failed has no row
            at all); 0 = count the prompts seen.
    Returns:
        `mempo/tool_calls`, `mempo/tool_failures`, `mempo/tool_failure_rate`, `mempo/prompts`,
        `mempo/sessions`, `mempo/failed_sessions` (expected n x prompts minus the sessions
        present), `mempo/failed_session_rate`, `mempo/turns_per_episode`,
        `mempo/logprobs_filled` (response tokens with no rollout log-prob, filled with 0).
    """
    sessions: dict[str, set[str]] = defaultdict(set)
    rows = calls = failures = filled = 0
    for i, (key, extra) in enumerate(zip(keys, extra_fields, strict=True)):
        if is_padding is not None and is_padding[i]:
            continue
        uid, session, _ = parse_output_key(key)
        sessions[uid].add(session)
        rows += 1
        extra = extra or {}
        if extra.get("tool_called"):
            calls += 1
            failures += 0 if extra.get("tool_ok", True) else 1
        filled += int(extra.get("logprobs_filled", 0) or 0)
    present = sum(len(s) for s in sessions.values())
    expected = n_rollouts * max(n_prompts, len(sessions))
    missing = max(0, expected - present)
    return {
        "mempo/tool_calls": float(calls),
        "mempo/tool_failures": float(failures),
        "mempo/tool_failure_rate": failures / calls if calls else 0.0,
        "mempo/prompts": float(max(n_prompts, len(sessions))),
        "mempo/sessions": float(present),
        "mempo/failed_sessions": float(missing),
        "mempo/failed_session_rate": missing / expected if expected else 0.0,
        "mempo/turns_per_episode": rows / present if present else 0.0,
        "mempo/logprobs_filled": float(filled),
    }


def check_rollout_health(health: Mapping[str, float], limits: HealthLimits) -> None:
    """Raise RolloutHealthError when a failure rate passes its limit (over enough samples)."""
    problems = []
    calls = health["mempo/tool_calls"]
    if calls >= limits.min_health_samples and health["mempo/tool_failure_rate"] > limits.max_tool_failure_rate:
        problems.append(
            f"{health['mempo/tool_failures']:.0f} of {calls:.0f} retrieval calls failed "
            f"(rate {health['mempo/tool_failure_rate']:.2f} > max_tool_failure_rate {limits.max_tool_failure_rate}): "
            "is the retriever reachable from every node, and not overloaded?")
    expected = health["mempo/sessions"] + health["mempo/failed_sessions"]
    if expected >= limits.min_health_samples and health["mempo/failed_session_rate"] > limits.max_failed_session_rate:
        problems.append(
            f"{health['mempo/failed_sessions']:.0f} of {expected:.0f} rollout sessions are missing "
            f"(rate {health['mempo/failed_session_rate']:.2f} > max_failed_session_rate "
            f"{limits.max_failed_session_rate}): see the agent-loop workers' 'Error in _run_prompt' logs")
    if problems:
        raise RolloutHealthError("; ".join(problems) + " (the last checkpoint is kept; resume_mode=auto continues "
                                 "from it once this is fixed)")
