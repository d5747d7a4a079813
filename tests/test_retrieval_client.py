"""The HTTP client against scripted servers on a real loopback port: it honours Retry-After,
retries only what is safe to retry, within a retry budget, and sends the token it finds in
the environment or a file without the caller passing it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import mempo.retrieval.http as http_mod
from mempo.errors import ConfigError
from mempo.retrieval.auth import TOKEN_ENV, TOKEN_FILE_ENV, read_token
from mempo.retrieval.http import HttpRetriever, RetrievalServiceError, RetryBudget
from mempo.retrieval.serving import BackgroundServer

HIT = {"document": {"id": "1", "contents": "River\nA river."}, "score": 0.5}


class Script:
    """A server that answers /retrieve from a list of (status, headers, sleep_s), then 200."""

    def __init__(self, answers: list[tuple[int, dict[str, str], float]]) -> None:
        self.answers = list(answers)
        self.seen: list[dict[str, str]] = []
        self._lock = threading.Lock()
        app = FastAPI()

        @app.post("/retrieve")
        async def retrieve(request: Request):
            with self._lock:
                self.seen.append(dict(request.headers))
                status, headers, sleep_s = self.answers.pop(0) if self.answers else (200, {}, 0.0)
            if sleep_s:
                await asyncio.sleep(sleep_s)
            if status == 200:
                body = await request.json()
                return JSONResponse({"result": [[HIT] for _ in body["queries"]]})
            return JSONResponse({"detail": f"scripted {status}"}, status_code=status, headers=headers)

        self.server = BackgroundServer(app)

    def __enter__(self) -> Script:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


@pytest.fixture()
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the client's backoff sleeps instead of sleeping (sync and async)."""
    waited: list[float] = []
    monkeypatch.setattr(http_mod, "_sleep", waited.append)

    async def asleep(s: float) -> None:
        waited.append(s)

    monkeypatch.setattr(http_mod, "_asleep", asleep)
    return waited


def test_503_is_retried_after_the_servers_retry_after(sleeps) -> None:
    with Script([(503, {"Retry-After": "7"}, 0), (503, {"Retry-After": "2"}, 0)]) as s:
        r = HttpRetriever(s.server.url, retries=3, backoff_s=0.01)
        assert r.search(["river"], 1)[0][0].id == "1"
        assert len(s.seen) == 3
        # Waited at least what the server asked for (plus jitter, capped at max_backoff_s).
        assert 7 <= sleeps[0] <= 7 * 1.25 and 2 <= sleeps[1] <= 2 * 1.25


def test_async_client_honours_retry_after_too(sleeps) -> None:
    with Script([(429, {"Retry-After": "3"}, 0)]) as s:
        r = HttpRetriever(s.server.url, retries=1)
        assert asyncio.run(r.asearch(["river"], 1))[0][0].id == "1"
        assert len(s.seen) == 2 and sleeps[0] >= 3


def test_retry_after_is_capped(sleeps) -> None:
    with Script([(503, {"Retry-After": "3600"}, 0)]) as s:
        HttpRetriever(s.server.url, retries=1, max_backoff_s=5).search(["river"], 1)
        assert sleeps == [5]


def test_500_is_not_retried_and_gives_the_servers_message(sleeps) -> None:
    with Script([(500, {}, 0)]) as s:
        with pytest.raises(RetrievalServiceError, match="500: scripted 500"):
            HttpRetriever(s.server.url, retries=3).search(["river"], 1)
        assert len(s.seen) == 1 and sleeps == []


def test_read_timeout_is_not_retried() -> None:
    """A slow server already has the request; a second copy would only double its load."""
    with Script([(200, {}, 1.5)]) as s:
        client = HttpRetriever(s.server.url, retries=3, backoff_s=0.01, timeout_s=0.3)
        with pytest.raises(RetrievalServiceError, match="not retried"):
            client.search(["river"], 1)
        time.sleep(0.1)
        assert len(s.seen) == 1


class ResetOnce:
    """A raw loopback server: the first connection reads the request and is reset (RST, no
    answer: what a client sees when a server drops a pooled keep-alive connection or
    restarts); later connections get a 200 with one hit."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import json
        import socket
        import struct

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.recv(65536)
            if self.connections == 1:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                body = json.dumps({"result": [[HIT]]}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            conn.close()


@pytest.mark.parametrize("use_async", [False, True])
def test_a_connection_reset_before_the_answer_is_retried(sleeps, use_async: bool) -> None:
    server = ResetOnce()
    try:
        client = HttpRetriever(server.url, retries=2, backoff_s=0.01)
        hits = asyncio.run(client.asearch(["river"], 1)) if use_async else client.search(["river"], 1)
        assert hits[0][0].id == "1"
        assert server.connections == 2 and len(sleeps) == 1
    finally:
        server.sock.close()


def test_persistent_503_gives_up_after_the_retries(sleeps) -> None:
    with Script([(503, {"Retry-After": "1"}, 0)] * 10) as s:
        with pytest.raises(RetrievalServiceError, match="503.*gave up after 3 attempts"):
            HttpRetriever(s.server.url, retries=2).search(["river"], 1)
        assert len(s.seen) == 3


def test_retry_budget_caps_retries_across_calls(sleeps) -> None:
    """Against a service that always sheds, 30 calls with 3 retries each would send 120
    requests; the budget (20 % of requests + a reserve of 2) lets far fewer through."""
    with Script([(503, {"Retry-After": "0"}, 0)] * 1000) as s:
        client = HttpRetriever(s.server.url, retries=3)
        client.budget = RetryBudget(ratio=0.2, reserve=2.0)
        for _ in range(30):
            with pytest.raises(RetrievalServiceError):
                client.search(["river"], 1)
        retries = len(s.seen) - 30
        assert retries <= 2 + 0.2 * 30
        assert retries >= 2  # the reserve was used: it is a budget, not a ban


def test_budget_token_bucket() -> None:
    b = RetryBudget(ratio=0.5, reserve=1.0, cap=2.0)
    assert b.withdraw() and not b.withdraw()
    b.deposit()
    assert not b.withdraw()
    b.deposit()
    assert b.withdraw()
    for _ in range(10):
        b.deposit()
    assert b.tokens == 2.0  # capped


# ---------------------------------------------------------------------- token


def test_client_sends_the_token_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    with Script([]) as s:
        HttpRetriever(s.server.url).search(["river"], 1)
        assert s.seen[0]["authorization"] == "Bearer from-env"


def test_client_reads_a_token_file(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    (tmp_path / "token").write_text("from-file\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "token"))
    with Script([]) as s:
        HttpRetriever(s.server.url).search(["river"], 1)
        HttpRetriever(s.server.url, token="explicit").search(["river"], 1)
        assert [h["authorization"] for h in s.seen] == ["Bearer from-file", "Bearer explicit"]


def test_no_token_anywhere_sends_no_header(monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    with Script([]) as s:
        HttpRetriever(s.server.url).search(["river"], 1)
        assert "authorization" not in s.seen[0]


def test_bad_token_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        read_token(token_file=tmp_path / "missing")
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        read_token(token_file=tmp_path / "empty")


def test_consumers_get_the_token_without_passing_it(monkeypatch) -> None:
    """open_retriever(url) is what the trainers, the evaluation and the verl tool call."""
    from mempo.retrieval import open_retriever

    monkeypatch.setenv(TOKEN_ENV, "consumer")
    with Script([]) as s:
        with open_retriever(s.server.url) as r:
            r.search(["river"], 1)
        assert s.seen[0]["authorization"] == "Bearer consumer"
