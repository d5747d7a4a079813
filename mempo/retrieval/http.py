"""HTTP client for the retrieval service (sync and async), behind the `Retriever` interface.

    r = HttpRetriever("http://127.0.0.1:8013")    # token: $MEMPO_RETRIEVER_TOKEN (or _FILE)
    r.search(["Grasdrior Labs"], topk=3)          # -> [[Hit, Hit, Hit]]
    await r.asearch([...])                        # same, with httpx.AsyncClient

Connections are pooled (one httpx client per retriever, per event loop for async).

Retries never add load to a server that is already struggling:
- retried: connection failures (the request never reached the server), a connection the
  server closed or reset before answering (a pooled keep-alive connection it was closing as
  the request went out, or a restarting server: /retrieve and /access are reads, so sending
  one again is safe), and 429/502/503/504, after the server's `Retry-After` when it sends
  one, else exponential backoff with jitter;
- not retried: read timeouts (the server has the request and is slow: a second copy would
  double its work), 500 (a bug does not go away), other 4xx (the caller's mistake, raised
  at once with the server's message);
- a retry budget per client (`RetryBudget`): retries may add at most `retry_ratio` of the
  requests sent (plus a small reserve), so many callers sharing one client cannot turn an
  outage into a retry storm.
Large query lists are split to respect the server's per-request limit.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

from mempo.datasets import Passage
from mempo.errors import MempoError
from mempo.retrieval.auth import read_token
from mempo.retrieval.base import Hit, Retriever
from mempo.retrieval.inprocess import validate_access_args

RETRY_STATUS = frozenset({429, 502, 503, 504})
# How the client waits between attempts (module attributes, so tests can record the waits).
_sleep = time.sleep
_asleep = asyncio.sleep


class RetrievalServiceError(MempoError):
    """The retrieval service refused a request or stayed unreachable after retries."""


class RetryBudget:
    """A token bucket that bounds retries to a fraction of requests (thread-safe).

    Every request deposits `ratio` tokens (up to `cap`); every retry spends one. With
    ratio 0.2, retries add at most 20 % to the load in the long run; `reserve` lets a
    client that has sent little still retry a few times.
    """

    def __init__(self, ratio: float = 0.2, reserve: float = 10.0, cap: float = 100.0) -> None:
        self.ratio = ratio
        self.cap = max(cap, reserve)
        self.tokens = reserve
        self._lock = threading.Lock()

    def deposit(self) -> None:
        with self._lock:
            self.tokens = min(self.cap, self.tokens + self.ratio)

    def withdraw(self) -> bool:
        """Spend one token for a retry; False (no retry) when the budget is empty."""
        with self._lock:
            if self.tokens < 1.0:
                return False
            self.tokens -= 1.0
            return True


def retry_after_s(resp: Any) -> float | None:
    """The response's `Retry-After` in seconds (delta-seconds form), or None."""
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # the HTTP-date form: fall back to our own backoff


class HttpRetriever(Retriever):
    """`Retriever` over the `/retrieve` and `/access` endpoints.

    Args:
        base_url: e.g. "http://127.0.0.1:8013" (a trailing "/retrieve" is accepted).
        token: bearer token; default $MEMPO_RETRIEVER_TOKEN, else the file named by
            $MEMPO_RETRIEVER_TOKEN_FILE (`mempo.retrieval.auth.read_token`).
        token_file: a file holding the token (instead of `token`).
        timeout_s: per-attempt timeout (seconds).
        retries: at most this many extra attempts per request, on retryable failures.
        backoff_s: first backoff without Retry-After; doubles each retry (with jitter).
        max_backoff_s: the longest wait before a retry, Retry-After included.
        retry_ratio: the retry budget (see `RetryBudget`).
        max_connections: connection-pool size.
        max_queries_per_request, max_access_per_request: client-side split sizes (keep them
            <= the server's `max_queries_per_request` / `max_access_items`).
    """

    def __init__(self, base_url: str, *, token: str | None = None,
                 token_file: str | Path | None = None, timeout_s: float = 30.0,
                 retries: int = 3, backoff_s: float = 0.2, max_backoff_s: float = 30.0,
                 retry_ratio: float = 0.2, max_connections: int = 64,
                 max_queries_per_request: int = 256, max_access_per_request: int = 64) -> None:
        import httpx

        base = base_url.rstrip("/")
        for suffix in ("/retrieve", "/access"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
        self.base_url = base
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.budget = RetryBudget(ratio=retry_ratio)
        self.chunk = int(max_queries_per_request)
        self.access_chunk = int(max_access_per_request)
        token = read_token(token, token_file)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(timeout_s)
        self._limits = httpx.Limits(max_connections=max_connections,
                                    max_keepalive_connections=max_connections)
        self._client = httpx.Client(base_url=self.base_url, timeout=self._timeout,
                                    limits=self._limits, headers=self._headers)
        self._aclients: dict[int, Any] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing

    def _delay_s(self, attempt: int, resp: Any) -> float:
        """Seconds to wait before retry number `attempt + 1`."""
        hinted = retry_after_s(resp) if resp is not None else None
        if hinted is not None:
            # Jitter on top of the server's hint, so clients told the same second spread out.
            return min(self.max_backoff_s, hinted * (1 + 0.25 * random.random()))
        return min(self.max_backoff_s, self.backoff_s * (2**attempt) * (0.5 + random.random()))

    def _check(self, resp: Any, path: str) -> dict[str, Any]:
        if resp.status_code >= 400:
            raise RetrievalServiceError(f"{self.base_url}{path} answered {resp.status_code}: "
                                        f"{_detail(resp)}")
        return resp.json()

    def _next_step(self, path: str, attempt: int, resp: Any, error: Exception | None
                   ) -> tuple[float | None, Exception]:
        """(seconds to wait before retrying or None to give up, the error to raise then)."""
        import httpx

        if error is not None:
            failure: Exception = RetrievalServiceError(f"{self.base_url}{path}: {error!r}")
            # A request that never reached the server, or whose connection was closed or reset
            # before any answer, is safe to send again (both endpoints are reads). A timeout
            # is not: the server has the request and is slow.
            retryable = isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout,
                                           httpx.RemoteProtocolError, httpx.ReadError,
                                           httpx.WriteError))
            if isinstance(error, httpx.TimeoutException) and not isinstance(error, httpx.ConnectTimeout):
                failure = RetrievalServiceError(
                    f"{self.base_url}{path} did not answer within the timeout ({error!r}); not "
                    "retried, since the server already has the request (raise timeout_s if "
                    "the service is known to be slow)")
        else:
            failure = RetrievalServiceError(f"{self.base_url}{path} answered {resp.status_code}: "
                                            f"{_detail(resp)}")
            retryable = resp.status_code in RETRY_STATUS
        if not retryable:
            return None, failure
        if attempt >= self.retries:
            return None, RetrievalServiceError(f"{failure} (gave up after {attempt + 1} attempts)")
        if not self.budget.withdraw():
            return None, RetrievalServiceError(f"{failure} (not retried: the retry budget of this "
                                               "client is spent, the service is failing too often)")
        return self._delay_s(attempt, resp), failure

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        self.budget.deposit()
        for attempt in range(self.retries + 1):
            resp, error = None, None
            try:
                resp = self._client.post(path, json=body)
                if resp.status_code < 400:
                    return resp.json()
            except httpx.TransportError as e:
                error = e
            wait, failure = self._next_step(path, attempt, resp, error)
            if wait is None:
                raise failure
            _sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    def _aclient(self) -> Any:
        import httpx

        loop_id = id(asyncio.get_running_loop())
        with self._lock:
            client = self._aclients.get(loop_id)
            if client is None:
                # One AsyncClient per event loop: httpx async pools are bound to their loop.
                client = httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout,
                                           limits=self._limits, headers=self._headers)
                self._aclients[loop_id] = client
        return client

    async def _apost(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        client = self._aclient()
        self.budget.deposit()
        for attempt in range(self.retries + 1):
            resp, error = None, None
            try:
                resp = await client.post(path, json=body)
                if resp.status_code < 400:
                    return resp.json()
            except httpx.TransportError as e:
                error = e
            wait, failure = self._next_step(path, attempt, resp, error)
            if wait is None:
                raise failure
            await _asleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _hits(result: list[list[dict[str, Any]]]) -> list[list[Hit]]:
        return [[Hit(str(it["document"]["id"]), it["document"]["contents"], float(it["score"]))
                 for it in items] for items in result]

    @staticmethod
    def _passages(answer: dict[str, Any]) -> list[list[Passage]]:
        articles = [[Passage(str(d["id"]), d["contents"]) for d in items] for items in answer["result"]]
        # The server sends each article once; later items naming it point back to the first.
        for item, first in (answer.get("duplicate_of") or {}).items():
            articles[int(item)] = list(articles[int(first)])
        return articles

    def _chunks(self, items: list[str], size: int | None = None) -> list[list[str]]:
        size = size or self.chunk
        return [items[i : i + size] for i in range(0, len(items), size)]

    # ------------------------------------------------------------------ Retriever

    def search(self, queries: list[str], topk: int = 3) -> list[list[Hit]]:
        out: list[list[Hit]] = []
        for part in self._chunks(list(queries)):
            body = {"queries": part, "topk": int(topk), "return_scores": True}
            out.extend(self._hits(self._post("/retrieve", body)["result"]))
        return out

    async def asearch(self, queries: list[str], topk: int = 3) -> list[list[Hit]]:
        out: list[list[Hit]] = []
        for part in self._chunks(list(queries)):
            body = {"queries": part, "topk": int(topk), "return_scores": True}
            out.extend(self._hits((await self._apost("/retrieve", body))["result"]))
        return out

    def access(self, ids: list[str] | None = None,
               titles: list[str] | None = None) -> list[list[Passage]]:
        keys = validate_access_args(ids, titles)
        field = "ids" if ids is not None else "titles"
        out: list[list[Passage]] = []
        for part in self._chunks(keys, self.access_chunk):
            out.extend(self._passages(self._post("/access", {field: part})))
        return out

    async def aaccess(self, ids: list[str] | None = None,
                      titles: list[str] | None = None) -> list[list[Passage]]:
        keys = validate_access_args(ids, titles)
        field = "ids" if ids is not None else "titles"
        out: list[list[Passage]] = []
        for part in self._chunks(keys, self.access_chunk):
            out.extend(self._passages(await self._apost("/access", {field: part})))
        return out

    def health(self) -> dict[str, Any]:
        """GET /health (raises RetrievalServiceError when not serving)."""
        return self._check(self._client.get("/health"), "/health")

    def ready(self) -> bool:
        """GET /ready: True when the service is up and not saturated."""
        return self._client.get("/ready").status_code == 200

    def close(self) -> None:
        self._client.close()
        with self._lock:
            clients, self._aclients = list(self._aclients.values()), {}
        for c in clients:
            try:
                asyncio.get_running_loop().create_task(c.aclose())
            except RuntimeError:  # no running loop: close on a fresh one
                try:
                    asyncio.run(c.aclose())
                except RuntimeError:
                    pass


def _detail(resp: Any) -> str:
    try:
        return str(resp.json().get("detail", resp.text))
    except (ValueError, AttributeError):
        return resp.text
