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
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mempo.config import ServiceLimitParams
from mempo.errors import ConfigError
from mempo.retrieval.base import Hit, Retriever
from mempo.retrieval.scheduler import (
    ClientGone,
    DeadlineExceeded,
    MicroBatcher,
    Overloaded,
    await_answer,
)

log = logging.getLogger(__name__)


class ServiceLimits(ServiceLimitParams):
    """Request limits and scheduling knobs (params.yaml `serve:`, `ServiceLimitParams`) plus the
    optional bearer token, which comes from the environment or a file, never from params."""

    token: str | None = None


class BadRequest(Exception):
    """A client error: HTTP `status` with a one-line message."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


# ---------------------------------------------------------------------- request parsing


def _loads(raw: bytes) -> Any:
    """Parse JSON; orjson when installed (faster, and it stops at 1024 levels of nesting)."""
    try:
        import orjson
    except ImportError:  # pragma: no cover - orjson is in requirements.lock
        return json.loads(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth" in str(e) or "recursion" in str(e):
            raise RecursionError(str(e)) from None
        raise json.JSONDecodeError(str(e).split(":", 1)[0], e.doc, e.pos) from None


def _parse_body(raw: bytes, limits: ServiceLimits) -> dict[str, Any]:
    if len(raw) > limits.max_body_bytes:
        raise BadRequest(413, f"body is {len(raw)} bytes, over the {limits.max_body_bytes}-byte limit",
                         "body_too_large")
    if not raw.strip():
        raise BadRequest(400, "empty body; send a JSON object", "empty_body")
    try:
        obj = _loads(raw)
    except UnicodeDecodeError:
        raise BadRequest(400, "body is not valid UTF-8", "bad_encoding") from None
    except RecursionError:
        # A small body of nested brackets would otherwise blow the parser's stack.
        raise BadRequest(400, "body nests too deeply; send a flat JSON object", "too_deep") from None
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"body is not valid JSON: {e.msg} at character {e.pos}",
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


# ---------------------------------------------------------------------- the app


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
               manifest: dict[str, Any] | None = None) -> Any:
    """The FastAPI app serving `retriever` under `limits`. Run it with uvicorn."""
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
                         on_drop=lambda reason: metrics.dropped.labels(reason).inc())
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
        return _parse_body(b"".join(chunks), limits)

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


def _uvicorn_kwargs(app: Any) -> dict[str, Any]:
    limits: ServiceLimits | None = getattr(getattr(app, "state", None), "limits", None)
    # uvicorn answers 503 itself past this many open connections: each one may hold a body
    # of up to max_body_bytes, so this bounds the memory that waiting bodies take.
    return {"limit_concurrency": limits.max_connections} if limits is not None else {}


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
                                timeout_graceful_shutdown=graceful_timeout_s, lifespan="on",
                                **_uvicorn_kwargs(app))
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


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`: addresses no other machine can reach."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, allow_no_token: bool = False) -> None:
    """Refuse to serve without a token on an address other machines can reach."""
    if token is None and not allow_no_token and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve on {host} without a token: anyone who reaches it could use the "
            "service. Set MEMPO_RETRIEVER_TOKEN (or --token-file PATH), bind 127.0.0.1, or pass "
            "--allow-no-token if the network is trusted", field="serve.host")


def serve_retriever(index_dir: str, *, host: str = "127.0.0.1", port: int = 8013,
                    encoder: str | None = None, device: str = "cpu",
                    encoder_backend: str = "torch", encoder_threads: int = 0,
                    limits: ServiceLimits | None = None, log_level: str = "info",
                    graceful_timeout_s: float = 30.0, allow_no_token: bool = False) -> None:
    """Load `index_dir` and serve it until SIGINT/SIGTERM (in-flight requests drain first)."""
    import uvicorn

    from mempo.retrieval.encoder import Encoder
    from mempo.retrieval.index import load_index, read_manifest

    limits = limits or ServiceLimits()
    check_bind(host, limits.token, allow_no_token)
    manifest = read_manifest(index_dir)
    query_encoder: Any = encoder
    if manifest["method"] == "dense":
        built = manifest["encoder"]
        query_encoder = Encoder(encoder or built.get("source") or built["name"], device=device,
                                backend=encoder_backend, threads=encoder_threads)
    retriever = load_index(index_dir, encoder=query_encoder, device=device)
    app = create_app(retriever, limits, retriever.manifest)
    log.info("serving %s on http://%s:%d (%s)", index_dir, host, port,
             "token required" if limits.token else "no token")

    def stopped(signum: int, frame: Any) -> None:
        # uvicorn drains in-flight requests, restores this handler and re-raises SIGTERM:
        # a requested stop after a clean drain is a normal exit (0), not a crash (-15).
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                    timeout_graceful_shutdown=graceful_timeout_s, **_uvicorn_kwargs(app))
    finally:
        signal.signal(signal.SIGTERM, previous)
        retriever.close()
        log.info("retrieval service stopped")
