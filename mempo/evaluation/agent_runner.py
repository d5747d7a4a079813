"""The evaluated agents on one benchmark: episodes in, one sample row per question out.

    from mempo.evaluation.agent_runner import evaluate_items, run_multi_turn
    rows = evaluate_items({"world": items}, ["memory", "rag"], engine, settings)
    rows = run_multi_turn("memory", "world", items, engine, settings)   # one agent, one benchmark

`run_multi_turn` drives the core rollout loop (`mempo.agent.rollout`) for the memory,
full-context and external-memory agents; `run_single_turn` runs the `direct` and `rag`
baselines (one turn, forced to an answer). Every row has the columns
`mempo.evaluation.metrics.SAMPLE_COLUMNS`, scored by `answer_scores` (`mempo.rewards`).
`mempo eval`, the learning study and the GRPO trainer's validation all call these.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mempo.errors import ConfigError, MempoError
from mempo.evaluation.agents import (
    AGENTS,
    MULTI_TURN_AGENTS,
    ExternalMemoryContext,
    forced_answer_text,
    single_turn_messages,
    turn_transcript,
)
from mempo.evaluation.engine import Engine
from mempo.evaluation.metrics import SAMPLE_COLUMNS, answer_scores
from mempo.evaluation.probe import add_memory_probe
from mempo.evaluation.settings import EvalSettings, generator_policy, sampling_params
from mempo.tasks import Task

log = logging.getLogger(__name__)

CONTEXT_OF_AGENT = {"memory": "memory", "full_context": "full", "external_memory": "external"}


class _TimedPolicy:
    """Wraps a TurnPolicy to stamp when each episode asks for its first turn (latency)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.started: dict[str, float] = {}

    async def respond(self, request: Any) -> Any:
        self.started.setdefault(request.episode_id, time.perf_counter())
        return await self.inner.respond(request)


def _base_row(agent: str, bench: str, item: Task, k: int, engine: Engine) -> dict[str, Any]:
    return {
        "agent": agent, "policy": engine.policy, "benchmark": bench, "id": item.id, "question": item.question,
        "golden_answers": list(item.golden_answers), "k": k,
    }


def _finish_row(row: dict[str, Any], item: Task, prediction: str | None, truncated: bool) -> dict[str, Any]:
    scores = answer_scores(None if truncated else prediction, item.golden_answers, item.answer_lists)
    row.update(scores)
    row["prediction"] = prediction or ""
    row["truncated"] = float(truncated)
    for col in SAMPLE_COLUMNS:
        row.setdefault(col, "" if col in ("policy", "final_memory", "transcript", "error", "prediction") else float("nan"))
    return row


def run_multi_turn(
    agent: str,
    bench: str,
    items: Sequence[Task],
    engine: Engine,
    settings: EvalSettings,
    k: int = 1,
) -> list[dict[str, Any]]:
    """Episodes of a multi-turn agent (memory, full_context, external_memory) through the core
    rollout loop; one sample row per item (see `mempo.evaluation.metrics.SAMPLE_COLUMNS`)."""
    from mempo.agent.rollout import arun_episodes
    from mempo.agent.tools import ToolEnv
    from mempo.forgetting import SEEN, episode_forgot

    if engine.retriever is None:
        raise MempoError(f"agent '{agent}' needs a retriever (eval.retriever)")
    policy = _TimedPolicy(engine.turn_policy or generator_policy(settings, engine.generator))
    env = ToolEnv(engine.retriever, engine.tokenizer, settings.tool_config())
    config = settings.rollout_config()
    ended: dict[str, float] = {}
    context: Any = CONTEXT_OF_AGENT[agent]
    if agent == "external_memory":
        from mempo.evaluation.vector_store import make_encoder

        encoder = make_encoder(settings.external_memory_encoder)

        def external_memory(question: str, system_prompt: str) -> ExternalMemoryContext:
            return ExternalMemoryContext(question, encoder, settings.external_memory_snippets, system_prompt)

        context = external_memory

    episodes = asyncio.run(arun_episodes(
        list(items), policy, env, engine.tokenizer, context=context, config=config,
        on_episode=lambda ep: ended.__setitem__(ep.episode_id, time.perf_counter()),
        progress=True,
    ))
    rows = []
    for item, ep in zip(items, episodes, strict=True):
        row = _base_row(agent, bench, item, k, engine)
        if agent == "memory" and len(ep.objectives) > 1:
            steps = ep.memory_steps()
            row["forgetting_rate"] = float(episode_forgot(ep.objectives, steps))
            row["forgetting_rate_seen"] = float(episode_forgot(ep.objectives, steps, SEEN))
        prompts = ep.prompt_tokens
        memories = [t.memory for t in ep.turns if t.memory is not None]
        row.update(
            format_valid=float(ep.format_valid),
            turns=ep.num_turns,
            searches=sum(1 for t in ep.turns if t.action in ("search", "access") and t.valid),
            peak_prompt_tokens=max(prompts, default=0),
            total_prompt_tokens=sum(prompts),
            generated_tokens=ep.response_tokens,
            repeated_turns=ep.repeated_turns,
            latency_s=ended.get(ep.episode_id, 0.0) - policy.started.get(ep.episode_id, ended.get(ep.episode_id, 0.0)),
            hit_turn_limit=float(ep.hit_turn_limit),
            prompt_tokens_by_turn=list(prompts),
            final_memory=memories[-1] if memories else "",
            transcript=json.dumps([
                {**turn_transcript(t.parsed, t.observation, t.prompt_length), "observation": t.observation}
                for t in ep.turns
            ], ensure_ascii=False),
            error="context window exceeded" if ep.hit_context_limit else "",
        )
        rows.append(_finish_row(row, item, ep.final_answer, truncated=ep.hit_context_limit))
    return rows


def run_single_turn(
    agent: str,
    bench: str,
    items: Sequence[Task],
    engine: Engine,
    settings: EvalSettings,
    k: int = 1,
) -> list[dict[str, Any]]:
    """The `direct` and `rag` baselines: one turn per item (see `mempo.evaluation.agents`),
    forced to an answer when the model searched instead; batched `concurrency` at a time."""
    from mempo.agent.format import format_observation, parse_turn, render_prompt
    from mempo.evaluation.agents import forced_answer_prefix
    from mempo.retrieval.base import format_passages

    tok = engine.tokenizer
    observations: list[str | None] = [None] * len(items)
    if agent == "rag":
        if engine.retriever is None:
            raise MempoError("agent 'rag' needs a retriever (eval.retriever)")
        hits = engine.retriever.search([it.question for it in items], topk=settings.rollout.topk) if items else []
        observations = [format_observation(format_passages(h) if h else "No results.", tok, settings.rollout.observation_max_tokens)
                        for h in hits]
    messages = [single_turn_messages(it.question, obs) for it, obs in zip(items, observations, strict=True)]
    prompts = [tok.encode(render_prompt(tok, m), add_special_tokens=False) for m in messages]
    latency = [0.0] * len(items)

    def generate(idx: list[int], prompt_of: dict[int, list[int]], sampling: Any, desc: str) -> dict[int, Any]:
        from tqdm.auto import tqdm

        out: dict[int, Any] = {}
        for start in tqdm(range(0, len(idx), settings.rollout.max_concurrent_episodes), desc=desc, leave=False):
            batch = idx[start:start + settings.rollout.max_concurrent_episodes]
            t0 = time.perf_counter()
            gens = engine.generator.generate([prompt_of[i] for i in batch], sampling)
            dt = time.perf_counter() - t0
            for i, g in zip(batch, gens, strict=True):
                out[i] = g
                latency[i] += dt
        return out

    limit = settings.rollout.max_prompt_tokens or float("inf")  # 0 = no limit, as in rollouts
    fits = [i for i, p in enumerate(prompts) if len(p) <= limit]
    first = generate(fits, dict(enumerate(prompts)), sampling_params(settings), f"{agent} ({bench})")
    parsed_first = {i: parse_turn(g.text) for i, g in first.items()}
    # Turns that did not answer continue from their own memory and reasoning into `<answer> `.
    prefixes = {i: forced_answer_prefix(p) for i, p in parsed_first.items() if p.action != "answer"}
    forced_prompts = {i: tok.encode(render_prompt(tok, messages[i], prefixes[i]), add_special_tokens=False)
                      for i in prefixes}
    forced_fits = [i for i in prefixes if len(forced_prompts[i]) <= limit]
    forced = generate(forced_fits, forced_prompts, sampling_params(settings),
                      f"{agent} ({bench}, answers)")

    rows = []
    for i, item in enumerate(items):
        row = _base_row(agent, bench, item, k, engine)
        g1 = first.get(i)
        truncated = g1 is None or (i in prefixes and i not in forced)
        lengths = [len(prompts[i])] + ([len(forced_prompts[i])] if i in forced_prompts else [])
        answer: str | None = None
        valid = False
        final_text = ""
        if not truncated and g1 is not None:
            if i in forced:
                final_text = prefixes[i] + forced[i].text
                final = parse_turn(final_text)
                answer = final.argument if final.action == "answer" else forced_answer_text(forced[i].text)[0]
            else:
                final_text, final = g1.text, parsed_first[i]
                answer = final.argument
            valid = parsed_first[i].valid and final.valid and final.action == "answer"
        parsed = parse_turn(final_text)
        row.update(
            format_valid=float(valid),
            turns=0 if g1 is None else 1,
            searches=int(agent == "rag"),
            peak_prompt_tokens=max(lengths),
            total_prompt_tokens=sum(lengths),
            generated_tokens=sum(len(g.token_ids) for g in (g1, forced.get(i)) if g is not None),
            repeated_turns=0,
            latency_s=latency[i],
            hit_turn_limit=0.0,
            prompt_tokens_by_turn=lengths,
            final_memory="",
            transcript=json.dumps([{
                **turn_transcript(parsed, observations[i], max(lengths)),
                "forced_answer": i in prefixes, "first_response": None if g1 is None else g1.text,
                "observation": observations[i],
            }], ensure_ascii=False),
            error="context window exceeded" if truncated else "",
        )
        rows.append(_finish_row(row, item, answer, truncated=truncated))
    return rows


def evaluate_items(
    benchmarks: Mapping[str, Sequence[Task]],
    agents: Sequence[str],
    engine: Engine | Mapping[str, Engine],
    settings: EvalSettings,
    on_pair: Callable[[str, str, list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every agent on every benchmark; returns all sample rows (benchmark, then agent order).

    `engine`: one engine for every agent, or agent -> engine (each agent on its own policy)."""
    unknown = [a for a in agents if a not in AGENTS]
    if unknown:
        raise ConfigError(f"unknown agent(s) {unknown}; choose from {list(AGENTS)}", field="eval.agents")
    engines = {a: engine for a in agents} if isinstance(engine, Engine) else dict(engine)
    rows: list[dict[str, Any]] = []
    for bench, items in benchmarks.items():
        k = max((it.k for it in items), default=1)
        for agent in agents:
            t0 = time.perf_counter()
            run = run_multi_turn if agent in MULTI_TURN_AGENTS else run_single_turn
            pair = run(agent, bench, items, engines[agent], settings, k)
            if settings.memory_probe:
                add_memory_probe(pair, engines[agent])
            log.info("eval %s on %s: %d samples in %.1f s, EM %.3f", agent, bench, len(pair),
                     time.perf_counter() - t0,
                     sum(r["em"] for r in pair) / max(1, len(pair)))
            if on_pair is not None:
                on_pair(agent, bench, pair)
            rows.extend(pair)
    return rows
