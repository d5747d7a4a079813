"""Running the retrieval app: in a background thread (tests, benchmarks) or as the service.

    mempo serve retriever --index outputs/index --port 8013      # serve_retriever
    with BackgroundServer(create_app(retriever), port=0) as srv:  # tests and benchmarks
        httpx.get(f"{srv.url}/health")

`check_bind` refuses to serve without a token on an address other machines can reach.
uvicorn's `limit_concurrency` is set from `max_connections`, so the memory that waiting
bodies take stays bounded. SIGTERM drains in-flight requests, then exits 0.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mempo.errors import ConfigError
from mempo.retrieval.contract import ServiceLimits
from mempo.retrieval.scheduler import search_threads
from mempo.retrieval.server import create_app

log = logging.getLogger(__name__)


# An idle keep-alive connection is closed after this long. uvicorn's default (5 s) equals
# httpx's client-side expiry, so a pooled connection could be reused just as the server
# closed it (the default run's SFT stage died on that reset): rollout workers search, then
# generate for seconds, then search again. Longer than any client's expiry, the client
# always drops an idle connection first.
KEEP_ALIVE_S = 30


def _uvicorn_kwargs(app: Any) -> dict[str, Any]:
    limits: ServiceLimits | None = getattr(getattr(app, "state", None), "limits", None)
    kw: dict[str, Any] = {"timeout_keep_alive": KEEP_ALIVE_S}
    # uvicorn answers 503 itself past this many open connections: each one may hold a body
    # of up to max_body_bytes, so this bounds the memory that waiting bodies take.
    if limits is not None:
        kw["limit_concurrency"] = limits.max_connections
    return kw


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


def open_in_search_thread(open_fn: Callable[[], Any], workers: int) -> tuple[ThreadPoolExecutor, Any]:
    """The search threads, and `open_fn()` run in the first of them (where searches will run).

    torch and FAISS share one OpenMP runtime, and each thread that starts a parallel region
    gets its own team of OpenMP workers. Opening the index on the main thread (the encoder's
    fingerprint probe runs a forward pass) and searching on another one leaves two teams and
    more OpenMP threads than cores; libgomp then (as far as we can tell) stops spinning between
    regions, so every layer pays a futex wake-up. Measured on 2 cores, MiniLM, one query:
    23-24 ms a forward pass opened on the main thread vs 11 ms opened in the search thread.
    """
    threads = search_threads(workers)
    try:
        return threads, threads.submit(open_fn).result()
    except BaseException:
        threads.shutdown(wait=False)
        raise


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

    def open_index() -> Any:
        manifest = read_manifest(index_dir)
        query_encoder: Any = encoder
        if manifest["method"] == "dense":
            built = manifest["encoder"]
            query_encoder = Encoder(encoder or built.get("source") or built["name"], device=device,
                                    backend=encoder_backend, threads=encoder_threads)
        return load_index(index_dir, encoder=query_encoder, device=device)

    threads, retriever = open_in_search_thread(open_index, limits.workers)
    app = create_app(retriever, limits, retriever.manifest, executor=threads)
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
