"""The external-memory baseline's per-episode vector store ("working memory + vector store").

    store = EpisodeVectorStore(HashingEncoder())
    store.add(["Doc 1(Title: X) X was born in Y.", ...])
    store.top(["where was X born"], k=3)        # -> most similar earlier snippets

Each episode gets its own store (FAISS inner-product index over unit vectors = cosine), so
nothing leaks between questions. Two encoders:
- `HashingEncoder` (default): a real, deterministic lexical embedding: normalised words and
  word bigrams hashed into `dim` buckets, sublinear counts, L2-normalised. No model, fast on
  CPU, and a fair fit for entity-heavy snippets.
- `SentenceEncoder`: the retrieval stage's sentence-transformers encoder (e.g. the packaged
  all-MiniLM-L6-v2), with a text -> vector cache shared across episodes (a memo of a pure
  function, not shared memory: each episode's store still holds only its own snippets).
"""

from __future__ import annotations

import math
import threading
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class TextEncoder(Protocol):
    """Maps texts to unit vectors, float32 [n_texts, dim]."""

    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


class HashingEncoder:
    """Hashed bag of words + bigrams (see module doc). `encode` -> float32 [n, dim], unit rows."""

    def __init__(self, dim: int = 1024) -> None:
        self.dim = dim

    def _tokens(self, text: str) -> list[str]:
        from mempo.rewards import normalize_answer

        words = normalize_answer(text).split()
        return words + [f"{a} {b}" for a, b in zip(words, words[1:], strict=False)]

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for tok, n in Counter(self._tokens(text)).items():
                # crc32 is stable across processes (Python's hash() is salted per run).
                out[i, zlib.crc32(tok.encode("utf-8")) % self.dim] += 1.0 + math.log(n)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)


class SentenceEncoder:
    """`mempo.retrieval.encoder.Encoder` behind the `TextEncoder` protocol, memoised by text."""

    def __init__(self, name_or_path: str, device: str = "cpu") -> None:
        from mempo.retrieval.encoder import Encoder

        self._enc = Encoder(name_or_path, device=device)
        self.dim = int(self._enc.encode_queries(["probe"]).shape[1])
        self._cache: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        with self._lock:
            missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if missing:
            vecs = self._enc.encode_queries(missing)
            with self._lock:
                self._cache.update(zip(missing, np.asarray(vecs, dtype=np.float32), strict=True))
        with self._lock:
            return np.stack([self._cache[t] for t in texts]) if texts else np.zeros((0, self.dim), np.float32)


def make_encoder(spec: str, device: str = "cpu") -> TextEncoder:
    """`"hashing"` -> `HashingEncoder()`; anything else -> `SentenceEncoder(spec)`."""
    return HashingEncoder() if spec == "hashing" else SentenceEncoder(spec, device=device)


class EpisodeVectorStore:
    """The snippets one episode has seen, searchable by similarity. Duplicates are stored once."""

    def __init__(self, encoder: TextEncoder) -> None:
        import faiss

        self.encoder = encoder
        self.index = faiss.IndexFlatIP(encoder.dim)
        self.snippets: list[str] = []
        self._seen: set[str] = set()

    def __len__(self) -> int:
        return len(self.snippets)

    def add(self, snippets: Sequence[str]) -> int:
        """Store new snippets (exact repeats skipped). Returns how many were added."""
        new = [s for s in dict.fromkeys(s.strip() for s in snippets) if s and s not in self._seen]
        if new:
            self.index.add(self.encoder.encode(new))
            self.snippets.extend(new)
            self._seen.update(new)
        return len(new)

    def top(self, query: str, k: int, exclude: Sequence[str] = ()) -> list[str]:
        """The `k` stored snippets most similar to `query`, best first, skipping `exclude`
        (e.g. the snippets already shown as the last result). Ties keep insertion order."""
        if not self.snippets or k <= 0:
            return []
        skip = {s.strip() for s in exclude}
        n = min(len(self.snippets), k + len(skip))
        scores, ids = self.index.search(self.encoder.encode([query]), n)
        pairs = [(float(sc), int(i)) for sc, i in zip(scores[0], ids[0], strict=True) if i >= 0]
        order = [i for _, i in sorted(pairs, key=lambda p: (-p[0], p[1]))]
        return [self.snippets[i] for i in order if self.snippets[i] not in skip][:k]
