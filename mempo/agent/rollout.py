"""The async, engine-agnostic rollout loop: many episodes at once, one record per turn.

A `TurnPolicy` answers one turn at a time; `GeneratorPolicy` wraps any `Generator`
(transformers, an OpenAI-compatible server) and batches the turns of all episodes that
are waiting into one `generate` call; the scripted teacher is another `TurnPolicy`.

    policy = GeneratorPolicy(HFGenerator(model, tok), SamplingParams(max_new_tokens=256))
    env = ToolEnv(retriever, tok, ToolConfig(topk=3))
    episodes = run_episodes(items, policy, env, tok, context="memory", n_rollouts=4)
    ep = episodes[0]
    ep.turns[0].prompt_ids, ep.turns[0].response_ids, ep.turns[0].mem_mask, ep.final_answer

Each turn is digested by `mempo.agent.step.EpisodeSteps`, the turn step verl's `mem_agent`
drives too (one set of turn rules for both trainers); this module adds the I/O: prompts,
the policy's generation, the tools. Every turn record keeps its `ParsedTurn` and has its mem
mask checked against the decoded span (`check_mem_mask`).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from mempo.agent import step as turn_step
from mempo.agent.context import ContextBuilder, ContextKind, make_context
from mempo.agent.format import SYSTEM_PROMPT, ParsedTurn, parse_turn, render_prompt
from mempo.agent.generation import Generation, Generator, SamplingParams
from mempo.agent.step import EpisodeSteps, ToolRequest, TurnStep
from mempo.agent.tools import ArticleReader, ToolEnv
from mempo.tasks import Task

log = logging.getLogger(__name__)

# A custom context builder, `(question, system_prompt) -> ContextBuilder` (e.g. the
# evaluation's external-memory baseline), accepted wherever a ContextKind is.
ContextFactory = Callable[[str, str], ContextBuilder]


@dataclass
class RolloutConfig:
    """Episode limits: `RolloutConfig.from_params(rollout)` from the `rollout:` params. Built by
    hand (tests, benchmarks) it defaults to one fixed limit of 8 turns (no per-objective
    budget); its other defaults agree with `RolloutParams` (tests/test_config_rollout.py).

    Attributes:
        max_turns: turns before an episode is cut (`hit_turn_limit`); with
            `turns_per_objective` it is the cap of the per-task budget.
        max_prompt_tokens: a turn whose prompt is longer ends the episode
            (`hit_context_limit`); 0 = no limit.
        max_concurrent_episodes: episodes in flight at once.
        check_masks: verify every mem mask against the decoded span (cheap; keep on).
        turns_per_objective: a k-objective task gets `min(k * turns_per_objective,
            max_turns)` turns (0: every task gets `max_turns`).
    """

    max_turns: int = 8
    max_prompt_tokens: int = 0
    max_concurrent_episodes: int = 64
    check_masks: bool = True
    turns_per_objective: int = 0

    @classmethod
    def from_params(cls, p: Any) -> RolloutConfig:
        """From a `RolloutParams` (or anything with these attributes)."""
        return cls(max_turns=p.max_turns, max_prompt_tokens=p.max_prompt_tokens,
                   max_concurrent_episodes=p.max_concurrent_episodes, check_masks=p.check_masks,
                   turns_per_objective=p.turns_per_objective)

    def turn_budget(self, k: int) -> int:
        """Turns a task of `k` objectives gets (see `turns_per_objective`)."""
        if not self.turns_per_objective:
            return self.max_turns
        return max(1, min(self.turns_per_objective * max(1, k), self.max_turns))


@dataclass
class TurnRequest:
    """What a policy gets to answer one turn."""

    episode_id: str
    item: Task
    turn_index: int
    messages: list[dict[str, str]]
    prompt_ids: list[int]
    last_parsed: ParsedTurn | None
    last_observation: str | None
    repeats: bool = False  # this prompt is one the episode already had (a greedy policy would loop)


class TurnPolicy(Protocol):
    """Answers one turn; implementations may batch concurrent calls."""

    async def respond(self, request: TurnRequest) -> Generation:
        ...


@dataclass
class TurnRecord:
    """One turn of one episode, as the trainers consume it.

    Attributes:
        prompt_ids: the prompt's token ids, [prompt_length].
        response_ids: generated token ids, [n].
        response_mask: 1 for tokens the policy generated (all of `response_ids`), [n].
        mem_mask: 1 for tokens inside this turn's `<mem>...</mem>`, [n].
        memory: the `<mem>` text (None when the turn wrote none).
        logprobs: sampling log-probs of `response_ids` when the engine gave them, [n].
        observation: the environment's reply to this turn (None after an answer).
        parsed: the turn's `ParsedTurn`, kept so nothing parses `response_text` again
            (a record built without one, e.g. by hand in a test, gets it parsed once here).
    """

    turn_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    mem_mask: list[int]
    memory: str | None
    prompt_length: int
    response_text: str
    action: str | None
    argument: str | None
    valid: bool
    error: str
    observation: str | None = None
    short_observation: str | None = None
    logprobs: list[float] | None = None
    parsed: ParsedTurn | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.parsed is None:
            self.parsed = parse_turn(self.response_text)

    @classmethod
    def from_step(cls, step: TurnStep, prompt_ids: list[int], logprobs: list[float] | None) -> TurnRecord:
        """The record of a digested turn (`mempo.agent.step.TurnStep`) and its prompt."""
        p = step.parsed
        return cls(
            turn_index=step.turn_index, prompt_ids=prompt_ids, response_ids=step.response_ids,
            response_mask=[1] * len(step.response_ids), mem_mask=step.mem_mask, memory=p.mem,
            prompt_length=len(prompt_ids), response_text=step.response_text, action=p.action,
            argument=p.argument, valid=p.valid, error=p.error, observation=step.observation,
            short_observation=step.short_observation, logprobs=logprobs, parsed=p,
        )


@dataclass
class Episode:
    """One rollout of one task."""

    episode_id: str
    item_id: str
    question: str
    golden_answers: list[str]
    objectives: list[list[str]]
    context: ContextKind
    turns: list[TurnRecord] = field(default_factory=list)
    final_answer: str | None = None
    hit_turn_limit: bool = False
    hit_context_limit: bool = False

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def prompt_tokens(self) -> list[int]:
        """Prompt length of each turn (tokens)."""
        return [t.prompt_length for t in self.turns]

    @property
    def repeated_turns(self) -> int:
        """Turns whose prompt the episode already had at an earlier turn (a memory agent whose
        state came back: greedy decoding would replay the cycle; see `GeneratorPolicy`)."""
        return sum(prompt_seen(self.turns[:i], t.prompt_ids) for i, t in enumerate(self.turns))

    @property
    def response_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.turns)

    @property
    def format_valid(self) -> bool:
        """Every turn valid and the last one an answer."""
        from mempo.rewards import episode_format_valid

        return episode_format_valid(self.turns)

    def outcome_reward(self, multi_rule: str = "all", format_rule: str = "strict", format_penalty: float = 0.0,
                       no_answer_penalty: float = 0.0) -> float:
        """R^T of this episode (see `mempo.rewards.outcome_reward`)."""
        from mempo.rewards import outcome_reward

        return outcome_reward(self.final_answer, self.golden_answers, self.format_valid, self.objectives,
                              multi_rule=multi_rule, format_rule=format_rule,  # type: ignore[arg-type]
                              format_penalty=format_penalty, no_answer_penalty=no_answer_penalty)

    def memory_steps(self) -> list[Any]:
        """Each turn's memory and observation, as `mempo.forgetting` reads an episode."""
        from mempo.forgetting import MemoryStep

        return [MemoryStep(t.memory, t.observation) for t in self.turns]

    def summary(self) -> dict[str, Any]:
        """Per-episode numbers: answer, turns, token counts, limits hit."""
        return {
            "episode_id": self.episode_id, "item_id": self.item_id, "context": self.context,
            "final_answer": self.final_answer, "num_turns": self.num_turns,
            "prompt_tokens": self.prompt_tokens, "peak_prompt_tokens": max(self.prompt_tokens, default=0),
            "response_tokens": self.response_tokens, "format_valid": self.format_valid,
            "hit_turn_limit": self.hit_turn_limit, "hit_context_limit": self.hit_context_limit,
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for t in d["turns"]:  # the parsed turn repeats the record's fields: files keep their layout
            t.pop("parsed", None)
        d.update(self.summary())
        return d


def full_context_messages(episode: Episode, turn_index: int, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """The full-history messages the policy would see at `turn_index` of `episode`
    (for the memory reward's eps="full_context"; see `mempo.agent.step.full_context_messages`)."""
    return turn_step.full_context_messages(episode.question, episode.turns[:turn_index], system_prompt)  # type: ignore[arg-type]


def prompt_seen(turns: Sequence[TurnRecord], prompt_ids: Sequence[int]) -> bool:
    """Whether one of `turns` had exactly this prompt: the one rule for a repeated turn (the
    rollout marks the next turn with it, `Episode.repeated_turns` counts it afterwards)."""
    return any(t.prompt_ids == prompt_ids for t in turns)


def repeat_seed(seed: int, episode_id: str, turn_index: int) -> int:
    """The sampling seed of a repeated turn: a function of the episode and the turn only, so
    the turn's sample does not depend on which other episodes share its batch."""
    return zlib.crc32(f"{seed}:{episode_id}:{turn_index}".encode())


class GeneratorPolicy:
    """A `TurnPolicy` over a `Generator`: concurrent turns are batched into one call.

    The generator runs in a worker thread, so tool calls of other episodes proceed while
    it generates; requests that arrive meanwhile form the next batch.

    Args:
        generator: the engine.
        sampling: the settings of every turn.
        max_batch: most turns in one `generate` call.
        repeat_temperature: with greedy `sampling` (temperature 0), a turn whose prompt repeats
            an earlier prompt of its episode (`TurnRequest.repeats`) would repeat the earlier
            turn and everything after it, a cycle that lasts until the turn limit. Such a turn
            is sampled at this temperature instead, alone, seeded by `repeat_seed` (the same
            episode gives the same result at any batch size); 0 = decode it greedily too.
        seed: the base of the repeated turns' seeds.
    """

    def __init__(self, generator: Generator, sampling: SamplingParams, max_batch: int = 64,
                 repeat_temperature: float = 0.0, seed: int = 0) -> None:
        self.generator = generator
        self.sampling = sampling
        self.max_batch = max_batch
        self.repeat_temperature = repeat_temperature
        self.seed = seed
        self.resampled = 0  # repeated turns sampled so far
        self._pending: list[tuple[list[int], asyncio.Future[Generation], SamplingParams | None]] = []
        self._worker: asyncio.Task[None] | None = None

    async def respond(self, request: TurnRequest) -> Generation:
        fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        own: SamplingParams | None = None
        if request.repeats and self.repeat_temperature > 0 and self.sampling.temperature == 0:
            own = replace(self.sampling, temperature=self.repeat_temperature,
                          seed=repeat_seed(self.seed, request.episode_id, request.turn_index))
            self.resampled += 1
        self._pending.append((request.prompt_ids, fut, own))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(0)  # let every episode that is ready enqueue its turn
            batch = self._pending[: self.max_batch]
            del self._pending[: len(batch)]
            shared = [(p, f) for p, f, own in batch if own is None]
            if shared:
                await generate_batch(self.generator, self.sampling, shared)
            for p, f, own in batch:  # seeded per turn: each alone
                if own is not None:
                    await generate_batch(self.generator, own, [(p, f)])


async def generate_batch(generator: Generator, sampling: SamplingParams,
                         batch: list[tuple[list[int], asyncio.Future[Generation]]]) -> None:
    """Generate for every (prompt ids, future) of `batch` in ONE call (in a worker thread, so
    other episodes' tool calls proceed) and resolve the futures; an error goes to each of them."""
    try:
        gens = await asyncio.to_thread(generator.generate, [p for p, _ in batch], sampling)
    except Exception as e:  # noqa: BLE001 - hand the error to every waiting episode
        for _, f in batch:
            if not f.done():
                f.set_exception(e)
        return
    for (_, f), g in zip(batch, gens, strict=True):
        if not f.done():
            f.set_result(g)


async def run_episode(
    item: Task,
    policy: TurnPolicy,
    env: ToolEnv,
    tokenizer: Any,
    context: ContextKind | ContextFactory = "memory",
    config: RolloutConfig | None = None,
    episode_id: str | None = None,
    system_prompt: str = SYSTEM_PROMPT,
) -> Episode:
    """Run one episode to an answer or a limit; returns its turn records."""
    cfg = config or RolloutConfig()
    ctx = (make_context(context, item.question, system_prompt) if isinstance(context, str)
           else context(item.question, system_prompt))
    ep = Episode(
        episode_id=episode_id or item.id, item_id=item.id, question=item.question,
        golden_answers=list(item.golden_answers), objectives=item.answer_lists, context=ctx.kind,
    )
    reader = ArticleReader()
    steps = EpisodeSteps(ctx, cfg.turn_budget(len(ep.objectives)), check_masks=cfg.check_masks)
    while not steps.finished:
        msgs = steps.messages()
        prompt_ids = tokenizer.encode(render_prompt(tokenizer, msgs), add_special_tokens=False)
        if cfg.max_prompt_tokens and len(prompt_ids) > cfg.max_prompt_tokens:
            ep.hit_context_limit = True
            break
        last = steps.turns[-1] if steps.turns else None
        repeats = prompt_seen(ep.turns, prompt_ids)  # the records keep every prompt
        gen = await policy.respond(TurnRequest(ep.episode_id, item, len(steps.turns), msgs, prompt_ids,
                                               last.parsed if last else None, last.observation if last else None,
                                               repeats=repeats))
        step = steps.take(gen.token_ids, tokenizer)
        if step.request is not None:
            steps.observe(*await call_tool(env, step.request, reader))
        ep.turns.append(TurnRecord.from_step(step, prompt_ids, gen.logprobs))
    ep.final_answer = steps.final_answer
    ep.hit_turn_limit = steps.termination == "turn_limit"
    return ep


async def call_tool(env: ToolEnv, request: ToolRequest, reader: ArticleReader) -> tuple[str, str | None]:
    """(observation, short form or None) of a turn's search / access."""
    if request.action == "access":
        return await env.access(request.argument, reader)
    return await env.search(request.argument), None


async def arun_episodes(
    items: Sequence[Task],
    policy: TurnPolicy,
    env: ToolEnv,
    tokenizer: Any,
    context: ContextKind | ContextFactory = "memory",
    config: RolloutConfig | None = None,
    n_rollouts: int = 1,
    system_prompt: str = SYSTEM_PROMPT,
    on_episode: Callable[[Episode], None] | None = None,
    progress: bool = True,
) -> list[Episode]:
    """Run `n_rollouts` episodes per item concurrently; results in (item, rollout) order.

    Episode ids are `f"{item.id}#{r}"` (an item listed twice gets `f"{item.id}#{r}.{n}"` for
    its n-th repeat, so ids stay unique); the group of an episode (for GRPO) is its item id.
    """
    cfg = config or RolloutConfig()
    sem = asyncio.Semaphore(max(1, cfg.max_concurrent_episodes))
    jobs: list[tuple[Task, str]] = []
    seen: dict[str, int] = {}
    for item in items:
        for r in range(n_rollouts):
            eid = f"{item.id}#{r}"
            n = seen.get(eid, 0)
            seen[eid] = n + 1
            jobs.append((item, eid if n == 0 else f"{eid}.{n}"))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc=f"rollouts ({getattr(context, '__name__', context)})", unit="ep", leave=False)

    async def one(item: Task, eid: str) -> Episode:
        async with sem:
            ep = await run_episode(item, policy, env, tokenizer, context, cfg, eid, system_prompt)
        if bar is not None:
            bar.update(1)
        if on_episode is not None:
            on_episode(ep)
        return ep

    try:
        return list(await asyncio.gather(*(one(i, eid) for i, eid in jobs)))
    finally:
        if bar is not None:
            bar.close()


def run_episodes(*args: Any, **kwargs: Any) -> list[Episode]:
    """Synchronous `arun_episodes` (starts its own event loop)."""
    return asyncio.run(arun_episodes(*args, **kwargs))
