"""The retrieval service as a verl `BaseTool`: `<search>` and `<access>` over HTTP.

The tool talks to `mempo serve retriever` (Search-R1 contract: POST /retrieve
`{queries, topk, return_scores}` -> `{result: [[{document: {id, contents}, score}]]}`)
through `mempo.retrieval.open_retriever(url)` (the project's HTTP client), and formats
results with the agent's own `ToolEnv` (`<information> Doc 1(Title: ...) ... </information>`),
so observations are the same text the local trainer and the evaluation show the model.

Declared in `configs/verl/retrieval_tool.yaml` (verl's tool-config format) and loaded by
verl once per agent-loop worker; `MemAgentLoop` calls it directly for each action:

    instance_id, _ = await tool.create()                  # per episode: its <access> cursor
    resp, _, info = await tool.execute(instance_id, {"action": "search", "query": "X founder"})
    resp.text          # "<information> Doc 1(Title: ...) ... </information>"
    await tool.release(instance_id)

A slow or failing service must not kill a training step: each call has a timeout
(`timeout_s`), requests are rate-limited per worker (`max_requests_per_s`, token bucket,
plus `max_concurrency` in flight), and a failure becomes an `<information>` block saying
so (counted in the returned info as `ok=False`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from mempo.agent.format import format_observation
from mempo.agent.tools import ArticleReader, ToolConfig, ToolEnv
from mempo.config.base import default_of
from mempo.config.episodes import RolloutParams, VerlParams

log = logging.getLogger(__name__)

TOOL_NAME = "retrieve"

DEFAULT_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Search the knowledge base, or read a whole article by title or doc id.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "search query, or the article title / doc id"},
                "action": {"type": "string", "description": "search (default) or access", "enum": ["search", "access"]},
            },
            "required": ["query"],
        },
    },
}


@dataclass(frozen=True)
class RetrievalToolConfig:
    """The tool's `config:` block in the tool YAML (besides verl's `type: native`).

    Attributes:
        retriever: base URL of `mempo serve retriever` (binds 127.0.0.1 by default; on a
            cluster, the service's address reachable from every node). Anything else
            `mempo.retrieval.open_retriever` accepts (an index folder, a corpus .jsonl) loads
            the retriever in the worker process instead (single-node runs, tests).
        topk: passages per search.
        timeout_s: seconds one search / access may take before it counts as failed.
        max_requests_per_s: sustained request rate per agent-loop worker (token bucket).
        burst: requests allowed at once above the sustained rate.
        max_concurrency: requests in flight per worker.
        observation_max_tokens: results are cut to this many policy tokens.
        access_chunk_chars: `<access>` shows articles in chunks of this many characters.
        short_text_chars: characters kept per chunk once the access is no longer the last turn.
    """

    retriever: str = default_of(VerlParams, "retriever")
    topk: int = default_of(RolloutParams, "topk")
    timeout_s: float = 10.0
    max_requests_per_s: float = 100.0
    burst: int = 32
    max_concurrency: int = 32
    observation_max_tokens: int = default_of(RolloutParams, "observation_max_tokens")
    access_chunk_chars: int = default_of(RolloutParams, "access_chunk_chars")
    short_text_chars: int = default_of(RolloutParams, "short_text_chars")

    @classmethod
    def from_mapping(cls, config: dict[str, Any]) -> RetrievalToolConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - names - {"type"})
        if unknown:
            raise ValueError(f"unknown retrieval tool config keys: {unknown} (valid: {sorted(names)})")
        return cls(**{k: v for k, v in config.items() if k in names})


class TokenBucket:
    """Async token-bucket rate limiter: `rate` requests per second, bursts up to `burst`.

    `clock` and `sleep` are injectable so the schedule can be tested without waiting.
    """

    def __init__(
        self, rate: float, burst: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate, self.burst = float(rate), float(burst)
        self.clock, self.sleep = clock, sleep
        self.tokens = float(burst)
        self.updated = clock()
        self._lock: asyncio.Lock | None = None

    async def acquire(self) -> float:
        """Wait for one token; returns the seconds waited (as measured by `clock`)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        start = self.clock()
        async with self._lock:
            while True:
                now = self.clock()
                self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
                self.updated = now
                if self.tokens >= 1.0:
                    self.tokens -= 1.0
                    return self.clock() - start
                await self.sleep((1.0 - self.tokens) / self.rate)


class RetrievalTool(BaseTool):
    """verl BaseTool over the retrieval HTTP service (see module docstring)."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(DEFAULT_TOOL_SCHEMA)
        super().__init__(config, schema)
        self.settings = RetrievalToolConfig.from_mapping(dict(config or {}))
        self.limiter = TokenBucket(self.settings.max_requests_per_s, self.settings.burst)
        self._gate: asyncio.Semaphore | None = None
        self._env: ToolEnv | None = None
        self._tokenizer: Any | None = None
        self._readers: dict[str, ArticleReader] = {}

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Cut observations in tokens of the policy's tokenizer (called by the agent loop)."""
        self._tokenizer = tokenizer
        if self._env is not None:
            self._env.tokenizer = tokenizer

    def env(self) -> ToolEnv:
        """The `ToolEnv` over the HTTP retriever, created on first use (in the worker process)."""
        if self._env is None:
            from mempo.retrieval import open_retriever

            s = self.settings
            is_http = s.retriever.startswith(("http://", "https://"))
            retriever = open_retriever(s.retriever, **({"timeout_s": s.timeout_s} if is_http else {}))
            self._env = ToolEnv(retriever, self._tokenizer, ToolConfig.from_params(s))
        return self._env

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid4().hex
        self._readers[instance_id] = ArticleReader()
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        """Run one search / access. Returns (observation, 0.0 tool reward, info).

        info: `ok` (bool), `latency_s`, `waited_s` (rate limiter), `short_observation`
        (the access result's short form; the observation itself for a search), `error`.
        """
        action = str(parameters.get("action") or "search")
        query = str(parameters.get("query") or "").strip()
        if action not in ("search", "access") or not query:
            obs = format_observation(f"Invalid tool call: action={action!r}, query={query!r}.")
            return ToolResponse(text=obs), 0.0, {"ok": False, "error": "invalid call", "short_observation": obs}
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.settings.max_concurrency)
        reader = self._readers.setdefault(instance_id, ArticleReader())
        env = self.env()
        t0 = time.monotonic()
        async with self._gate:
            waited = await self.limiter.acquire()
            try:
                if action == "search":
                    obs = await asyncio.wait_for(env.search(query), self.settings.timeout_s)
                    short = obs
                else:
                    obs, short = await asyncio.wait_for(env.access(query, reader), self.settings.timeout_s)
                info: dict[str, Any] = {"ok": True, "error": ""}
            except Exception as e:  # noqa: BLE001 - a failed call is an observation, not a crash
                reason = "timed out" if isinstance(e, TimeoutError) else f"failed ({type(e).__name__})"
                log.warning("retrieval %s %s for %r: %s", action, reason, query, e)
                obs = short = format_observation(f"The {action} {reason}; try again or answer.")
                info = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        info.update(latency_s=time.monotonic() - t0, waited_s=waited, short_observation=short)
        return ToolResponse(text=obs), 0.0, info

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._readers.pop(instance_id, None)
