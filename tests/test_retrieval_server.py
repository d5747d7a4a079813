"""The retrieval service on a real loopback port: Search-R1 contract, /access (deduplicated,
capped), limits and bad requests (4xx, server keeps serving; nested JSON too), generic 500s,
token auth (from the environment or a file, never argv), the bind rule, micro-batching,
load, graceful shutdown, the HTTP client and the `mempo serve retriever` CLI, and the
Kubernetes manifests' auth and probes. Overload: test_retrieval_overload.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from mempo.retrieval import InProcessRetriever, open_retriever
from mempo.retrieval.contract import ServiceLimits
from mempo.retrieval.http import HttpRetriever, RetrievalServiceError
from mempo.retrieval.server import create_app
from mempo.retrieval.serving import BackgroundServer, open_in_search_thread

LIMITS = dict(max_queries_per_request=8, max_query_chars=100, max_topk=10, max_body_bytes=4000,
              max_access_items=4, batch_window_ms=20.0)


@pytest.fixture(scope="module")
def world_retriever(tiny_world: Path) -> InProcessRetriever:
    return InProcessRetriever.from_corpus(tiny_world / "corpus.jsonl")


@pytest.fixture(scope="module")
def server(world_retriever: InProcessRetriever):
    with BackgroundServer(create_app(world_retriever, ServiceLimits(**LIMITS))) as srv:
        yield srv


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


# ---------------------------------------------------------------------- contract


def test_retrieve_contract_with_and_without_scores(server, world_retriever) -> None:
    body = {"queries": ["Syndkindale", "a river"], "topk": 2, "return_scores": True}
    r = httpx.post(f"{server.url}/retrieve", json=body)
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == 2 and all(len(items) == 2 for items in result)
    item = result[0][0]
    assert set(item) == {"document", "score"} and set(item["document"]) == {"id", "contents"}
    expected = world_retriever.search(["Syndkindale", "a river"], 2)
    assert [[it["document"]["id"] for it in items] for items in result] == \
        [[h.id for h in hits] for hits in expected]
    assert item["score"] == pytest.approx(expected[0][0].score)

    plain = httpx.post(f"{server.url}/retrieve",
                       json={"queries": ["Syndkindale"], "topk": 3}).json()["result"]
    assert set(plain[0][0]) == {"id", "contents"} and len(plain[0]) == 3
    default_k = httpx.post(f"{server.url}/retrieve", json={"queries": ["x river"]}).json()["result"]
    assert len(default_k[0]) == 3  # default_topk
    # Unknown extra keys are ignored, as Search-R1's server does (clients send extras).
    assert httpx.post(f"{server.url}/retrieve",
                      json={"queries": ["river"], "topk": 1, "extra": 1}).status_code == 200


def test_search_r1_style_client_works_unchanged(server) -> None:
    # What Search-R1's `batch_search` does with `requests`: post, then read document contents.
    payload = {"queries": ["Syndkindale"], "topk": 3, "return_scores": True}
    results = httpx.post(f"{server.url}/retrieve", json=payload).json()["result"]
    text = "".join(f"Doc {i + 1}(Title: {d['document']['contents'].split(chr(10))[0]}) "
                   for i, d in enumerate(results[0]))
    assert text.startswith("Doc 1(Title: Syndkindale)")


def test_access_returns_article_and_empty_for_unknown(server, world_retriever) -> None:
    hit = world_retriever.search(["Syndkindale"], 1)[0][0]
    r = httpx.post(f"{server.url}/access", json={"ids": [hit.id, "nope"]})
    assert r.status_code == 200
    article, unknown = r.json()["result"]
    assert hit.id in [d["id"] for d in article] and unknown == []
    by_title = httpx.post(f"{server.url}/access", json={"titles": [hit.title, "No Such"]}).json()
    assert by_title["result"] == [article, []]


def test_health_and_metrics(server) -> None:
    h = httpx.get(f"{server.url}/health").json()
    assert h["status"] == "ready" and h["index"]["count"] == 124 and h["index"]["method"] == "bm25"
    before = _metric(server.url, "mempo_retriever_queries_total")
    httpx.post(f"{server.url}/retrieve", json={"queries": ["a", "b", "c"], "topk": 1})
    assert _metric(server.url, "mempo_retriever_queries_total") == before + 3
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("mempo_retriever_requests_total", "mempo_retriever_batch_queries_bucket",
                 "mempo_retriever_latency_seconds_bucket"):
        assert name in text


# ---------------------------------------------------------------------- bad requests

BAD_REQUESTS = [
    ("not_json", "POST", "/retrieve", b"{queries: nope", 400),
    ("empty_body", "POST", "/retrieve", b"", 400),
    ("bad_utf8", "POST", "/retrieve", b'{"queries": ["\xff\xfe"]}', 400),
    ("json_array", "POST", "/retrieve", [1, 2], 422),
    ("json_null", "POST", "/retrieve", None, 422),
    ("missing_queries", "POST", "/retrieve", {"topk": 3}, 422),
    ("queries_string", "POST", "/retrieve", {"queries": "river"}, 422),
    ("queries_null", "POST", "/retrieve", {"queries": None}, 422),
    ("queries_empty", "POST", "/retrieve", {"queries": []}, 422),
    ("query_not_string", "POST", "/retrieve", {"queries": [7]}, 422),
    ("query_empty", "POST", "/retrieve", {"queries": [""]}, 422),
    ("query_blank", "POST", "/retrieve", {"queries": ["   "]}, 422),
    ("too_many_queries", "POST", "/retrieve", {"queries": ["q"] * 9}, 422),
    ("query_too_long", "POST", "/retrieve", {"queries": ["x" * 101]}, 422),
    ("topk_string", "POST", "/retrieve", {"queries": ["q"], "topk": "3"}, 422),
    ("topk_bool", "POST", "/retrieve", {"queries": ["q"], "topk": True}, 422),
    ("topk_float", "POST", "/retrieve", {"queries": ["q"], "topk": 2.5}, 422),
    ("topk_zero", "POST", "/retrieve", {"queries": ["q"], "topk": 0}, 422),
    ("topk_negative", "POST", "/retrieve", {"queries": ["q"], "topk": -1}, 422),
    ("topk_too_big", "POST", "/retrieve", {"queries": ["q"], "topk": 11}, 422),
    ("return_scores_string", "POST", "/retrieve", {"queries": ["q"], "return_scores": "yes"}, 422),
    ("body_too_large", "POST", "/retrieve", {"queries": ["q"], "pad": "x" * 5000}, 413),
    # 1,900 levels of brackets in 3.8 kB, under the size cap: the parser must not recurse.
    ("deeply_nested", "POST", "/retrieve", b'{"queries": ' + b"[" * 1900 + b"]" * 1900 + b"}", 400),
    ("nested_access", "POST", "/access", b'{"ids": ' + b"[" * 1100 + b"]" * 1100 + b"}", 400),
    ("access_neither", "POST", "/access", {}, 422),
    ("access_both", "POST", "/access", {"ids": ["1"], "titles": ["A"]}, 422),
    ("access_ids_not_list", "POST", "/access", {"ids": "1"}, 422),
    ("access_too_many", "POST", "/access", {"ids": ["1"] * 5}, 422),
    ("access_title_not_string", "POST", "/access", {"titles": [{"a": 1}]}, 422),
    ("get_retrieve", "GET", "/retrieve", None, 405),
    ("unknown_path", "POST", "/search", {"queries": ["q"]}, 404),
]


@pytest.mark.parametrize(("kind", "method", "path", "body", "status"), BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_4xx_with_message(server, kind, method, path, body, status) -> None:
    if isinstance(body, bytes):
        r = httpx.request(method, f"{server.url}{path}", content=body,
                          headers={"content-type": "application/json"})
    elif method == "GET":
        r = httpx.get(f"{server.url}{path}")
    else:
        r = httpx.request(method, f"{server.url}{path}", content=json.dumps(body))
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str) and len(detail) > 3
    # ... and the server keeps serving.
    ok = httpx.post(f"{server.url}/retrieve", json={"queries": ["river"], "topk": 1})
    assert ok.status_code == 200 and len(ok.json()["result"][0]) == 1


def test_bad_requests_are_counted_by_reason(server) -> None:
    httpx.post(f"{server.url}/retrieve", json={"queries": []})
    assert _metric(server.url, "mempo_retriever_errors_total",
                   '{endpoint="retrieve",reason="queries_empty"}') >= 1


class _BrokenRetriever(InProcessRetriever):
    """The real retriever, but every search and access fails with a revealing message."""

    def __init__(self, inner: InProcessRetriever) -> None:
        super().__init__(inner.store, inner.searcher, inner.manifest)

    def search(self, queries, topk=3):
        raise RuntimeError("secret detail: /srv/private/index.faiss is corrupt")

    def access(self, ids=None, titles=None):
        raise KeyError("secret detail: row 77")


@pytest.mark.parametrize("batching", [True, False])
def test_failures_get_a_generic_500_without_the_exception_text(world_retriever, batching, caplog) -> None:
    app = create_app(_BrokenRetriever(world_retriever), ServiceLimits(batching=batching))
    with BackgroundServer(app) as srv:
        for path, body in (("/retrieve", {"queries": ["river"]}), ("/access", {"ids": ["1"]})):
            r = httpx.post(f"{srv.url}{path}", json=body)
            assert r.status_code == 500
            detail = r.json()["detail"]
            assert "secret" not in r.text and "Error" not in r.text
            rid = re.search(r"request id ([0-9a-f]+)", detail).group(1)
            # The log has the exception under the same id, for whoever runs the service.
            assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)
        assert httpx.get(f"{srv.url}/health").status_code == 200


# ---------------------------------------------------------------------- /access limits


def test_access_sends_each_article_once_and_the_client_restores_the_copies(server, world_retriever) -> None:
    hit = world_retriever.search(["Syndkindale"], 1)[0][0]
    article = world_retriever.access(ids=[hit.id])[0]
    sibling = article[-1].id  # another passage of the same article
    keys = [hit.id, hit.id, sibling, "nope"]
    r = httpx.post(f"{server.url}/access", json={"ids": keys})
    assert r.status_code == 200
    body = r.json()
    assert [len(a) for a in body["result"]] == [len(article), 0, 0, 0]
    assert body["duplicate_of"] == {"1": 0, "2": 0}
    # The Python client gives every item its article, as the in-process retriever does.
    client = HttpRetriever(server.url)
    assert client.access(ids=keys) == world_retriever.access(ids=keys)
    assert asyncio.run(client.aaccess(ids=keys)) == world_retriever.access(ids=keys)


def test_access_response_is_capped(world_retriever) -> None:
    titles = list(dict.fromkeys(world_retriever.store.titles))[:4]
    total = sum(len(a) for a in world_retriever.access(titles=titles))
    app = create_app(world_retriever, ServiceLimits(max_access_passages=total - 1))
    with BackgroundServer(app) as srv:
        r = httpx.post(f"{srv.url}/access", json={"titles": titles})
        assert r.status_code == 422 and "ask for fewer" in r.json()["detail"]
        ok = httpx.post(f"{srv.url}/access", json={"titles": titles[:1]})
        assert ok.status_code == 200
        # Asking for one article many times costs one copy, so it stays under the cap.
        many = httpx.post(f"{srv.url}/access", json={"titles": titles[:1] * 64})
        assert many.status_code == 200 and sum(map(len, many.json()["result"])) == len(ok.json()["result"][0])


# ---------------------------------------------------------------------- auth


def test_token_auth(world_retriever) -> None:
    app = create_app(world_retriever, ServiceLimits(token="s3cret"))
    with BackgroundServer(app) as srv:
        body = {"queries": ["river"], "topk": 1}
        assert httpx.post(f"{srv.url}/retrieve", json=body).status_code == 401
        wrong = httpx.post(f"{srv.url}/retrieve", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "invalid" in wrong.json()["detail"]
        basic = httpx.post(f"{srv.url}/access", json={"ids": ["1"]},
                           headers={"Authorization": "Basic s3cret"})
        assert basic.status_code == 401
        good = httpx.post(f"{srv.url}/retrieve", json=body, headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes need no token
        assert HttpRetriever(srv.url, token="s3cret").search(["river"], 1)[0]
        with pytest.raises(RetrievalServiceError, match="401"):
            HttpRetriever(srv.url, retries=3).search(["river"], 1)
        # A 401 is not retried: exactly one more unauthorised request reached the server.
        assert _metric(srv.url, "mempo_retriever_requests_total",
                       '{endpoint="retrieve",status="401"}') == 3


# ---------------------------------------------------------------------- client


def test_http_client_sync_async_match_in_process(server, world_retriever) -> None:
    client = open_retriever(server.url, max_queries_per_request=3, max_access_per_request=2)
    assert isinstance(client, HttpRetriever)
    queries = ["Syndkindale", "river", "company", "capital", "born", "mayor", "founded"]
    # 7 queries split into requests of 3 by the client, answers in order.
    assert client.search(queries, 2) == world_retriever.search(queries, 2)
    assert asyncio.run(client.asearch(queries, 2)) == world_retriever.search(queries, 2)
    ids = ["4", "1", "zz"]
    assert client.access(ids=ids) == world_retriever.access(ids=ids)
    assert asyncio.run(client.aaccess(titles=["Syndkindale"])) == world_retriever.access(titles=["Syndkindale"])
    client.close()


def test_http_client_retries_then_fails_clearly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = HttpRetriever(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01, timeout_s=2)
    with pytest.raises(RetrievalServiceError, match="after 3 attempts"):
        client.search(["river"], 1)
    with pytest.raises(RetrievalServiceError, match="after 3 attempts"):
        asyncio.run(client.asearch(["river"], 1))


# ---------------------------------------------------------------------- batching and load


async def _load(url: str, n_requests: int, clients: int) -> tuple[int, int, set[int]]:
    """`clients` concurrent workers send `n_requests` single-query requests in total."""
    counter = iter(range(n_requests))
    errors = 0
    statuses: set[int] = set()
    ok = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
        async def worker() -> None:
            nonlocal errors, ok
            for i in counter:
                r = await http.post("/retrieve", json={"queries": [f"river {i % 50}"], "topk": 3})
                statuses.add(r.status_code)
                if r.status_code == 200 and len(r.json()["result"][0]) == 3:
                    ok += 1
                else:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(clients)))
    return ok, errors, statuses


def test_load_2000_requests_32_clients_no_errors_and_batched(world_retriever) -> None:
    # A long deadline: on a busy shared machine a request may wait > 10 s here, and this
    # test is about batching, not shedding (test_retrieval_overload.py covers that).
    limits = ServiceLimits(batch_window_ms=5.0, request_timeout_s=300)
    with BackgroundServer(create_app(world_retriever, limits)) as srv:
        ok, errors, statuses = asyncio.run(_load(srv.url, 2000, 32))
        assert (ok, errors, statuses) == (2000, 0, {200})
        searches = _metric(srv.url, "mempo_retriever_batch_queries_count")
        queries = _metric(srv.url, "mempo_retriever_batch_queries_sum")
        assert queries == 2000
        # Concurrent requests shared search calls. How many share depends on scheduling
        # (a quiet machine answers faster, so fewer overlap: 1169 searches seen on one), so
        # the bound only demands that batching happened, not how much.
        assert searches <= 0.9 * queries


def test_no_batching_serves_each_request_alone(world_retriever) -> None:
    app = create_app(world_retriever, ServiceLimits(batching=False, request_timeout_s=300))
    with BackgroundServer(app) as srv:
        ok, errors, _ = asyncio.run(_load(srv.url, 64, 8))
        assert (ok, errors) == (64, 0)
        assert _metric(srv.url, "mempo_retriever_batch_queries_count") == 64
        assert httpx.get(f"{srv.url}/health").json()["batching"] is False


class _ThreadRecordingRetriever(InProcessRetriever):
    """The real retriever; records the thread it was opened on and each search's thread."""

    def __init__(self, inner: InProcessRetriever) -> None:
        super().__init__(inner.store, inner.searcher, inner.manifest)
        self.opened_on = threading.get_ident()
        self.searched_on: list[int] = []

    def search(self, queries, topk=3):
        self.searched_on.append(threading.get_ident())
        return super().search(queries, topk)


@pytest.mark.parametrize("batching", [True, False])
def test_searches_run_on_the_thread_that_opened_the_index(world_retriever, batching) -> None:
    # torch and FAISS share one OpenMP runtime: an encoder opened on one thread and run on
    # another leaves two OpenMP teams (on 2 cores a MiniLM query took 2x as long), so
    # `mempo serve retriever` opens the index on its search thread
    threads, retriever = open_in_search_thread(lambda: _ThreadRecordingRetriever(world_retriever), 1)
    assert retriever.opened_on != threading.get_ident()
    app = create_app(retriever, ServiceLimits(batching=batching, request_timeout_s=300),
                     executor=threads)
    with BackgroundServer(app) as srv:
        ok, errors, _ = asyncio.run(_load(srv.url, 32, 4))
    assert (ok, errors) == (32, 0)
    assert retriever.searched_on and set(retriever.searched_on) == {retriever.opened_on}


def test_a_failure_to_open_the_index_is_raised_and_frees_the_thread() -> None:
    def broken():
        raise FileNotFoundError("outputs/index/manifest.json")

    def search_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("mempo-search")}

    before = search_threads()
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        open_in_search_thread(broken, 1)
    new = search_threads() - before
    for t in new:
        t.join(10)
    assert not [t for t in new if t.is_alive()]


class _SlowRetriever(InProcessRetriever):
    """The real retriever, slowed down so a request is surely in flight at shutdown."""

    def __init__(self, inner: InProcessRetriever, delay_s: float) -> None:
        super().__init__(inner.store, inner.searcher, inner.manifest)
        self.delay_s = delay_s
        self.started = threading.Event()

    def search(self, queries, topk=3):
        self.started.set()
        time.sleep(self.delay_s)
        return super().search(queries, topk)


def test_graceful_shutdown_drains_in_flight_requests(world_retriever) -> None:
    slow = _SlowRetriever(world_retriever, delay_s=1.0)
    srv = BackgroundServer(create_app(slow, ServiceLimits())).start()
    result: dict[str, int] = {}

    def call() -> None:
        result["status"] = httpx.post(f"{srv.url}/retrieve", json={"queries": ["river"]},
                                      timeout=30).status_code

    t = threading.Thread(target=call)
    t.start()
    assert slow.started.wait(30)
    srv.stop()  # while the search is still sleeping
    t.join(30)
    assert result.get("status") == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{srv.url}/health", timeout=2)


# ---------------------------------------------------------------------- CLI


@pytest.mark.parametrize("source", ["env", "file"])
def test_cli_serve_retriever_subprocess(tiny_world: Path, tmp_path: Path, source: str) -> None:
    from mempo.retrieval.index import build_index

    build_index(tiny_world / "corpus.jsonl", tmp_path / "idx", method="bm25")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_RETRIEVER_TOKEN")}
    extra: list[str] = []
    if source == "env":
        env["MEMPO_RETRIEVER_TOKEN"] = "tok"
    else:
        (tmp_path / "token").write_text("tok\n")
        extra = ["--token-file", str(tmp_path / "token")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mempo", "--params", str(tmp_path / "none.yaml"), "serve",
         "retriever", "--index", str(tmp_path / "idx"), "--port", str(port), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.2)
        assert HttpRetriever(url, token="tok").search(["Syndkindale"], 1)[0][0].id == "4"
        assert httpx.post(f"{url}/retrieve", json={"queries": ["x"]}).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0


def test_cli_refuses_a_token_on_the_command_line(tiny_world: Path, tmp_path: Path, capsys) -> None:
    from mempo.cli import main

    rc = main(["--params", str(tmp_path / "none.yaml"), "serve", "retriever", "--index",
               str(tmp_path / "no-index"), "--token", "visible-in-ps"])
    err = capsys.readouterr().err
    assert rc != 0 and "--token is not accepted" in err and "MEMPO_RETRIEVER_TOKEN" in err
    assert "visible-in-ps" not in err


def test_cli_refuses_a_public_address_without_a_token(tiny_world: Path, tmp_path: Path,
                                                      monkeypatch, capsys) -> None:
    from mempo.cli import main
    from mempo.retrieval.serving import check_bind, is_loopback

    monkeypatch.delenv("MEMPO_RETRIEVER_TOKEN", raising=False)
    monkeypatch.delenv("MEMPO_RETRIEVER_TOKEN_FILE", raising=False)
    rc = main(["--params", str(tmp_path / "none.yaml"), "serve", "retriever", "--index",
               str(tmp_path / "no-index"), "--host", "0.0.0.0"])
    assert rc != 0 and "without a token" in capsys.readouterr().err
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    check_bind("0.0.0.0", "tok")  # a token makes it fine
    check_bind("0.0.0.0", None, allow_no_token=True)  # so does an explicit opt-out


# ---------------------------------------------------------------------- manifests

K8S = Path(__file__).resolve().parents[1] / "containers" / "retriever" / "k8s"


def test_k8s_deployment_requires_the_token_secret_and_probes_readiness() -> None:
    import yaml

    dep = yaml.safe_load((K8S / "deployment.yaml").read_text())
    container = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container.get("env", [])}
    ref = env["MEMPO_RETRIEVER_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "mempo-retriever" and ref.get("optional", False) is False
    assert "--token" not in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"  # saturation -> unready
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"  # ... but not restarted


def test_dag_pods_that_call_the_retriever_get_the_token(monkeypatch) -> None:
    """In kubernetes mode the train and evaluate pods read the same secret the service does."""
    sys.modules.pop("mempo_dag_common", None)
    monkeypatch.setenv("MEMPO_AIRFLOW_MODE", "kubernetes")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "dags"))
    import mempo_dag_common

    try:
        task = mempo_dag_common.mempo_task("t", ["eval"])
        secrets = [e.secret_ref for e in task.env_from if e.secret_ref is not None]
        mine = [s for s in secrets if s.name == "mempo-retriever"]
        assert mine and not mine[0].optional
    finally:
        sys.modules.pop("mempo_dag_common", None)


def test_an_idle_keep_alive_connection_outlives_the_clients_pool_expiry(world_retriever) -> None:
    """A pooled connection idle for longer than httpx's keep-alive expiry (5 s) is still open
    on the server, so a client never reuses one the server is closing (uvicorn's default
    closed it at 5 s too: a reset the default run's SFT stage died on)."""
    request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    with BackgroundServer(create_app(world_retriever)) as srv, socket.create_connection(
            ("127.0.0.1", srv.port), timeout=10) as conn:
        conn.sendall(request)
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(httpx.Limits().keepalive_expiry + 1.0)
        conn.sendall(request)
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")  # b"" once the server has closed it
