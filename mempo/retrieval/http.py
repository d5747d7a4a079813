"""HTTP client for the retrieval service (sync and async), behind the `Retriever` interface.

    r = HttpRetriever("http://127.0.0.1:8013", token=None, timeout_s=10, retries=3)
    r.search(["Grasdrior Labs"], topk=3)          # -> [[Hit, Hit, Hit]]
    await r.asearch([...])                        # same, with httpx.AsyncClient

Connections are pooled (one httpx client per retriever, per event loop for async).
Connection errors, timeouts, 429 and 5xx are retried with exponential backoff and jitter;
other 4xx answers are the caller's mistake and raise `MempoError` with the server's message
at once. Large query lists are split to respect the server's per-request limit.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

from mempo.datasets import Passage
from mempo.errors import MempoError
from mempo.retrieval.base import Hit, Retriever
from mempo.retrieval.inprocess import validate_access_args

_RETRY_STATUS = {429, 502, 503, 504, 500}


class RetrievalServiceError(MempoError):
    """The retrieval service refused a request or stayed unreachable after retries."""


class HttpRetriever(Retriever):
    """`Retriever` over the `/retrieve` and `/access` endpoints.

    Args:
        base_url: e.g. "http://127.0.0.1:8013" (a trailing "/retrieve" is accepted).
        token: bearer token, if the service requires one.
        timeout_s: per-attempt timeout (seconds).
        retries: extra attempts after the first on retryable failures.
        backoff_s: first backoff; doubles each retry (+ up to 50 % jitter).
        max_connections: connection-pool size.
        max_queries_per_request, max_access_per_request: client-side split sizes (keep them
            <= the server's `max_queries_per_request` / `max_access_items`).
    """

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 30.0,
                 retries: int = 3, backoff_s: float = 0.2, max_connections: int = 64,
                 max_queries_per_request: int = 256, max_access_per_request: int = 64) -> None:
        import httpx

        base = base_url.rstrip("/")
        for suffix in ("/retrieve", "/access"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
        self.base_url = base
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.chunk = int(max_queries_per_request)
        self.access_chunk = int(max_access_per_request)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(timeout_s)
        self._limits = httpx.Limits(max_connections=max_connections,
                                    max_keepalive_connections=max_connections)
        self._client = httpx.Client(base_url=self.base_url, timeout=self._timeout,
                                    limits=self._limits, headers=self._headers)
        self._aclients: dict[int, Any] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing

    def _sleep_s(self, attempt: int) -> float:
        return self.backoff_s * (2**attempt) * (1 + 0.5 * random.random())

    def _check(self, resp: Any, path: str) -> dict[str, Any]:
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise RetrievalServiceError(f"{self.base_url}{path} answered {resp.status_code}: {detail}")
        return resp.json()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                resp = self._client.post(path, json=body)
                if resp.status_code not in _RETRY_STATUS:
                    return self._check(resp, path)
                last = RetrievalServiceError(f"{self.base_url}{path} answered {resp.status_code}")
            except httpx.TransportError as e:  # connect, read, timeouts
                last = e
            if attempt < self.retries:
                time.sleep(self._sleep_s(attempt))
        raise RetrievalServiceError(
            f"{self.base_url}{path} failed after {self.retries + 1} attempts: {last}")

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
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                resp = await client.post(path, json=body)
                if resp.status_code not in _RETRY_STATUS:
                    return self._check(resp, path)
                last = RetrievalServiceError(f"{self.base_url}{path} answered {resp.status_code}")
            except httpx.TransportError as e:
                last = e
            if attempt < self.retries:
                await asyncio.sleep(self._sleep_s(attempt))
        raise RetrievalServiceError(
            f"{self.base_url}{path} failed after {self.retries + 1} attempts: {last}")

    @staticmethod
    def _hits(result: list[list[dict[str, Any]]]) -> list[list[Hit]]:
        return [[Hit(str(it["document"]["id"]), it["document"]["contents"], float(it["score"]))
                 for it in items] for items in result]

    @staticmethod
    def _passages(result: list[list[dict[str, Any]]]) -> list[list[Passage]]:
        return [[Passage(str(d["id"]), d["contents"]) for d in items] for items in result]

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
            out.extend(self._passages(self._post("/access", {field: part})["result"]))
        return out

    async def aaccess(self, ids: list[str] | None = None,
                      titles: list[str] | None = None) -> list[list[Passage]]:
        keys = validate_access_args(ids, titles)
        field = "ids" if ids is not None else "titles"
        out: list[list[Passage]] = []
        for part in self._chunks(keys, self.access_chunk):
            out.extend(self._passages((await self._apost("/access", {field: part}))["result"]))
        return out

    def health(self) -> dict[str, Any]:
        """GET /health (raises RetrievalServiceError when not ready)."""
        return self._check(self._client.get("/health"), "/health")

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
