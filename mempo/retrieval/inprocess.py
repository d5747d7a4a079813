"""In-process retriever: an index folder (or a corpus file) searched without HTTP.

    r = InProcessRetriever.load("outputs/index")                   # built by `mempo index build`
    r = InProcessRetriever.from_corpus("world/corpus.jsonl")       # BM25 in memory, no build step
    r.search(["Grasdrior Labs"], topk=3)

Used by tests, the local trainer and the HTTP service (which wraps one of these).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mempo.datasets import Passage, iter_corpus
from mempo.errors import MempoError
from mempo.retrieval.base import Hit, Retriever
from mempo.retrieval.docstore import DocStore


class RowSearcher(Protocol):
    """Anything that maps queries to corpus rows: BM25 or a dense FAISS index."""

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """`(rows, scores)`, each shape (len(queries), k'); row -1 means no result."""
        ...


def validate_access_args(ids: list[str] | None, titles: list[str] | None) -> list[str]:
    """Exactly one of ids/titles; returns it. Raises MempoError otherwise."""
    if (ids is None) == (titles is None):
        raise MempoError("give exactly one of 'ids' or 'titles'")
    return list(ids if ids is not None else titles)  # type: ignore[arg-type]


class InProcessRetriever(Retriever):
    """A `Retriever` over a `DocStore` and a `RowSearcher`, in this process.

    Attributes:
        manifest: the index manifest (method, encoder, dim, ...) or a summary for
            `from_corpus` retrievers.
    """

    def __init__(self, store: DocStore, searcher: RowSearcher, manifest: dict[str, Any]) -> None:
        self.store = store
        self.searcher = searcher
        self.manifest = manifest

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_corpus(cls, path: str | Path, method: str = "bm25", **kw: Any) -> InProcessRetriever:
        """Index a corpus file in memory (no folder written).

        `method="bm25"` is instant on small corpora; `method="dense"` embeds every passage
        (kw: encoder, index_type, batch_size, device, and the index-type parameters).
        """
        passages = list(iter_corpus(path))
        return cls.from_passages(passages, method=method, **kw)

    @classmethod
    def from_passages(
        cls, passages: Sequence[Passage], method: str = "bm25", **kw: Any
    ) -> InProcessRetriever:
        """Like `from_corpus`, from passages already in memory."""
        store = DocStore.from_passages(passages)
        texts = [p.contents for p in passages]
        if method == "bm25":
            from mempo.retrieval.bm25 import BM25Searcher

            searcher: RowSearcher = BM25Searcher.build(texts)
            manifest: dict[str, Any] = {"method": "bm25", "count": len(store)}
        elif method == "dense":
            from mempo.retrieval.dense import DenseSearcher

            dense = DenseSearcher.build_in_memory(texts, **kw)
            searcher = dense
            manifest = {"method": "dense", "count": len(store), **dense.describe()}
        else:
            raise MempoError(f"unknown retrieval method '{method}' (bm25 | dense)", field="method")
        return cls(store, searcher, manifest)

    @classmethod
    def load(cls, index_dir: str | Path, *, encoder: str | None = None,
             device: str = "cpu", **kw: Any) -> InProcessRetriever:
        """Open an index folder built by `build_index`.

        `encoder` (dense only): the encoder to embed queries with; refused with a
        `MempoError` when it does not match the one the index was built with. Default: the
        manifest's encoder.
        """
        from mempo.retrieval.index import load_index

        return load_index(index_dir, encoder=encoder, device=device, **kw)

    # ------------------------------------------------------------------ Retriever

    def search(self, queries: list[str], topk: int = 3) -> list[list[Hit]]:
        if not queries:
            return []
        rows, scores = self.searcher.search(list(queries), int(topk))
        out: list[list[Hit]] = []
        for qrows, qscores in zip(rows, scores, strict=True):
            hits = [
                Hit(self.store.ids[int(r)], self.store.contents(int(r)), float(s))
                for r, s in zip(qrows, qscores, strict=True)
                if int(r) >= 0
            ]
            out.append(hits)
        return out

    def access(
        self, ids: list[str] | None = None, titles: list[str] | None = None
    ) -> list[list[Passage]]:
        keys = validate_access_args(ids, titles)
        if ids is not None:
            return [self.store.article_by_id(str(k)) for k in keys]
        return [self.store.article_by_title(str(k)) for k in keys]

    def close(self) -> None:
        self.store.close()
