"""The agents an evaluation compares, all on the same model, retriever and questions.

- `memory` (MemPO): `mempo.agent.context.MemoryContext` — each prompt holds the question,
  the model's own `<mem>` of the previous turn and the last action with its result.
- `full_context` (Search-R1 baseline): `FullContext` — the whole history appended.
- `external_memory` ("working memory + vector store", the design MemPO argues a learned
  memory replaces): `ExternalMemoryContext` below — no `<mem>` of the model's is ever shown;
  every observation of the episode goes into a per-episode vector store, and each prompt
  holds the question, the last action + result and, in the memory slot, the few earlier
  snippets most similar to the latest query.
- `rag` (one-shot RAG): retrieve with the question once, then answer.
- `direct`: answer from the question alone (no retrieval).

`rag` and `direct` get one turn. A policy trained to search first may search instead of
answering; then that turn is made to answer: its own `<mem>` and `<think>` are kept and the
assistant turn continues from `<answer> ` (`forced_answer_prefix`), the layout of the
agent's own answering turns. Their `format_valid`: the model's turn was valid and the final
(possibly forced) turn is a valid answer turn.

The three multi-turn agents run through the core rollout loop (`mempo.agent.rollout`).
"""

from __future__ import annotations

import re
from typing import Any

from mempo.agent.context import MemoryContext
from mempo.agent.format import INFO_CLOSE, INFO_OPEN, SYSTEM_PROMPT, ParsedTurn, build_messages
from mempo.evaluation.vector_store import EpisodeVectorStore, TextEncoder

AGENTS = ("memory", "full_context", "external_memory", "rag", "direct")
MULTI_TURN_AGENTS = ("memory", "full_context", "external_memory")
SINGLE_TURN_AGENTS = ("rag", "direct")

_DOC_SPLIT = re.compile(r"(?:^|\n)\s*Doc \d+(?=\()")
_TITLE = re.compile(r"\(Title: ([^)]*)\)")
_ANY_TAG = re.compile(r"</?(?:mem|think|search|answer|access|information)>")


def observation_snippets(observation: str | None) -> list[str]:
    """The passages of an `<information>` block as separate snippets, without "Doc i" numbers.

    Example: "<information> Doc 1(Title: A) a.\\nDoc 2(Title: B) b. </information>"
    -> ["(Title: A) a.", "(Title: B) b."]. A block without "Doc i(" items is one snippet.
    """
    if not observation:
        return []
    body = observation.replace(INFO_OPEN, " ").replace(INFO_CLOSE, " ").strip()
    parts = [p.strip() for p in _DOC_SPLIT.split(body)]
    return [p for p in parts if p]


def observation_titles(observation: str | None) -> list[str]:
    """Titles named in an observation (`(Title: X)`), in order."""
    return [t.strip() for t in _TITLE.findall(observation or "")]


class ExternalMemoryContext(MemoryContext):
    """Prompts of the external-memory baseline (see the module docstring).

    Args:
        question: the task's question.
        encoder: the text encoder for the per-episode store.
        n_snippets: earlier snippets recalled into each prompt.
    """

    # The same flat layout as MemoryContext; only the memory slot differs: recalled snippets.

    def __init__(
        self, question: str, encoder: TextEncoder, n_snippets: int = 3, system_prompt: str = SYSTEM_PROMPT
    ) -> None:
        super().__init__(question, system_prompt)
        self.store = EpisodeVectorStore(encoder)
        self.n_snippets = n_snippets

    def record_turn(
        self, response_text: str, parsed: ParsedTurn, observation: str | None,
        short_observation: str | None = None,
    ) -> None:
        # The turn that was last until now drops out of the prompt: its result goes to the store.
        if self.turns:
            self.store.add(observation_snippets(self.turns[-1].observation))
        super().record_turn(response_text, parsed, observation, short_observation)

    def recalled(self) -> list[str]:
        """The earlier snippets the next prompt shows: the most similar to the latest query
        (the last action's argument, else the question), excluding the last result itself."""
        if not self.turns:
            return []
        last = self.turns[-1]
        query = (last.parsed.argument if last.parsed.valid and last.parsed.argument else None) or self.question
        return self.store.top(query, self.n_snippets, exclude=observation_snippets(last.observation))

    def memory_slot(self) -> str:
        return "\n".join(self.recalled())


def single_turn_messages(question: str, passages_observation: str | None) -> list[dict[str, str]]:
    """Messages of the `direct` (no observation: the first-turn prompt) and `rag` agents.

    `rag` shows its one retrieval as if the agent had just searched the question: the last
    action `<search> question </search>` with the `<information>` block, and an empty memory.
    """
    from mempo.agent.format import SEARCH_CLOSE, SEARCH_OPEN

    if passages_observation is None:
        return build_messages(question)
    return build_messages(
        question, memory="", last_action=f"{SEARCH_OPEN} {question.strip()} {SEARCH_CLOSE}",
        last_observation=passages_observation,
    )


def forced_answer_prefix(parsed: ParsedTurn) -> str:
    """The assistant-turn prefix that makes a turn end in an answer: the turn's own `<mem>`
    (and `<think>`), then `<answer> ` — the layout of the agent's own answering turns.

    Example: a turn "<mem> m </mem> <think> t </think> <search> q </search>" gives
    "<mem> m </mem> <think> t </think> <answer> ".
    """
    from mempo.agent.format import ANSWER_PROBE_PREFIX, MEM_CLOSE, MEM_OPEN, THINK_CLOSE, THINK_OPEN

    parts = [f"{MEM_OPEN} {parsed.mem or ''} {MEM_CLOSE}"]
    if parsed.think:
        parts.append(f"{THINK_OPEN} {parsed.think} {THINK_CLOSE}")
    parts.append(ANSWER_PROBE_PREFIX)
    return " ".join(parts)


def forced_answer_text(generated: str) -> tuple[str, bool]:
    """(answer, closed) from the text generated after `<answer>`: the text up to the first tag;
    `closed` when that tag is `</answer>`. Example: " Paris </answer>" -> ("Paris", True);
    " <search> q </search>" -> ("", False)."""
    from mempo.agent.format import ANSWER_CLOSE

    m = _ANY_TAG.search(generated)
    if m is None:
        return generated.strip(), False
    return generated[:m.start()].strip(), m.group(0) == ANSWER_CLOSE


def turn_transcript(parsed: ParsedTurn, observation: str | None, prompt_tokens: int) -> dict[str, Any]:
    """One turn as `mempo ask` and `samples.parquet` show it."""
    return {
        "memory": parsed.mem,
        "think": parsed.think,
        "action": parsed.action,
        "argument": parsed.argument,
        "valid": parsed.valid,
        "error": parsed.error,
        "titles": observation_titles(observation),
        "prompt_tokens": prompt_tokens,
    }
