"""The retrieval service: Search-R1's `/retrieve` contract, batched, with limits and metrics.

    mempo serve retriever --index outputs/index --port 8013
    curl -s 127.0.0.1:8013/retrieve -d '{"queries": ["Grasdrior Labs"], "topk": 3, "return_scores": true}'

Endpoints:
- `POST /retrieve` `{"queries": [str], "topk": int, "return_scores": bool}` ->
  `{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}` (or `{"id", "contents"}`
  items without scores). Same shapes as Search-R1's retrieval_server, so its clients work.
- `POST /access` `{"ids": [...]}` or `{"titles": [...]}` -> `{"result": [[{"id", "contents"}]]}`:
  the whole article per item; unknown ones get `[]`.
- `GET /health` (ready + manifest summary), `GET /metrics` (Prometheus).

Cross-request micro-batching: requests arriving within `batch_window_ms` (or until
`max_batch_queries` queries) are encoded in one forward pass and searched in one FAISS
call. `batching=False` serves each request alone (Search-R1's behaviour), for comparison.
Bad requests get a 4xx with `{"detail": message}`; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mempo.config import ServiceLimitParams
from mempo.retrieval.base import Hit, Retriever

log = logging.getLogger(__name__)


class ServiceLimits(ServiceLimitParams):
    """Request limits and batching knobs (params.yaml `serve:`, `ServiceLimitParams`) plus the
    optional bearer token, which comes from `--token` or the environment, never from params."""

    token: str | None = None


class BadRequest(Exception):
    """A client error: HTTP `status` with a one-line message."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


# ---------------------------------------------------------------------- request parsing


def _parse_body(raw: bytes, limits: ServiceLimits) -> dict[str, Any]:
    if len(raw) > limits.max_body_bytes:
        raise BadRequest(413, f"body is {len(raw)} bytes, over the {limits.max_body_bytes}-byte limit",
                         "body_too_large")
    if not raw.strip():
        raise BadRequest(400, "empty body; send a JSON object", "empty_body")
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise BadRequest(400, "body is not valid UTF-8", "bad_encoding") from None
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"body is not valid JSON: {e.msg} at column {e.colno}",
                         "bad_json") from None
    if not isinstance(obj, dict):
        raise BadRequest(422, f"body must be a JSON object, got {type(obj).__name__}", "not_object")
    return obj


def _string_list(obj: dict[str, Any], key: str, max_items: int, max_chars: int | None) -> list[str]:
    value = obj[key]
    if not isinstance(value, list):
        raise BadRequest(422, f"'{key}' must be a list of strings, got {type(value).__name__}",
                         f"{key}_not_list")
    if not value:
        raise BadRequest(422, f"'{key}' must not be empty", f"{key}_empty")
    if len(value) > max_items:
        raise BadRequest(422, f"'{key}' has {len(value)} items, over the limit of {max_items} "
                         "per request; split it", f"too_many_{key}")
    for i, q in enumerate(value):
        if not isinstance(q, str):
            raise BadRequest(422, f"'{key}[{i}]' must be a string, got {type(q).__name__}",
                             f"{key}_item_not_string")
        if not q.strip():
            raise BadRequest(422, f"'{key}[{i}]' is empty", f"{key}_item_empty")
        if max_chars is not None and len(q) > max_chars:
            raise BadRequest(422, f"'{key}[{i}]' has {len(q)} characters, over the limit of "
                             f"{max_chars}", f"{key}_item_too_long")
    return value


def parse_retrieve(obj: dict[str, Any], limits: ServiceLimits) -> tuple[list[str], int, bool]:
    """Validate a /retrieve body -> (queries, topk, return_scores). Raises BadRequest."""
    if "queries" not in obj:
        raise BadRequest(422, "missing required field 'queries' (a list of strings)", "missing_queries")
    queries = _string_list(obj, "queries", limits.max_queries_per_request, limits.max_query_chars)
    topk = obj.get("topk")
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise BadRequest(422, f"'topk' must be an integer, got {type(topk).__name__}", "topk_not_int")
    if not 1 <= topk <= limits.max_topk:
        raise BadRequest(422, f"'topk' must be between 1 and {limits.max_topk}, got {topk}",
                         "topk_out_of_range")
    scores = obj.get("return_scores", False)
    if scores is None:
        scores = False
    if not isinstance(scores, bool):
        raise BadRequest(422, f"'return_scores' must be true or false, got {type(scores).__name__}",
                         "return_scores_not_bool")
    return queries, topk, scores


def parse_access(obj: dict[str, Any], limits: ServiceLimits) -> tuple[str, list[str]]:
    """Validate an /access body -> ("ids" | "titles", keys). Raises BadRequest."""
    given = [k for k in ("ids", "titles") if obj.get(k) is not None]
    if len(given) != 1:
        raise BadRequest(422, "give exactly one of 'ids' or 'titles' (a list of strings)",
                         "access_keys")
    key = given[0]
    return key, _string_list(obj, key, limits.max_access_items, limits.max_query_chars)


# ---------------------------------------------------------------------- micro-batching


@dataclass
class _Job:
    queries: list[str]
    topk: int
    future: asyncio.Future[list[list[Hit]]]
    enqueued: float = field(default_factory=time.perf_counter)


class MicroBatcher:
    """Collects concurrent search requests into one `search_fn` call.

    The first waiting request opens a window of `window_s`; requests arriving inside it
    (up to `max_queries` queries in total) join the batch. One batch runs at a time in a
    worker thread, so while it runs the next batch fills up: under load the window rarely
    matters and batches grow with the number of concurrent clients.
    """

    def __init__(self, search_fn: Callable[[list[str], int], list[list[Hit]]], window_s: float,
                 max_queries: int, on_batch: Callable[[int], None] | None = None) -> None:
        self.search_fn = search_fn
        self.window_s = window_s
        self.max_queries = max_queries
        self.on_batch = on_batch
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Finish queued work, then stop the worker."""
        while not self.queue.empty():
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def submit(self, queries: list[str], topk: int) -> list[list[Hit]]:
        fut: asyncio.Future[list[list[Hit]]] = asyncio.get_running_loop().create_future()
        await self.queue.put(_Job(queries, topk, fut))
        return await fut

    async def _collect(self) -> list[_Job]:
        batch = [await self.queue.get()]
        n = len(batch[0].queries)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window_s
        while n < self.max_queries:
            if not self.queue.empty():
                job = self.queue.get_nowait()
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self.queue.get(), remaining)
                except TimeoutError:
                    break
            batch.append(job)
            n += len(job.queries)
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._collect()
            queries = [q for job in batch for q in job.queries]
            k = max(job.topk for job in batch)
            if self.on_batch:
                self.on_batch(len(queries))
            try:
                results = await asyncio.to_thread(self.search_fn, queries, k)
            except Exception as e:  # noqa: BLE001 - handed to every waiting request
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(e)
                continue
            i = 0
            for job in batch:
                part = results[i : i + len(job.queries)]
                i += len(job.queries)
                if not job.future.done():
                    job.future.set_result([hits[: job.topk] for hits in part])


# ---------------------------------------------------------------------- the app


class _Metrics:
    """Prometheus metrics on a per-app registry (several apps can live in one process)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("mempo_retriever_requests", "HTTP requests",
                                ["endpoint", "status"], registry=self.registry)
        self.queries = Counter("mempo_retriever_queries", "queries searched", registry=self.registry)
        self.errors = Counter("mempo_retriever_errors", "requests answered with an error",
                              ["endpoint", "reason"], registry=self.registry)
        self.batch_size = Histogram(
            "mempo_retriever_batch_queries", "queries per search call (micro-batch size)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=self.registry)
        self.latency = Histogram(
            "mempo_retriever_latency_seconds", "request latency", ["endpoint"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry)


def manifest_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    enc = manifest.get("encoder") or {}
    return {
        "method": manifest.get("method"),
        "index_type": manifest.get("index_type"),
        "count": manifest.get("count"),
        "encoder": enc.get("name"),
        "dim": manifest.get("dim"),
        "corpus_sha256": (manifest.get("corpus") or {}).get("sha256"),
    }


def create_app(retriever: Retriever, limits: ServiceLimits | None = None,
               manifest: dict[str, Any] | None = None) -> Any:
    """The FastAPI app serving `retriever` under `limits`. Run it with uvicorn."""
    limits = limits or ServiceLimits()
    manifest = manifest if manifest is not None else getattr(retriever, "manifest", {}) or {}
    metrics = _Metrics()
    state: dict[str, Any] = {"batcher": None, "ready": False}

    def search_sync(queries: list[str], k: int) -> list[list[Hit]]:
        metrics.queries.inc(len(queries))
        return retriever.search(queries, k)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if limits.batching:
            batcher = MicroBatcher(search_sync, limits.batch_window_ms / 1000.0,
                                   limits.max_batch_queries, metrics.batch_size.observe)
            batcher.start()
            state["batcher"] = batcher
        state["ready"] = True
        yield
        state["ready"] = False
        if state["batcher"] is not None:
            await state["batcher"].stop()

    app = FastAPI(title="mempo retriever", lifespan=lifespan, docs_url=None, redoc_url=None)

    def error(endpoint: str, e: BadRequest) -> JSONResponse:
        metrics.errors.labels(endpoint, e.reason).inc()
        metrics.requests.labels(endpoint, str(e.status)).inc()
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse({"detail": e.message}, status_code=e.status, headers=headers)

    def check_auth(request: Request) -> None:
        if limits.token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value:
            raise BadRequest(401, "missing bearer token (Authorization: Bearer <token>)", "no_token")
        if not hmac.compare_digest(value.strip().encode(), limits.token.encode()):
            raise BadRequest(401, "invalid bearer token", "bad_token")

    async def read_body(request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise BadRequest(413, f"body is {declared} bytes, over the {limits.max_body_bytes}-byte "
                             "limit", "body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise BadRequest(413, f"body is over the {limits.max_body_bytes}-byte limit",
                                 "body_too_large")
            chunks.append(chunk)
        return _parse_body(b"".join(chunks), limits)

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            check_auth(request)
            queries, topk, with_scores = parse_retrieve(await read_body(request), limits)
        except BadRequest as e:
            return error("retrieve", e)
        try:
            if state["batcher"] is not None:
                results = await state["batcher"].submit(queries, topk)
            else:
                results = await asyncio.to_thread(search_sync, queries, topk)
                metrics.batch_size.observe(len(queries))
        except Exception as e:  # noqa: BLE001 - a failed search is a 500, not a dead server
            log.exception("search failed")
            metrics.errors.labels("retrieve", "internal").inc()
            metrics.requests.labels("retrieve", "500").inc()
            return JSONResponse({"detail": f"search failed: {type(e).__name__}: {e}"}, status_code=500)
        body = {"result": [[_item(h, with_scores) for h in hits] for hits in results]}
        metrics.requests.labels("retrieve", "200").inc()
        metrics.latency.labels("retrieve").observe(time.perf_counter() - t0)
        return _json_response(body)

    @app.post("/access")
    async def access(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            check_auth(request)
            key, keys = parse_access(await read_body(request), limits)
        except BadRequest as e:
            return error("access", e)
        kw = {key: keys}
        articles = await asyncio.to_thread(retriever.access, **kw)
        metrics.requests.labels("access", "200").inc()
        metrics.latency.labels("access").observe(time.perf_counter() - t0)
        return JSONResponse({"result": [[p.to_dict() for p in art] for art in articles]})

    @app.get("/health")
    async def health() -> Response:
        ready = bool(state["ready"])
        return JSONResponse({"status": "ready" if ready else "starting", "batching": limits.batching,
                             "index": manifest_summary(manifest)}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    app.state.limits = limits
    return app


def _json_response(body: dict[str, Any]) -> Response:
    """JSON response; orjson when installed (several times faster on large results)."""
    try:
        import orjson
    except ImportError:
        return JSONResponse(body)
    return Response(orjson.dumps(body), media_type="application/json")


def _item(hit: Hit, with_score: bool) -> dict[str, Any]:
    score = hit.score if math.isfinite(hit.score) else 0.0
    doc = {"id": hit.id, "contents": hit.contents}
    return {"document": doc, "score": score} if with_score else doc


class BackgroundServer:
    """Run an app with uvicorn in a daemon thread (tests, benchmarks, notebooks).

        with BackgroundServer(app, port=0) as srv:
            httpx.get(f"{srv.url}/health")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 graceful_timeout_s: float = 10.0) -> None:
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=graceful_timeout_s, lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread: Any = None

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        import threading

        self._thread = threading.Thread(target=self.server.run, daemon=True, name="uvicorn")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"retrieval server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask uvicorn to exit (in-flight requests finish first) and wait for it."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_retriever(index_dir: str, *, host: str = "127.0.0.1", port: int = 8013,
                    encoder: str | None = None, device: str = "cpu",
                    limits: ServiceLimits | None = None, log_level: str = "info",
                    graceful_timeout_s: float = 30.0) -> None:
    """Load `index_dir` and serve it until SIGINT/SIGTERM (in-flight requests drain first)."""
    import uvicorn

    from mempo.retrieval.index import load_index

    retriever = load_index(index_dir, encoder=encoder, device=device)
    app = create_app(retriever, limits, retriever.manifest)
    log.info("serving %s on http://%s:%d", index_dir, host, port)

    def stopped(signum: int, frame: Any) -> None:
        # uvicorn drains in-flight requests, restores this handler and re-raises SIGTERM:
        # a requested stop after a clean drain is a normal exit (0), not a crash (-15).
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                    timeout_graceful_shutdown=graceful_timeout_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
        retriever.close()
        log.info("retrieval service stopped")
