"""Context builders: what the policy sees at each turn.

- `MemoryContext` (MemPO): system + question + the `<mem>` written at turn t-1 + the last
  action with its (truncated) observation. Nothing older: the prompt stays flat.
- `FullContext` (Search-R1 baseline): system + question + every earlier turn and
  observation as alternating assistant / user messages. Access results that are not from
  the last turn are shown in their short form (first ~100 characters of each chunk).

    ctx = MemoryContext("Who founded X?")
    msgs = ctx.messages()                      # turn 0: [system, user(question)]
    ctx.record_turn(response_text, parse_turn(response_text), "<information> ... </information>")
    msgs = ctx.messages()                      # turn 1: question + mem_0 + last action + result
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal

from mempo.agent.format import (
    SYSTEM_PROMPT,
    ParsedTurn,
    build_messages,
    build_user_content,
)

ContextKind = Literal["memory", "full"]

NO_VALID_ACTION = "(no valid action)"


@dataclass(frozen=True)
class PastTurn:
    """One finished turn as a context builder keeps it."""

    response_text: str
    parsed: ParsedTurn
    observation: str | None
    short_observation: str | None = None


class ContextBuilder(abc.ABC):
    """Holds one episode's context and renders the next turn's chat messages."""

    kind: ContextKind

    def __init__(self, question: str, system_prompt: str = SYSTEM_PROMPT) -> None:
        self.question = question
        self.system_prompt = system_prompt
        self.turns: list[PastTurn] = []

    def record_turn(
        self, response_text: str, parsed: ParsedTurn, observation: str | None,
        short_observation: str | None = None,
    ) -> None:
        """Add a finished turn: the model's response and the environment's observation
        (`short_observation`: the form shown once the turn is no longer the last one)."""
        self.turns.append(PastTurn(response_text, parsed, observation, short_observation))

    @abc.abstractmethod
    def messages(self) -> list[dict[str, str]]:
        """Chat messages for the next turn (ending with a user message)."""


class MemoryContext(ContextBuilder):
    """MemPO's flat context: only the previous turn's memory and its last action + result.

    The memory shown is exactly the `<mem>` of turn t-1 (empty when that turn wrote
    none: a forgotten memory is not silently repaired from older turns).
    """

    kind: ContextKind = "memory"

    def memory_slot(self) -> str:
        """What the prompt shows as the memory (after the first turn): the last `<mem>`."""
        return self.turns[-1].parsed.mem or ""

    def messages(self) -> list[dict[str, str]]:
        if not self.turns:
            return build_messages(self.question, system_prompt=self.system_prompt)
        last = self.turns[-1]
        action = last.parsed.action_text() if last.parsed.valid else NO_VALID_ACTION
        return build_messages(
            self.question,
            memory=self.memory_slot(),
            last_action=action,
            last_observation=last.observation or "",
            system_prompt=self.system_prompt,
        )


class FullContext(ContextBuilder):
    """Search-R1's growing context: every earlier response and observation, in order."""

    kind: ContextKind = "full"

    def messages(self) -> list[dict[str, str]]:
        msgs = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": build_user_content(self.question)},
        ]
        n = len(self.turns)
        for k, turn in enumerate(self.turns):
            msgs.append({"role": "assistant", "content": turn.response_text.strip()})
            obs = turn.observation or ""
            if k < n - 1 and turn.short_observation is not None:
                obs = turn.short_observation
            msgs.append({"role": "user", "content": obs})
        return msgs


def make_context(kind: ContextKind, question: str, system_prompt: str = SYSTEM_PROMPT) -> ContextBuilder:
    """A fresh `MemoryContext` ("memory") or `FullContext` ("full")."""
    if kind == "memory":
        return MemoryContext(question, system_prompt)
    if kind == "full":
        return FullContext(question, system_prompt)
    raise ValueError(f"unknown context kind '{kind}' (memory | full)")
