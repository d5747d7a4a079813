"""Query encoder backends: the direct torch path embeds exactly like sentence-transformers'
`encode`, the int8 paths (torch dynamic quantisation, ONNX Runtime) stay close to it and
pass the index's probe check, and bad choices are clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from mempo.errors import ConfigError
from mempo.retrieval.encoder import Encoder, check_encoder_matches

QUERIES = ["Thys Dreindreilvaix", "which river flows through the capital",
           "founded in 1887 by a chemist", "the mayor of a small port town", "x"]


@pytest.fixture(scope="module")
def torch_encoder() -> Encoder:
    return Encoder("all-MiniLM-L6-v2")


def test_direct_torch_path_matches_sentence_transformers_encode(torch_encoder) -> None:
    ours = torch_encoder.encode_queries(QUERIES)
    theirs = torch_encoder.model.encode(QUERIES, normalize_embeddings=True, convert_to_numpy=True)
    assert ours.shape == (len(QUERIES), 384) and ours.dtype == np.float32
    assert np.allclose(ours, theirs, atol=1e-5)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert torch_encoder.encode_queries([]).shape == (0, 384)


def _close_to_fp32(enc: Encoder, ref: Encoder, mean_cos: float) -> None:
    cos = (enc.encode_queries(QUERIES) * ref.encode_queries(QUERIES)).sum(axis=1)
    assert cos.mean() >= mean_cos and cos.min() >= 0.9, cos
    # The service's guard against serving an index with the wrong model still accepts it.
    check_encoder_matches(ref.describe(), enc)
    # Passages (what an index is built from) are never quantised.
    p = ["Paris\nParis is the capital of France."]
    assert np.allclose(enc.encode_passages(p), ref.encode_passages(p), atol=1e-6)


def test_torch_int8_backend_is_close_and_accepted(torch_encoder) -> None:
    # torch's dynamic quantisation loses more than ONNX Runtime's (mean cosine ~0.965 here).
    _close_to_fp32(Encoder("all-MiniLM-L6-v2", backend="torch-int8"), torch_encoder, 0.95)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnx", "onnx-int8"])
def test_onnx_backends_are_close_and_accepted(torch_encoder, backend) -> None:
    pytest.importorskip("onnxruntime")
    enc = Encoder("all-MiniLM-L6-v2", backend=backend, threads=1)
    if backend == "onnx":
        assert np.allclose(enc.encode_queries(QUERIES), torch_encoder.encode_queries(QUERIES), atol=1e-4)
    _close_to_fp32(enc, torch_encoder, 0.98)


def test_bad_backend_choices_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="unknown encoder backend 'fp4'"):
        Encoder("all-MiniLM-L6-v2", backend="fp4")
    with pytest.raises(ConfigError, match="CPU only"):
        Encoder("all-MiniLM-L6-v2", backend="onnx-int8", device="cuda")
