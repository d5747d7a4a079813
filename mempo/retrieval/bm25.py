"""BM25 lexical search (bm25s): build from passage texts, save/load, batched top-k.

The knowledge world's names are invented ("Thys Dreindreilvaix"), which is where lexical
matching shines: see params.yaml `index.method` for the measured comparison with dense.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

BM25_DIR = "bm25"


class BM25Searcher:
    """A bm25s index plus the tokenizer vocabulary it was built with.

    `search(queries, k)` returns `(rows, scores)`, both shape (len(queries), k'), where
    k' = min(k, corpus size); rows are 0-based corpus rows.
    """

    def __init__(self, model: object, tokenizer: object, n_docs: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.n_docs = n_docs
        # bm25s' tokenizer mutates internal dicts even with update_vocab=False; serialise it.
        self._lock = threading.Lock()

    @classmethod
    def build(cls, texts: Sequence[str], k1: float = 1.5, b: float = 0.75,
              stopwords: str | None = "en", show_progress: bool = False) -> BM25Searcher:
        import bm25s

        tokenizer = bm25s.tokenization.Tokenizer(stopwords=stopwords, stemmer=None)
        tokens = tokenizer.tokenize(list(texts), update_vocab=True, return_as="tuple",
                                    show_progress=show_progress)
        model = bm25s.BM25(k1=k1, b=b)
        model.index(tokens, show_progress=show_progress)
        return cls(model, tokenizer, len(texts))

    def save(self, folder: str | Path) -> None:
        folder = Path(folder) / BM25_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save(str(folder))  # type: ignore[attr-defined]
        self.tokenizer.save_vocab(str(folder))  # type: ignore[attr-defined]
        self.tokenizer.save_stopwords(str(folder))  # type: ignore[attr-defined]

    @classmethod
    def load(cls, folder: str | Path, n_docs: int) -> BM25Searcher:
        import bm25s

        folder = Path(folder) / BM25_DIR
        model = bm25s.BM25.load(str(folder), mmap=False)
        tokenizer = bm25s.tokenization.Tokenizer(stemmer=None)
        tokenizer.load_vocab(str(folder))
        tokenizer.load_stopwords(str(folder))
        return cls(model, tokenizer, n_docs)

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        k = max(1, min(int(k), self.n_docs))
        with self._lock:
            # "never": unseen query words are dropped instead of growing the vocabulary.
            ids = self.tokenizer.tokenize(list(queries), update_vocab="never",  # type: ignore[attr-defined]
                                          return_as="ids", show_progress=False)
            rows, scores = self.model.retrieve(ids, k=k, show_progress=False,  # type: ignore[attr-defined]
                                               n_threads=0)
        return np.asarray(rows, dtype=np.int64), np.asarray(scores, dtype=np.float32)
