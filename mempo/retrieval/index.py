"""Build an index folder from a corpus, and open one for search.

    mempo index build --corpus data/world/corpus.jsonl --out outputs/index --method bm25
    mempo index build --corpus wiki.jsonl --out idx --method dense --index-type ivfpq --ray

Folder layout:
    manifest.json            method, encoder (name, dim, probe), metric, index type + params,
                             corpus sha256, count, shards, build time, versions
    docs.jsonl, doc_offsets.npy, doc_keys.json    the passages (see docstore.py)
    bm25/                    bm25s index + tokenizer vocabulary          (method=bm25)
    index.faiss              the FAISS index                             (method=dense)
    embeddings/emb-00000.npy float16 embeddings, one file per shard      (method=dense)

Resume: a dense build embeds the corpus in shards of `shard_size` passages and keeps each
finished shard in `.<out>.partial/` beside the output. A re-run with the same corpus and
encoder reuses them and embeds only the rest; the finished folder replaces `<out>`
atomically, so readers never see half an index.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from mempo.datasets import Passage, iter_corpus
from mempo.errors import DataError, MempoError
from mempo.io import atomic_dir, atomic_path, sha256_file, write_json
from mempo.retrieval.docstore import DocStore

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
INDEX_FILE = "index.faiss"
EMB_DIR = "embeddings"
STATE_FILE = "build_state.json"
FORMAT_VERSION = 1


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("mempo-pipeline", "faiss-cpu", "bm25s", "sentence-transformers", "torch", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def partial_dir(out: Path) -> Path:
    """Where an unfinished build keeps its shards (beside `out`, so the rename is atomic)."""
    return out.parent / f".{out.name}.partial"


def shard_path(work: Path, i: int) -> Path:
    return work / EMB_DIR / f"emb-{i:05d}.npy"


def _prepare_work_dir(work: Path, state: dict[str, Any]) -> None:
    """Reuse `work` if it was started with the same `state`, else start it afresh."""
    state_file = work / STATE_FILE
    if work.exists():
        try:
            old = json.loads(state_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            old = None
        if old != state:
            log.info("discarding unfinished build in %s (different corpus/encoder/params)", work)
            shutil.rmtree(work)
    (work / EMB_DIR).mkdir(parents=True, exist_ok=True)
    if not state_file.exists():
        write_json(state_file, state)


def build_index(
    corpus: str | Path,
    out: str | Path,
    *,
    method: str = "bm25",
    encoder: str | Any = "all-MiniLM-L6-v2",
    index_type: str = "flat",
    index_params: dict[str, Any] | None = None,
    batch_size: int = 64,
    shard_size: int = 10_000,
    device: str = "cpu",
    faiss_gpu: bool = False,
    use_ray: bool = False,
    ray_actors: int = 1,
    ray_address: str | None = None,
    bm25_k1: float = 1.5,
    bm25_b: float = 0.75,
    reuse_embeddings_from: str | Path | None = None,
    on_shard_done: Callable[[int, bool], None] | None = None,
) -> dict[str, Any]:
    """Build the index folder `out` from a wiki-18-format `corpus`. Returns the manifest.

    Args:
        method: "bm25" (bm25s) or "dense" (sentence-transformers + FAISS).
        encoder: `all-MiniLM-L6-v2` (packaged), a local model folder (e5 detected by name),
            or an already loaded `Encoder` (reused, not reloaded).
        index_type: flat | hnsw | ivfpq; `index_params` holds their knobs (see dense.py).
        batch_size: passages per encoder forward pass.
        shard_size: passages per embedding shard (the unit of resume).
        device: "cpu" or "cuda" for the encoder; `faiss_gpu` trains/adds on GPU 0.
        use_ray: embed each shard on a Ray actor pool of `ray_actors` actors.
        reuse_embeddings_from: a dense index folder built from the same corpus with the same
            encoder: its embedding shards (and shard size) are reused, hard-linked, instead of
            re-embedding, to try another index type on the same vectors.
        on_shard_done: called as (shard index, reused) after each shard (tests, progress).
    """
    corpus, out = Path(corpus), Path(out)
    if not corpus.exists():
        raise DataError("corpus file not found", path=corpus)
    if method not in ("bm25", "dense"):
        raise MempoError(f"unknown method '{method}' (bm25 | dense)", field="index.method")
    if shard_size < 1 or batch_size < 1:
        raise MempoError("shard_size and batch_size must be >= 1", field="index.shard_size")
    t0 = time.time()
    corpus_sha = sha256_file(corpus)
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "method": method,
        "corpus": {"path": str(corpus), "sha256": corpus_sha},
        "created_unix": int(t0),
        "versions": _versions(),
    }
    work = partial_dir(out)

    if method == "bm25":
        from mempo.retrieval.bm25 import BM25Searcher

        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        texts: list[str] = []

        def collect() -> Iterator[Passage]:
            for p in tqdm(iter_corpus(corpus), desc="read corpus", unit=" passages",
                          mininterval=2.0):
                texts.append(p.contents)
                yield p

        count = DocStore.write(collect(), work)
        BM25Searcher.build(texts, k1=bm25_k1, b=bm25_b, show_progress=True).save(work)
        manifest.update({"metric": "bm25", "index_type": "bm25", "encoder": None, "dim": None,
                         "index_params": {"k1": bm25_k1, "b": bm25_b, "stopwords": "en"},
                         "shards": 0})
    else:
        from mempo.retrieval.dense import effective_index_params
        from mempo.retrieval.encoder import Encoder

        if reuse_embeddings_from is not None:
            # Shard files are the unit being reused, so the source's shard size wins.
            shard_size = int(read_manifest(reuse_embeddings_from).get("shard_size") or shard_size)
        # With Ray the actors embed; the driver's copy only describes the model, on CPU.
        enc = encoder if isinstance(encoder, Encoder) else Encoder(
            encoder, device="cpu" if use_ray else device, batch_size=batch_size)
        source = encoder if isinstance(encoder, str) else (
            enc.name if enc.name == "all-MiniLM-L6-v2" else str(enc.path))
        described = enc.describe()
        state = {"corpus_sha256": corpus_sha, "encoder": described["name"], "dim": enc.dim,
                 "probe": described["probe"], "shard_size": shard_size}
        _prepare_work_dir(work, state)
        if reuse_embeddings_from is not None:
            _seed_shards(work, Path(reuse_embeddings_from), state)
        stats = {"embedded": 0, "reused": 0}

        def embed_shard(i: int, shard_texts: list[str]) -> None:
            path = shard_path(work, i)
            if path.exists():
                stats["reused"] += 1
                if on_shard_done:
                    on_shard_done(i, True)
                return
            if use_ray:
                from mempo.retrieval.ray_embed import embed_with_ray

                vecs = embed_with_ray(shard_texts, encoder=source, device=device,
                                      batch_size=batch_size, num_actors=ray_actors,
                                      address=ray_address)
            else:
                vecs = enc.encode_passages(shard_texts)
            with atomic_path(path) as tmp, open(tmp, "wb") as fh:
                np.save(fh, vecs.astype(np.float16))
            stats["embedded"] += 1
            if on_shard_done:
                on_shard_done(i, False)

        n_shards = 0

        def stream() -> Iterator[Passage]:
            nonlocal n_shards
            buf: list[str] = []
            for p in tqdm(iter_corpus(corpus), desc="embed corpus", unit=" passages",
                          mininterval=2.0):
                yield p
                buf.append(p.contents)
                if len(buf) == shard_size:
                    embed_shard(n_shards, buf)
                    n_shards, buf = n_shards + 1, []
            if buf:
                embed_shard(n_shards, buf)
                n_shards += 1

        count = DocStore.write(stream(), work)
        params = effective_index_params(index_type, count, enc.dim, index_params or {})
        index = _index_from_shards(work, n_shards, enc.dim, index_type, params, faiss_gpu)
        import faiss

        faiss.write_index(index, str(work / INDEX_FILE))
        manifest.update({
            "metric": "inner_product", "index_type": index_type, "index_params": params,
            "encoder": {**described, "source": source}, "dim": enc.dim,
            "shards": n_shards, "shard_size": shard_size, "embedding_dtype": "float16",
            "resume": {"shards_embedded": stats["embedded"], "shards_reused": stats["reused"]},
        })
    manifest["count"] = count
    manifest["corpus"]["count"] = count
    manifest["build_seconds"] = round(time.time() - t0, 3)
    (work / STATE_FILE).unlink(missing_ok=True)
    write_json(work / MANIFEST, manifest)
    with atomic_dir(out) as tmp:
        tmp.rmdir()
        os.replace(work, tmp)
    log.info("index written to %s (%d passages, %s)", out, count, method)
    return manifest


def _seed_shards(work: Path, source: Path, state: dict[str, Any]) -> None:
    """Link `source`'s embedding shards into `work` after checking they fit `state`."""
    from mempo.errors import ConfigError

    m = read_manifest(source)
    enc = m.get("encoder") or {}
    theirs = {"corpus_sha256": m["corpus"]["sha256"], "encoder": enc.get("name"),
              "dim": m.get("dim"), "shard_size": m.get("shard_size")}
    ours = {k: state[k] for k in theirs}
    if m["method"] != "dense" or theirs != ours or enc.get("probe") != state["probe"]:
        raise ConfigError(f"cannot reuse embeddings of {source}: built from {theirs}, this build "
                          f"needs {ours}", field="reuse_embeddings_from")
    for i in range(int(m["shards"])):
        dst = shard_path(work, i)
        if not dst.exists():
            # An existing shard counts as finished, so it must appear whole or not at all.
            with atomic_path(dst) as tmp:
                try:
                    os.link(shard_path(source, i), tmp)
                except OSError:  # another filesystem: copy instead
                    shutil.copyfile(shard_path(source, i), tmp)


def _index_from_shards(work: Path, n_shards: int, dim: int, index_type: str,
                       params: dict[str, Any], faiss_gpu: bool) -> Any:
    """Train (IVF-PQ: on a sample) and add every shard, shard by shard."""
    import faiss

    from mempo.retrieval.dense import new_faiss_index, to_gpu

    index = new_faiss_index(dim, index_type, params)
    res = None
    if faiss_gpu:
        index, res = to_gpu(index, index_type)
    shards = [np.load(shard_path(work, i), mmap_mode="r") for i in range(n_shards)]
    if not index.is_trained:
        # ~256 points per coarse cell is plenty for k-means; more only costs time.
        total = sum(len(s) for s in shards)
        want = min(total, max(256 * params.get("ivf_nlist", 1), 256 * 2 ** params.get("pq_nbits", 8)))
        rng = np.random.default_rng(0)
        rows = np.sort(rng.choice(total, size=want, replace=False))
        sample = np.concatenate([np.asarray(s, dtype=np.float32) for s in shards])[rows] \
            if total <= 2_000_000 else _gather(shards, rows)
        index.train(np.ascontiguousarray(sample))
    for s in tqdm(shards, desc="add to index", unit=" shards", disable=n_shards < 2):
        index.add(np.ascontiguousarray(s, dtype=np.float32))
    if res is not None:
        index = faiss.index_gpu_to_cpu(index)
    return index


def _gather(shards: list[np.ndarray], rows: np.ndarray) -> np.ndarray:
    starts = np.cumsum([0] + [len(s) for s in shards])
    which = np.searchsorted(starts, rows, side="right") - 1
    return np.stack([np.asarray(shards[w][r - starts[w]], dtype=np.float32)
                     for w, r in zip(which, rows, strict=True)])


def read_manifest(index_dir: str | Path) -> dict[str, Any]:
    """The manifest of an index folder; DataError if missing or unreadable."""
    path = Path(index_dir) / MANIFEST
    if not path.exists():
        raise DataError("not an index folder (no manifest.json); build one with "
                        "`mempo index build`", path=index_dir)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"manifest is not valid JSON: {e}", path=path) from e
    for key in ("method", "count"):
        if key not in manifest:
            raise DataError("missing required field", path=path, field=key)
    return manifest


def load_index(index_dir: str | Path, *, encoder: str | Any | None = None, device: str = "cpu",
               batch_size: int = 64, search_params: dict[str, Any] | None = None) -> Any:
    """Open an index folder as an `InProcessRetriever`.

    Args:
        encoder: the query encoder, a name/path or a loaded `Encoder` (dense only; default:
            the one in the manifest). Refused with ConfigError when it does not embed like
            the index's encoder.
        search_params: override search-time knobs (`hnsw_ef_search`, `ivf_nprobe`,
            `pq_rerank`) without rebuilding.
    """
    from mempo.retrieval.inprocess import InProcessRetriever

    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir)
    store = DocStore.load(index_dir)
    if len(store) != manifest["count"]:
        raise DataError(f"manifest count {manifest['count']} != {len(store)} stored passages",
                        path=index_dir / MANIFEST, field="count")
    if manifest["method"] == "bm25":
        from mempo.retrieval.bm25 import BM25Searcher

        if encoder:
            raise MempoError(f"index {index_dir} is BM25; it takes no encoder (got '{encoder}')",
                             field="encoder")
        return InProcessRetriever(store, BM25Searcher.load(index_dir, len(store)), manifest)

    import faiss

    from mempo.retrieval.dense import DenseSearcher, set_search_params
    from mempo.retrieval.encoder import Encoder, check_encoder_matches

    built = manifest["encoder"]
    enc = encoder if isinstance(encoder, Encoder) else Encoder(
        encoder or built.get("source") or built["name"], device=device, batch_size=batch_size)
    check_encoder_matches(built, enc)
    index = faiss.read_index(str(index_dir / INDEX_FILE))
    index_type = manifest["index_type"]
    params = {**manifest.get("index_params", {}), **(search_params or {})}
    set_search_params(index, index_type, params)
    rerank = None
    if params.get("pq_rerank"):
        rerank = [np.load(shard_path(index_dir, i), mmap_mode="r") for i in range(manifest["shards"])]
    searcher = DenseSearcher(enc, index, index_type, params, rerank)
    if searcher.n_docs != len(store):
        raise DataError(f"{INDEX_FILE} holds {searcher.n_docs} vectors, not {len(store)}",
                        path=index_dir)
    return InProcessRetriever(store, searcher, {**manifest, "index_params": params})
