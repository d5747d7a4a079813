"""Retrieval benchmark: micro-batching throughput, ANN recall and footprint, encoder speed,
and BM25 vs dense recall on the knowledge world. Baselines are measured in the same run.

Corpus: real Wikipedia lead summaries (`mempo corpus wiki-sample`; 10,033 articles ->
~12.3k passages of <= 100 words), embedded once with the packaged all-MiniLM-L6-v2.

- `batched_vs_per_request_throughput`: requests/s of `mempo serve retriever` (a separate
  process, dense Flat index) with micro-batching over requests/s with `--no-batching`
  (Search-R1's behaviour), 32 concurrent clients sending one query per request, in
  alternating rounds (median round reported). Also p50/p99 latency for 1, 8 and 32
  clients in both modes. Target >= 4.
- `ann_recall_at_3`: recall@3 of IVF-PQ (and HNSW) against Flat on the same query vectors
  (target >= 0.95), and `footprint_ratio_21m`: projected bytes of Flat over bytes of the
  IVF-PQ index for 21M x 768-d vectors, from the index parameters (target >= 25).
- `encoder_passages_per_s`: MiniLM passages/s on this machine (batch 64, 1,024 passages).
- `world_recall_at_3`: recall@3 of the gold passage for entity-name queries (what the
  scripted teacher searches) on the knowledge world, BM25 vs dense MiniLM.

    .venv/bin/python benchmarks/retrieval.py --quick     # ~1.5k passages, fewer requests
    .venv/bin/python benchmarks/retrieval.py             # full wiki sample, small world
    .venv/bin/python benchmarks/retrieval.py --work /tmp/rb   # keep (and resume) the embeddings

Writes benchmarks/results/retrieval.json and prints a table of ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
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
TARGETS = {"batched_vs_per_request_throughput": 4.0, "ann_recall_at_3": 0.95,
           "footprint_ratio_21m": 25.0}
# IVF-PQ at 96 one-byte codes: 96 + 8 (id) bytes per vector in RAM vs 3072 for 768-d float32.
IVFPQ = {"ivf_nlist": 256, "ivf_nprobe": 32, "pq_m": 96, "pq_nbits": 8, "pq_rerank": 10}
HNSW = {"hnsw_m": 32, "hnsw_ef_construction": 200, "hnsw_ef_search": 128}


def _queries_from(corpus: Path, n: int, seed: int) -> list[str]:
    """Query-like snippets: a 4-10 word window of a random passage (never the whole passage)."""
    rng = random.Random(seed)
    texts = [json.loads(line)["contents"].split("\n", 1)[1]
             for line in corpus.read_text(encoding="utf-8").splitlines()]
    out = []
    for _ in range(n):
        words = rng.choice(texts).split()
        k = rng.randint(4, 10)
        start = rng.randint(0, max(0, len(words) - k))
        out.append(" ".join(words[start : start + k]))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`mempo serve retriever` in a subprocess (its own GIL, as in production)."""

    def __init__(self, index: Path, batching: bool, extra_args: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mempo", "--params", os.devnull, "serve", "retriever",
               "--index", str(index), "--port", str(self.port)]
        if not batching:
            cmd.append("--no-batching")
        cmd.extend(extra_args)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> ServerProcess:
        import httpx

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError("server did not become healthy")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def _run_load(url: str, queries: list[str], clients: int) -> dict[str, Any]:
    """`clients` concurrent workers send one-query requests until `queries` run out.

    aiohttp as the load generator: it shares this machine's cores with the server, and it
    costs several times less CPU per request than httpx, so it disturbs the measurement less.
    """
    import aiohttp

    it = iter(queries)
    lat: list[float] = []
    errors = 0
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(url, connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def post(q: str) -> bool:
            async with http.post("/retrieve", json={"queries": [q], "topk": 3,
                                                    "return_scores": True}) as r:
                body = await r.json()
                return r.status == 200 and len(body["result"][0]) == 3

        async def worker() -> None:
            nonlocal errors
            for q in it:
                t = time.perf_counter()
                ok = await post(q)
                lat.append(time.perf_counter() - t)
                errors += 0 if ok else 1

        await post("warm up")  # connections and the first forward pass are not measured
        before = await _batch_counts(http)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
        after = await _batch_counts(http)
    lat.sort()
    calls = after[0] - before[0]
    return {"clients": clients, "requests": len(lat), "errors": errors,
            "requests_per_s": round(len(lat) / wall, 2),
            "mean_batch_queries": round((after[1] - before[1]) / calls, 2) if calls else None,
            "p50_ms": round(1000 * lat[len(lat) // 2], 2),
            "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2)}


async def _batch_counts(http: Any) -> tuple[float, float]:
    """(search calls, queries searched) from the server's Prometheus metrics."""
    async with http.get("/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        if line.startswith(("mempo_retriever_batch_queries_count", "mempo_retriever_batch_queries_sum")):
            name, value = line.split()
            values[name] = float(value)
    return (values.get("mempo_retriever_batch_queries_count", 0.0),
            values.get("mempo_retriever_batch_queries_sum", 0.0))


def bench_throughput(index: Path, queries: list[str], requests_at: dict[int, int],
                     rounds: int) -> dict[str, Any]:
    """Both modes, `rounds` alternating rounds each (the machine is shared: alternating
    spreads load changes over both modes); per client count the round with the median
    requests/s is reported, all rounds are kept under `rounds`."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {"batched": {}, "per_request": {}}
    qi = 0
    for rnd in range(rounds):
        for mode, batching in (("batched", True), ("per_request", False)):
            with ServerProcess(index, batching) as srv:
                for clients, n in requests_at.items():
                    qs = [queries[(qi + j) % len(queries)] for j in range(n)]
                    qi += n
                    row = asyncio.run(_run_load(srv.url, qs, clients))
                    runs[mode].setdefault(clients, []).append(row)
                    print(f"  round {rnd} {mode:12s} {row}", flush=True)
    out: dict[str, Any] = {"rounds": runs}
    for mode, by_clients in runs.items():
        out[mode] = [sorted(rows, key=lambda r: r["requests_per_s"])[len(rows) // 2]
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


def bench_query_batches(encoder: Any, queries: list[str], sizes: tuple[int, ...]) -> dict[str, Any]:
    """ms per encoder call and per query for query batches of each size, in process.

    The batching gain is bounded by cost(1) / (cost(n) / n): what the encoder alone allows
    before any HTTP work, on this machine. Measured with one torch thread: on a shared,
    oversubscribed CPU two spinning OpenMP threads make single-query calls 10x slower at
    random, which would say more about the neighbours than about batching.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"torch_threads": 1}
    try:
        out.update(_time_batches(encoder, queries, sizes))
    finally:
        torch.set_num_threads(threads)
    big = str(max(sizes))
    out["ceiling_ratio"] = round(out["1"]["ms_per_query"] / out[big]["ms_per_query"], 2)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small corpus and request counts")
    ap.add_argument("--articles", type=int, default=None, help="wiki articles (default: all; quick 1500)")
    ap.add_argument("--out", default=str(RESULTS / "retrieval.json"))
    ap.add_argument("--work", default=None,
                    help="keep indexes here (a re-run resumes from the stored embedding shards)")
    args = ap.parse_args(argv)

    from mempo.retrieval.encoder import Encoder
    from mempo.retrieval.index import build_index
    from mempo.retrieval.wiki_sample import build_wiki_sample

    articles = args.articles or (1500 if args.quick else None)
    requests_at = {1: 60, 8: 300, 32: 600} if args.quick else {1: 100, 8: 400, 32: 1000}
    started = time.time()
    result: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "targets": TARGETS,
    }
    with tempfile.TemporaryDirectory(prefix="mempo-bench-retrieval-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus = work / "wiki.jsonl"
        wm = build_wiki_sample(corpus, limit=articles)
        print(f"corpus: {wm['articles']} articles, {wm['passages']} passages", flush=True)
        encoder = Encoder("all-MiniLM-L6-v2", batch_size=64)
        sample = [json.loads(line)["contents"] for line in
                  corpus.read_text(encoding="utf-8").splitlines()[:256 if args.quick else 1024]]
        encoder.encode_passages(sample[:64])  # warm-up
        t = time.perf_counter()
        encoder.encode_passages(sample)
        result["encoder_passages_per_s"] = round(len(sample) / (time.perf_counter() - t), 2)
        result["encoder_sample_mean_words"] = round(float(np.mean([len(x.split()) for x in sample])), 1)
        result["encoder_query_batches"] = bench_query_batches(
            encoder, _queries_from(corpus, 512, seed=4), (1, 8, 16, 32))
        print(f"query batches: {result['encoder_query_batches']}", flush=True)
        t = time.perf_counter()
        if _finished_flat(work / "flat", corpus):  # --work from an earlier run: keep it
            result["flat_build"] = {"reused_index": True}
        else:
            m = build_index(corpus, work / "flat", method="dense", index_type="flat",
                            encoder=encoder, shard_size=5000)
            result["flat_build"] = {"seconds": round(time.perf_counter() - t, 1), **m["resume"]}
        result["corpus"] = {"articles": wm["articles"], "passages": wm["passages"]}
        print(f"encoder: {result['encoder_passages_per_s']} passages/s", flush=True)

        ann_queries = _queries_from(corpus, 300 if args.quick else 1000, seed=1)
        result["ann"] = bench_ann(work / "flat", work, corpus, encoder, ann_queries)
        print(f"ann: {json.dumps(result['ann'])}", flush=True)
        del encoder  # free the benchmark's copy before the servers load theirs

        load_queries = _queries_from(corpus, sum(requests_at.values()), seed=2)
        result["throughput"] = bench_throughput(work / "flat", load_queries, requests_at,
                                                rounds=1 if args.quick else 3)

        world_encoder = Encoder("all-MiniLM-L6-v2", batch_size=64)
        result["world_recall_at_3"] = bench_world("tiny" if args.quick else "small", work, world_encoder)
        print(f"world: {json.dumps(result['world_recall_at_3'])}", flush=True)

    at32 = {row["clients"]: row for row in result["throughput"]["batched"]}[32]
    base32 = {row["clients"]: row for row in result["throughput"]["per_request"]}[32]
    result["batched_vs_per_request_throughput"] = round(at32["requests_per_s"] / base32["requests_per_s"], 2)
    result["ann_recall_at_3"] = result["ann"]["ivfpq"]["recall_at_3_vs_flat"]
    result["ann_recall_at_3_no_rerank"] = result["ann"]["ivfpq"]["recall_at_3_vs_flat_no_rerank"]
    result["footprint_ratio_21m"] = result["ann"]["ivfpq"]["footprint_ratio_21m"]
    result["errors"] = sum(r["errors"] for by_clients in result["throughput"]["rounds"].values()
                           for rows in by_clients.values() for r in rows)
    result["meets_targets"] = {
        "batched_vs_per_request_throughput": result["batched_vs_per_request_throughput"] >= TARGETS["batched_vs_per_request_throughput"],
        "ann_recall_at_3": result["ann_recall_at_3"] >= TARGETS["ann_recall_at_3"],
        "footprint_ratio_21m": result["footprint_ratio_21m"] >= TARGETS["footprint_ratio_21m"],
    }
    result["seconds"] = round(time.time() - started, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    print()
    print(f"{'':36s}{'batched':>12s}{'per-request':>13s}{'ratio':>8s}")
    for b, p in zip(result["throughput"]["batched"], result["throughput"]["per_request"], strict=True):
        c = b["clients"]
        print(f"{f'requests/s, {c} clients':36s}{b['requests_per_s']:12.1f}{p['requests_per_s']:13.1f}"
              f"{b['requests_per_s'] / p['requests_per_s']:8.2f}")
        print(f"{f'p50 / p99 ms, {c} clients':36s}{b['p50_ms']:5.0f} /{b['p99_ms']:5.0f}"
              f"{p['p50_ms']:6.0f} /{p['p99_ms']:5.0f}")
    ivf, hnsw = result["ann"]["ivfpq"], result["ann"]["hnsw"]
    print(f"{'':36s}{'value':>12s}{'baseline':>13s}{'target':>8s}")
    print(f"{'ann_recall_at_3 (IVF-PQ+rerank)':36s}{ivf['recall_at_3_vs_flat']:12.4f}{'Flat = 1':>13s}{'>=0.95':>8s}")
    print(f"{'  IVF-PQ without rerank':36s}{ivf['recall_at_3_vs_flat_no_rerank']:12.4f}")
    print(f"{'  HNSW':36s}{hnsw['recall_at_3_vs_flat']:12.4f}")
    print(f"{'footprint_ratio_21m (IVF-PQ)':36s}{ivf['footprint_ratio_21m']:12.1f}{'Flat = 1':>13s}{'>=25':>8s}")
    print(f"{'encoder_passages_per_s (MiniLM)':36s}{result['encoder_passages_per_s']:12.1f}")
    qb = result["encoder_query_batches"]
    print(f"{'encoder ms/query, batch 1 vs 32':36s}{qb['32']['ms_per_query']:12.2f}{qb['1']['ms_per_query']:13.2f}"
          f"{qb['ceiling_ratio']:8.2f}  (ceiling of the batching gain)")
    w = result["world_recall_at_3"]
    print(f"{'world recall@3 bm25 / dense':36s}{w['bm25']['recall_at_3']:12.4f}{w['dense']['recall_at_3']:13.4f}")
    print(f"batched/per-request throughput at 32 clients: {result['batched_vs_per_request_throughput']} "
          f"(target >= 4); errors: {result['errors']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
