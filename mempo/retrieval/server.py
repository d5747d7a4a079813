"""The retrieval service: Search-R1's `/retrieve` contract, batched, bounded, with metrics.

    MEMPO_RETRIEVER_TOKEN=... mempo serve retriever --index outputs/index --port 8013
    curl -s 127.0.0.1:8013/retrieve -H "Authorization: Bearer $MEMPO_RETRIEVER_TOKEN" \
        -d '{"queries": ["Grasdrior Labs"], "topk": 3, "return_scores": true}'

Endpoints:
- `POST /retrieve` `{"queries": [str], "topk": int, "return_scores": bool}` ->
  `{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}` (or `{"id", "contents"}`
  items without scores). Same shapes as Search-R1's retrieval_server, so its clients work.
- `POST /access` `{"ids": [...]}` or `{"titles": [...]}` -> `{"result": [[{"id", "contents"}]]}`:
  the whole article per item; unknown ones get `[]`. An article is sent once per response:
  a later item naming the same article gets `[]` and `"duplicate_of": {"<item>": <earlier item>}`
  says which (`HttpRetriever.access` fills them back in).
- `GET /health` (liveness: 200 while serving, with the queue depth and the index manifest),
  `GET /ready` (readiness: 503 while starting or while the queue is past
  `ready_queue_fraction`), `GET /metrics` (Prometheus). These three need no token.

Scheduling: requests wait in one bounded queue (`max_queue_queries` queries; more get 503 with
`Retry-After`). A free worker takes everything waiting (up to `max_batch_queries`) and encodes
it in one forward pass and one FAISS call: a lone request is dispatched at once, requests
that arrive while the workers are busy share the next batch. `workers` batches run at once,
each in its own thread. A request still unanswered after `request_timeout_s` gets 503 and is
dropped from the queue; a request whose client hung up is dropped without being searched.
`batching=False` serves each request alone (Search-R1's behaviour), for comparison.
Bad requests get a 4xx with `{"detail": message}`; failures get a 500 with a request id (the
exception is in the server log only); the server keeps serving.

This module is the app and its routes (`create_app`). Request limits and body validation are
in `mempo.retrieval.contract`, the batching queue in `mempo.retrieval.scheduler`, running the
app (`serve_retriever`, `BackgroundServer`, the bind check) in `mempo.retrieval.serving`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mempo.retrieval.base import Hit, Retriever
from mempo.retrieval.contract import (
    BadRequest,
    ServiceLimits,
    parse_access,
    parse_body,
    parse_retrieve,
)
from mempo.retrieval.scheduler import (
    ClientGone,
    DeadlineExceeded,
    MicroBatcher,
    Overloaded,
    await_answer,
)

log = logging.getLogger(__name__)

class _Metrics:
    """Prometheus metrics on a per-app registry (several apps can live in one process)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("mempo_retriever_requests", "HTTP requests",
                                ["endpoint", "status"], registry=self.registry)
        self.queries = Counter("mempo_retriever_queries", "queries searched", registry=self.registry)
        self.errors = Counter("mempo_retriever_errors", "requests answered with an error",
                              ["endpoint", "reason"], registry=self.registry)
        self.dropped = Counter("mempo_retriever_dropped", "queued requests dropped unsearched",
                               ["reason"], registry=self.registry)
        self.queued = Gauge("mempo_retriever_queue_queries", "queries waiting for a worker",
                            registry=self.registry)
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


def dedupe_articles(articles: list[list[Any]], key: Callable[[Any], str]) -> tuple[list[list[Any]], dict[str, int]]:
    """Keep each article once: later copies become `[]`, listed in `{item: first item}`."""
    first: dict[str, int] = {}
    out: list[list[Any]] = []
    dup: dict[str, int] = {}
    for i, art in enumerate(articles):
        k = key(art[0]) if art else None
        if k is not None and k in first:
            out.append([])
            dup[str(i)] = first[k]
            continue
        if k is not None:
            first[k] = i
        out.append(art)
    return out, dup


def create_app(retriever: Retriever, limits: ServiceLimits | None = None,
               manifest: dict[str, Any] | None = None,
               executor: ThreadPoolExecutor | None = None) -> Any:
    """The FastAPI app serving `retriever` under `limits`. Run it with uvicorn.

    `executor`: the search threads (`limits.workers` of them) to use, best the one that
    opened `retriever` (see `mempo.retrieval.serving.open_in_search_thread`); default a new pool.
    """
    limits = limits or ServiceLimits()
    manifest = manifest if manifest is not None else getattr(retriever, "manifest", {}) or {}
    metrics = _Metrics()
    state: dict[str, Any] = {"batcher": None, "ready": False, "access_in_flight": 0}
    query_encoder = getattr(getattr(retriever, "searcher", None), "encoder", None)
    encoder_backend = getattr(query_encoder, "backend", None)

    def search_sync(queries: list[str], k: int) -> list[list[Hit]]:
        metrics.queries.inc(len(queries))
        return retriever.search(queries, k)

    def batcher() -> MicroBatcher:
        b = state["batcher"]
        if b is None:  # a request raced the lifespan start-up
            raise Overloaded("the server is starting; retry shortly", 1)
        return b

    def saturated() -> bool:
        b = state["batcher"]
        return b is not None and b.queued_queries >= limits.ready_queue_fraction * limits.max_queue_queries

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        b = MicroBatcher(search_sync, max_queries=limits.max_batch_queries,
                         max_queue_queries=limits.max_queue_queries, workers=limits.workers,
                         batching=limits.batching, window_s=limits.batch_window_ms / 1000.0,
                         on_batch=metrics.batch_size.observe,
                         on_drop=lambda reason: metrics.dropped.labels(reason).inc(),
                         executor=executor)
        b.start()
        metrics.queued.set_function(lambda: b.queued_queries)
        state["batcher"] = b
        state["ready"] = True
        yield
        state["ready"] = False
        await b.stop()

    app = FastAPI(title="mempo retriever", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    def error(endpoint: str, e: BadRequest) -> JSONResponse:
        metrics.errors.labels(endpoint, e.reason).inc()
        metrics.requests.labels(endpoint, str(e.status)).inc()
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse({"detail": e.message}, status_code=e.status, headers=headers)

    def shed(endpoint: str, reason: str, message: str, retry_after_s: int) -> JSONResponse:
        metrics.errors.labels(endpoint, reason).inc()
        metrics.requests.labels(endpoint, "503").inc()
        return JSONResponse({"detail": message}, status_code=503,
                            headers={"Retry-After": str(retry_after_s)})

    def internal_error(endpoint: str) -> JSONResponse:
        # The exception text stays in the log: it can hold paths and data of the server.
        rid = uuid.uuid4().hex[:12]
        log.exception("%s failed (request id %s)", endpoint, rid)
        metrics.errors.labels(endpoint, "internal").inc()
        metrics.requests.labels(endpoint, "500").inc()
        return JSONResponse({"detail": f"internal error (request id {rid}); see the server log"},
                            status_code=500)

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
        from starlette.requests import ClientDisconnect

        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise BadRequest(413, f"body is over the {limits.max_body_bytes}-byte limit",
                                     "body_too_large")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        return parse_body(b"".join(chunks), limits)

    def gone(endpoint: str) -> Response:
        metrics.errors.labels(endpoint, "client_gone").inc()
        metrics.requests.labels(endpoint, "499").inc()
        return Response(status_code=499)  # nobody reads it; logged like nginx does

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            check_auth(request)
            queries, topk, with_scores = parse_retrieve(await read_body(request), limits)
        except BadRequest as e:
            return error("retrieve", e)
        except ClientGone:
            return gone("retrieve")
        try:
            future = batcher().submit(queries, topk, limits.request_timeout_s)
            results = await await_answer(request, future, limits.request_timeout_s)
        except Overloaded as e:
            return shed("retrieve", "queue_full", str(e), e.retry_after_s)
        except DeadlineExceeded:
            return shed("retrieve", "deadline", f"not answered within {limits.request_timeout_s:g} s "
                        "(the server is overloaded); retry later", batcher().retry_after_s())
        except ClientGone:
            return gone("retrieve")
        except Exception:  # noqa: BLE001 - a failed search is a 500, not a dead server
            return internal_error("retrieve")
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
        except ClientGone:
            return gone("access")
        if state["access_in_flight"] >= limits.max_access_in_flight:
            return shed("access", "access_busy", f"{limits.max_access_in_flight} /access requests "
                        "are in flight already; retry later", 1)
        state["access_in_flight"] += 1
        try:
            unique = list(dict.fromkeys(keys))  # each distinct key is looked up once
            found = await asyncio.to_thread(retriever.access, **{key: unique})
            by_key = dict(zip(unique, found, strict=True))
            articles, duplicate_of = dedupe_articles([by_key[k] for k in keys], key=lambda p: p.id)
        except Exception:  # noqa: BLE001
            return internal_error("access")
        finally:
            state["access_in_flight"] -= 1
        total = sum(len(a) for a in articles)
        if total > limits.max_access_passages:
            e = BadRequest(422, f"the articles asked for hold {total} passages, over the limit of "
                           f"{limits.max_access_passages} per response; ask for fewer at a time",
                           "access_too_large")
            return error("access", e)
        body: dict[str, Any] = {"result": [[p.to_dict() for p in art] for art in articles]}
        if duplicate_of:
            body["duplicate_of"] = duplicate_of
        metrics.requests.labels("access", "200").inc()
        metrics.latency.labels("access").observe(time.perf_counter() - t0)
        return _json_response(body)

    def status_body() -> dict[str, Any]:
        b = state["batcher"]
        status = "starting" if not state["ready"] else "saturated" if saturated() else "ready"
        return {"status": status, "batching": limits.batching, "workers": limits.workers,
                "encoder_backend": encoder_backend,
                "queue_queries": b.queued_queries if b else 0,
                "max_queue_queries": limits.max_queue_queries,
                "index": manifest_summary(manifest)}

    @app.get("/health")
    async def health() -> Response:
        # Liveness: the process answers. A saturated server is alive (restarting it would
        # lose the loaded index and make the overload worse); readiness is /ready.
        return JSONResponse(status_body(), status_code=200 if state["ready"] else 503)

    @app.get("/ready")
    async def ready() -> Response:
        body = status_body()
        if body["status"] == "ready":
            return JSONResponse(body)
        retry = batcher().retry_after_s() if state["batcher"] is not None else 1
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(retry)})

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
    except ImportError:  # pragma: no cover
        return JSONResponse(body)
    return Response(orjson.dumps(body), media_type="application/json")


def _item(hit: Hit, with_score: bool) -> dict[str, Any]:
    score = hit.score if math.isfinite(hit.score) else 0.0
    doc = {"id": hit.id, "contents": hit.contents}
    return {"document": doc, "score": score} if with_score else doc
