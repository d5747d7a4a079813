"""One episode turn, I/O-free: the ONE home of the turn rules both trainers follow.

The local rollout (`mempo.agent.rollout.run_episode`) and verl's agent loop
(`mempo.verl_plugin.agent_loop.MemAgentLoop`) drive the same `EpisodeSteps`; they only
supply the I/O (tokenising the prompt, the engine's generation, the retrieval call):

    episode = EpisodeSteps(MemoryContext(question), max_turns=8)
    while not episode.finished:
        prompt_ids = tokenizer.encode(render_prompt(tokenizer, episode.messages()))
        step = episode.take(generated_ids, tokenizer)   # parse, mask, decide: no I/O
        if step.request is not None:                    # <search> / <access>
            episode.observe(*tool(step.request))        # (observation, short form)
    episode.final_answer, episode.format_valid, episode.termination

The rules (issue 16 picked one where the two trainers used to differ):
- A turn whose action is a closed `<answer> ... </answer>` ends the episode, valid or not
  (Search-R1 and the local trainer). An invalid answer turn makes the episode's format
  invalid, so R^T is 0 under the strict format rule; it is not given a second chance.
- An invalid turn that does not answer (no closed action, a broken format) gets the
  corrective observation and the episode goes on.
- An empty generation is such an invalid turn with no tokens: nothing of it is trained.
- After `max_turns` turns without an answer the episode ends (`termination="turn_limit"`).
- R^T's inputs: the final answer is the answering turn's argument (None without one); the
  format is valid when every turn is valid and the last one answers
  (`mempo.rewards.episode_format_valid`).
- The full-context history (the memory reward's eps=full_context baseline) is rebuilt from
  the recorded turns by `full_context_messages`, never by parsing their text again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from mempo.agent.context import ContextBuilder, FullContext
from mempo.agent.format import SYSTEM_PROMPT, ParsedTurn, invalid_turn_observation, parse_turn
from mempo.agent.masks import check_mem_mask, span_token_mask

Termination = Literal["answer", "turn_limit"]


@dataclass(frozen=True)
class ToolRequest:
    """The tool call a turn asks for: `search` a query or `access` an article."""

    action: Literal["search", "access"]
    argument: str


@dataclass
class TurnStep:
    """One digested turn.

    Attributes:
        turn_index: the turn's number in its episode (0-based).
        response_ids: the generated token ids as given, [n] (n = 0 for an empty generation).
        response_text: their decoding (special tokens skipped).
        parsed: `parse_turn(response_text)`, kept so nothing parses the text again.
        mem_mask: 1 for the tokens inside `<mem> ... </mem>`, [n].
        request: the tool call to make next, or None (an answer, or an invalid turn).
        observation: the environment's reply: the corrective observation of an invalid
            turn (set at once), the tool's result once observed, None after an answer.
        short_observation: the form a full history shows once the turn is not the last.
    """

    turn_index: int
    response_ids: list[int]
    response_text: str
    parsed: ParsedTurn
    mem_mask: list[int]
    request: ToolRequest | None
    observation: str | None = None
    short_observation: str | None = None

    @property
    def answers(self) -> bool:
        """The turn closed an `<answer>` (valid or not): the episode ends with it."""
        return self.parsed.action == "answer"


def digest_turn(token_ids: Sequence[int], tokenizer: Any, turn_index: int = 0,
                check_masks: bool = True) -> TurnStep:
    """Decode, parse and mask one generated turn and decide what comes next (no I/O).

    Args:
        token_ids: the generated ids, [n], already cut after the first stop string by the
            engine; [] for an empty generation.
        tokenizer: the policy's tokenizer (decodes `token_ids`).
        turn_index: the turn's number in its episode.
        check_masks: raise ValueError unless the mem mask decodes to the `<mem>` text.
    """
    ids = [int(i) for i in token_ids]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    parsed = parse_turn(text)
    mem_mask = span_token_mask(ids, tokenizer, parsed.mem_span)
    if check_masks:
        check_mem_mask(ids, tokenizer, mem_mask, parsed.mem)
    request: ToolRequest | None = None
    observation: str | None = None
    if parsed.action == "answer":
        pass
    elif not parsed.valid:
        observation = invalid_turn_observation(parsed.error)
    else:  # a valid turn that does not answer holds exactly one search or access
        request = ToolRequest(parsed.action, parsed.argument or "")  # type: ignore[arg-type]
    return TurnStep(turn_index, ids, text, parsed, mem_mask, request, observation)


class EpisodeSteps:
    """One episode's turns and its context, advanced one turn at a time (no I/O).

    Args:
        context: the builder of the policy's prompt (`MemoryContext`, `FullContext`, ...).
        max_turns: turns before the episode is cut.
        check_masks: verify every mem mask against the decoded `<mem>` text.
    """

    def __init__(self, context: ContextBuilder, max_turns: int, check_masks: bool = True) -> None:
        self.context = context
        self.max_turns = max_turns
        self.check_masks = check_masks
        self.turns: list[TurnStep] = []

    @property
    def awaiting_tool(self) -> bool:
        """The last turn asked for a tool call that has not been observed yet."""
        return bool(self.turns) and self.turns[-1].request is not None and self.turns[-1].observation is None

    @property
    def termination(self) -> Termination | None:
        """Why the episode ended: "answer", "turn_limit", or None while it runs."""
        if self.turns and self.turns[-1].answers:
            return "answer"
        if len(self.turns) >= self.max_turns and not self.awaiting_tool:
            return "turn_limit"
        return None

    @property
    def finished(self) -> bool:
        return self.termination is not None

    def messages(self) -> list[dict[str, str]]:
        """Chat messages of the next turn's prompt."""
        return self.context.messages()

    def take(self, token_ids: Sequence[int], tokenizer: Any) -> TurnStep:
        """Digest the next turn's generated ids (see `digest_turn`) and record it.

        A turn that needs no tool is recorded in the context at once; one with a `request`
        waits for `observe`.
        """
        if self.finished or self.awaiting_tool:
            raise RuntimeError("take() after the episode ended or before the last tool call was observed")
        step = digest_turn(token_ids, tokenizer, len(self.turns), self.check_masks)
        self.turns.append(step)
        if step.request is None and not step.answers:
            self.context.record_turn(step.response_text, step.parsed, step.observation)
        return step

    def observe(self, observation: str, short_observation: str | None = None) -> None:
        """The tool's reply to the last turn's request (`short_observation`: the form a full
        history shows once the turn is not the last; None = the observation itself)."""
        if not self.awaiting_tool:
            raise RuntimeError("observe() without a pending tool request")
        step = self.turns[-1]
        step.observation, step.short_observation = observation, short_observation
        self.context.record_turn(step.response_text, step.parsed, observation, short_observation)

    @property
    def final_answer(self) -> str | None:
        """The answering turn's argument (None when the episode did not answer)."""
        return self.turns[-1].parsed.argument if self.turns and self.turns[-1].answers else None

    @property
    def format_valid(self) -> bool:
        """Every turn valid and the last one an answer (R^T's format condition)."""
        from mempo.rewards import episode_format_valid

        return episode_format_valid([t.parsed for t in self.turns])


class RecordedTurn(Protocol):
    """What `full_context_messages` reads of a recorded turn (`TurnStep`, `TurnRecord`)."""

    response_text: str
    parsed: ParsedTurn
    observation: str | None
    short_observation: str | None


def full_context_messages(question: str, turns: Sequence[RecordedTurn],
                          system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """The messages a full-history policy sees after `turns` (the memory reward's
    eps=full_context baseline before the next turn), from the kept parsed turns."""
    ctx = FullContext(question, system_prompt)
    for t in turns:
        ctx.record_turn(t.response_text, t.parsed, t.observation, t.short_observation)
    return ctx.messages()
