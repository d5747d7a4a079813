"""Dense search: FAISS indexes over normalised embeddings (inner product = cosine).

Index types and their parameters (all in params.yaml `index:`):
- `flat`  : exact search, IndexFlatIP. 4*d bytes per vector.
- `hnsw`  : IndexHNSWFlat, graph of `hnsw_m` links per node; `hnsw_ef_construction`,
            `hnsw_ef_search`. ~4*d + 8*M bytes per vector: faster, not smaller.
- `ivfpq` : IndexIVFPQ, `ivf_nlist` coarse cells, `pq_m` sub-quantizers of `pq_nbits` bits,
            `ivf_nprobe` cells searched. m*nbits/8 code bytes + 8 id bytes per vector in RAM.
            With `pq_rerank` > 0 the top k*pq_rerank candidates are re-scored exactly from the
            float16 embedding shards, memory-mapped from disk (never loaded whole).

    searcher = DenseSearcher.build_in_memory(texts, encoder="all-MiniLM-L6-v2", index_type="hnsw")
    rows, scores = searcher.search(["Grasdrior Labs"], k=3)    # shapes (1, 3)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from mempo.errors import ConfigError
from mempo.retrieval.encoder import Encoder

INDEX_TYPES = ("flat", "hnsw", "ivfpq")
ID_BYTES = 8  # faiss stores an int64 id per vector in IVF lists


def effective_index_params(index_type: str, n: int, dim: int, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters actually used for `n` vectors of `dim` dims.

    IVF-PQ needs enough training points: nlist is capped at n/39 and 2**nbits at n (faiss'
    own minimums), and pq_m must divide dim; the manifest records what was used.
    """
    if index_type == "flat":
        return {}
    if index_type == "hnsw":
        return {
            "hnsw_m": int(params.get("hnsw_m", 32)),
            "hnsw_ef_construction": int(params.get("hnsw_ef_construction", 200)),
            "hnsw_ef_search": int(params.get("hnsw_ef_search", 128)),
        }
    if index_type == "ivfpq":
        nlist = max(1, min(int(params.get("ivf_nlist", 1024)), n // 39))
        nbits = int(params.get("pq_nbits", 8))
        while nbits > 1 and 2**nbits > n:
            nbits -= 1
        m = int(params.get("pq_m", 48))
        if dim % m != 0:
            raise ConfigError(f"pq_m={m} must divide the embedding dim {dim}", field="index.pq_m")
        return {
            "ivf_nlist": nlist,
            "ivf_nprobe": min(int(params.get("ivf_nprobe", 32)), nlist),
            "pq_m": m,
            "pq_nbits": nbits,
            "pq_rerank": int(params.get("pq_rerank", 0)),
        }
    raise ConfigError(f"unknown index type '{index_type}' ({' | '.join(INDEX_TYPES)})",
                      field="index.index_type")


def bytes_per_vector(index_type: str, dim: int, params: dict[str, Any]) -> float:
    """In-RAM bytes per indexed vector (analytical; excludes per-index constants)."""
    if index_type == "flat":
        return 4.0 * dim
    if index_type == "hnsw":
        # level-0 keeps 2*M int32 links; upper levels add ~1/(M-1) of that on average.
        m = params["hnsw_m"]
        return 4.0 * dim + 4.0 * 2 * m * (1 + 1 / max(1, m - 1))
    if index_type == "ivfpq":
        return params["pq_m"] * params["pq_nbits"] / 8 + ID_BYTES
    raise ConfigError(f"unknown index type '{index_type}'")


def footprint_ratio(index_type: str, params: dict[str, Any], n: int = 21_000_000,
                    dim: int = 768) -> float:
    """Projected bytes of a Flat index over bytes of this index for `n` x `dim` vectors.

    Coarse centroids (IVF: nlist*dim*4) are included; PQ codebooks (dim*2**nbits*4) too.
    The PQ code size m*nbits/8 is taken as given (same m at the projected dim).
    """
    flat = 4.0 * dim * n
    per = bytes_per_vector(index_type, dim, params) * n
    if index_type == "ivfpq":
        per += params["ivf_nlist"] * dim * 4 + dim * 2 ** params["pq_nbits"] * 4
    return flat / per


def new_faiss_index(dim: int, index_type: str, params: dict[str, Any]) -> Any:
    """An empty FAISS inner-product index of `index_type` (IVF-PQ still needs `train`)."""
    import faiss

    if index_type == "flat":
        return faiss.IndexFlatIP(dim)
    if index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, params["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params["hnsw_ef_construction"]
        index.hnsw.efSearch = params["hnsw_ef_search"]
        return index
    if index_type == "ivfpq":
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFPQ(quantizer, dim, params["ivf_nlist"], params["pq_m"],
                                 params["pq_nbits"], faiss.METRIC_INNER_PRODUCT)
        index.nprobe = params["ivf_nprobe"]
        return index
    raise ConfigError(f"unknown index type '{index_type}'", field="index.index_type")


def set_search_params(index: Any, index_type: str, params: dict[str, Any]) -> None:
    """Apply the search-time knobs (efSearch, nprobe) to a loaded index."""
    if index_type == "hnsw":
        index.hnsw.efSearch = int(params["hnsw_ef_search"])
    elif index_type == "ivfpq":
        index.nprobe = int(params["ivf_nprobe"])


def to_gpu(index: Any, index_type: str) -> tuple[Any, Any]:
    """`(gpu_index, resources)` on GPU 0; ConfigError when faiss has no GPU support."""
    import faiss

    if not hasattr(faiss, "StandardGpuResources"):
        raise ConfigError("--faiss-gpu needs faiss-gpu (this faiss build has no GPU support)",
                          field="index.faiss_gpu")
    if index_type == "hnsw":
        raise ConfigError("faiss has no GPU HNSW; use flat or ivfpq with --faiss-gpu",
                          field="index.faiss_gpu")
    res = faiss.StandardGpuResources()
    return faiss.index_cpu_to_gpu(res, 0, index), res


def make_faiss_index(vectors: np.ndarray, index_type: str, params: dict[str, Any],
                     use_gpu: bool = False) -> Any:
    """Build (train + add) a CPU FAISS inner-product index over `vectors` (float32, (n, d)).

    With `use_gpu` the training and adding run on GPU 0 and the result is copied back.
    """
    import faiss

    index = new_faiss_index(vectors.shape[1], index_type, params)
    res = None
    if use_gpu:
        index, res = to_gpu(index, index_type)
    if not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    if res is not None:
        index = faiss.index_gpu_to_cpu(index)
    del res
    return index


class DenseSearcher:
    """Encoder + FAISS index. `search(queries, k)` -> `(rows, scores)`, shape (nq, k).

    Args:
        encoder: embeds the queries (None: only `search_vectors` works).
        index: a FAISS index whose ids are corpus rows.
        index_type, params: as in `effective_index_params`.
        rerank_vectors: per-shard float16 arrays (possibly memory-mapped), concatenated in
            row order, for exact re-scoring of IVF-PQ candidates.
    """

    def __init__(self, encoder: Encoder | None, index: Any, index_type: str,
                 params: dict[str, Any], rerank_vectors: Sequence[np.ndarray] | None = None) -> None:
        self.encoder = encoder
        self.index = index
        self.index_type = index_type
        self.params = params
        self.n_docs = int(index.ntotal)
        self._shards = list(rerank_vectors or [])
        self._shard_starts = np.cumsum([0] + [len(s) for s in self._shards])
        # faiss search releases the GIL and is thread-safe for reads; the lock only guards
        # the parameter setting below against concurrent changes.
        self._lock = threading.Lock()

    @classmethod
    def build_in_memory(cls, texts: Sequence[str], *, encoder: str | Encoder = "all-MiniLM-L6-v2",
                        index_type: str = "flat", device: str = "cpu", batch_size: int = 64,
                        **params: Any) -> DenseSearcher:
        """Embed `texts` and index them (no files written)."""
        enc = encoder if isinstance(encoder, Encoder) else Encoder(encoder, device=device,
                                                                   batch_size=batch_size)
        vecs = enc.encode_passages(texts)
        eff = effective_index_params(index_type, len(vecs), enc.dim, params)
        index = make_faiss_index(vecs, index_type, eff)
        rerank = [vecs.astype(np.float16)] if eff.get("pq_rerank") else None
        return cls(enc, index, index_type, eff, rerank)

    def describe(self) -> dict[str, Any]:
        return {
            "index_type": self.index_type,
            "index_params": self.params,
            "encoder": self.encoder.describe() if self.encoder else None,
        }

    def _vectors(self, rows: np.ndarray) -> np.ndarray:
        """float32 embeddings of corpus `rows` (1-D int array) from the shards."""
        shard = np.searchsorted(self._shard_starts, rows, side="right") - 1
        out = np.empty((len(rows), self._shards[0].shape[1]), dtype=np.float32)
        for i, (s, r) in enumerate(zip(shard, rows, strict=True)):
            out[i] = self._shards[s][r - self._shard_starts[s]]
        return out

    def search_vectors(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k rows and inner-product scores for query vectors `q` (float32, (nq, d))."""
        k = max(1, min(int(k), self.n_docs))
        rerank = int(self.params.get("pq_rerank", 0)) if self._shards else 0
        fetch = min(self.n_docs, k * rerank) if rerank else k
        scores, rows = self.index.search(np.ascontiguousarray(q, dtype=np.float32), fetch)
        if not rerank:
            return rows.astype(np.int64), scores.astype(np.float32)
        out_rows = np.full((len(q), k), -1, dtype=np.int64)
        out_scores = np.full((len(q), k), -math.inf, dtype=np.float32)
        for i in range(len(q)):
            cand = rows[i][rows[i] >= 0]
            if len(cand) == 0:
                continue
            exact = self._vectors(cand) @ q[i]
            order = np.argsort(-exact)[:k]
            out_rows[i, : len(order)] = cand[order]
            out_scores[i, : len(order)] = exact[order]
        return out_rows, out_scores

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.encoder is None:
            raise ConfigError("this dense index was opened without an encoder")
        return self.search_vectors(self.encoder.encode_queries(queries), k)
