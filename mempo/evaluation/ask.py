"""`mempo ask`: one episode of the agent, shown turn by turn — what it remembered and why.

    mempo ask "Who is the mayor of the city where Greithain Tivgroux was born?" \\
        --model outputs/train/model --retriever outputs/index [--full-context] [--gold "Zha Traiwur"]

    from mempo.evaluation.ask import ask, format_episode
    episode = ask("Who ...?", engine, settings)
    print(format_episode(episode))

Each turn prints the prompt size, the `<mem>`, the `<think>`, the action (search / access /
answer), and the titles the retriever returned, so a person sees at a glance what the agent
kept in memory and where it went wrong.
"""

from __future__ import annotations

import asyncio
import dataclasses
import textwrap
from typing import Any

from mempo.evaluation.agents import observation_titles
from mempo.evaluation.engine import Engine
from mempo.evaluation.settings import EvalSettings, generator_policy
from mempo.tasks import single_task


def ask(
    question: str,
    engine: Engine,
    settings: EvalSettings,
    *,
    full_context: bool = False,
    gold: list[str] | None = None,
) -> Any:
    """Run one episode (memory context, or the full history with `full_context`).

    Returns the core `mempo.agent.rollout.Episode` (turn records, final answer, limits hit).
    """
    from mempo.agent.rollout import arun_episodes
    from mempo.agent.tools import ToolEnv

    if engine.retriever is None:
        raise ValueError("ask needs a retriever")
    item = single_task("ask", question, list(gold or []))
    policy = engine.turn_policy or generator_policy(settings, engine.generator, max_batch=1)
    env = ToolEnv(engine.retriever, engine.tokenizer, settings.tool_config())
    config = dataclasses.replace(settings.rollout_config(), max_concurrent_episodes=1)
    episodes = asyncio.run(arun_episodes(
        [item], policy, env, engine.tokenizer, context="full" if full_context else "memory",
        config=config, progress=False,
    ))
    return episodes[0]


def _field(label: str, text: str | None, width: int = 100) -> list[str]:
    if text is None:
        return []
    body = textwrap.wrap(" ".join(str(text).split()), width=width - 14) or [""]
    return [f"  {label:<11} {body[0]}"] + [f"  {'':<11} {line}" for line in body[1:]]


def format_episode(episode: Any, gold: list[str] | None = None, width: int = 100) -> str:
    """The episode as text: one block per turn, then the final answer (and its score vs `gold`)."""
    lines = [f"Question: {episode.question}", f"Context: {episode.context}", ""]
    for t in episode.turns:
        lines.append(f"Turn {t.turn_index + 1}  (prompt {t.prompt_length} tokens, generated {len(t.response_ids)})")
        parsed = t.parsed  # kept by the rollout: no second parse
        lines += _field("memory:", parsed.mem if parsed.mem is not None else "(none written)", width)
        lines += _field("think:", parsed.think, width)
        if parsed.action is not None:
            lines += _field(f"{parsed.action}:", parsed.argument, width)
        if not t.valid:
            lines += _field("INVALID:", t.error, width)
            if parsed.action is None:
                lines += _field("raw output:", t.response_text[:300], width)
        titles = observation_titles(t.observation)
        if titles:
            lines += _field("retrieved:", " | ".join(titles), width)
        lines.append("")
    if episode.final_answer is not None:
        lines.append(f"Final answer: {episode.final_answer}")
    elif episode.hit_context_limit:
        lines.append("No answer: the next prompt would exceed the context window (truncated).")
    elif episode.hit_turn_limit:
        lines.append(f"No answer within {len(episode.turns)} turns (turn limit).")
    else:
        lines.append("No answer.")
    if gold:
        from mempo.evaluation.metrics import answer_scores

        s = answer_scores(episode.final_answer, gold)
        lines.append(f"Gold: {' | '.join(gold)}  ->  EM {s['em']:.0f}, F1 {s['f1']:.2f}")
    peak = max(episode.prompt_tokens, default=0)
    lines.append(f"{episode.num_turns} turns, peak prompt {peak} tokens, "
                 f"format {'valid' if episode.format_valid else 'invalid'}")
    return "\n".join(lines)
