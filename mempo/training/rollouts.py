"""Reproducible rollouts for training: lockstep batching over the core rollout loop.

The core `GeneratorPolicy` batches whichever turns are ready, which depends on thread
timing (retriever calls run in worker threads), so the batch a prompt lands in — and with
it the sampled tokens — can change from run to run. Training must be deterministic for a
seed, so `LockstepPolicy` waits until every live episode has asked for its next turn, then
generates them as ONE batch in episode order. Same seed, same prompts, same batches, same
samples; the episode loop itself is `mempo.agent.rollout.arun_episodes`, unchanged.

    episodes = lockstep_episodes(items, generator, sampling, env, tokenizer, n_rollouts=4)
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from mempo.agent.context import ContextKind
from mempo.agent.generation import Generation, Generator, SamplingParams
from mempo.agent.rollout import Episode, RolloutConfig, TurnRequest, arun_episodes, generate_batch
from mempo.agent.tools import ToolEnv
from mempo.tasks import Task


class LockstepPolicy:
    """A `TurnPolicy` that generates one batch per turn index across all live episodes.

    Args:
        generator: any `Generator` (e.g. `HFGenerator`).
        sampling: sampling settings for every turn.
        n_episodes: episodes that will run (all concurrently).
        order: episode id -> position; batches are sorted by it.
    """

    def __init__(self, generator: Generator, sampling: SamplingParams, n_episodes: int,
                 order: dict[str, int]) -> None:
        self.generator = generator
        self.sampling = sampling
        self.live = n_episodes
        self.order = order
        self.generate_calls = 0
        self._pending: dict[str, tuple[list[int], asyncio.Future[Generation]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # keeps flush tasks referenced

    async def respond(self, request: TurnRequest) -> Generation:
        fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._pending[request.episode_id] = (list(request.prompt_ids), fut)
        self._maybe_flush()
        return await fut

    def episode_done(self, episode: Episode) -> None:
        """`on_episode` hook: one fewer episode to wait for."""
        self.live -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        # The batch is taken synchronously, so two flushes can never share a request; a new
        # flush can only start once every live episode is waiting again (the next turn).
        if self._pending and len(self._pending) >= self.live:
            ids = sorted(self._pending, key=lambda e: self.order.get(e, 0))
            batch = [self._pending.pop(e) for e in ids]
            task = asyncio.get_running_loop().create_task(self._flush(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flush(self, batch: list[tuple[list[int], asyncio.Future[Generation]]]) -> None:
        self.generate_calls += 1
        await generate_batch(self.generator, self.sampling, batch)


def lockstep_episodes(
    items: Sequence[Task],
    generator: Generator,
    sampling: SamplingParams,
    env: ToolEnv,
    tokenizer: Any,
    n_rollouts: int = 1,
    config: RolloutConfig | None = None,
    progress: bool = False,
    context: ContextKind = "memory",
) -> list[Episode]:
    """Run `n_rollouts` episodes per item with lockstep batching; (item, rollout) order.

    Episode ids are `f"{item.id}#{r}"` (as in `arun_episodes`); the item id is the GRPO group.
    `context`: what the policy sees each turn ("memory": MemPO's; "full": the whole history).
    """
    cfg = config or RolloutConfig()
    n = len(items) * n_rollouts
    run_cfg = dataclasses.replace(cfg, max_concurrent_episodes=max(n, 1))
    order = {f"{it.id}#{r}": k * n_rollouts + r for k, it in enumerate(items) for r in range(n_rollouts)}
    if len(order) != n:
        raise ValueError("item ids must be unique within a rollout batch")

    async def go() -> list[Episode]:
        policy = LockstepPolicy(generator, sampling, n, order)
        return await arun_episodes(items, policy, env, tokenizer, context, run_cfg, n_rollouts,
                                   on_episode=policy.episode_done, progress=progress)

    return asyncio.run(go())
