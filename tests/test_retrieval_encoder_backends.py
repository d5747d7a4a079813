"""Query encoder backends: the direct torch path embeds exactly like sentence-transformers'
`encode`, the int8 paths (torch dynamic quantisation, ONNX Runtime) stay close to it and
pass the index's probe check, and bad choices are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from benchmark_helpers import load_benchmark

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


def test_benchmark_compares_backends_on_the_same_queries(torch_encoder, tmp_path) -> None:
    """benchmarks/retrieval.py's encoder section: per backend, the queries it finds that the
    torch encoder misses and the reverse add up to its recall difference, with an interval."""
    import json

    from mempo.retrieval.index import build_index

    bench = load_benchmark("retrieval")
    words = ("river harbour castle mayor chemist founded capital bridge island valley market "
             "painter railway garden abbey mill tower lake forest coast").split()
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": str(i), "contents": f"T{i}\n" + " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(30))}
            for i in range(60)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_index(corpus, tmp_path / "flat", method="dense", index_type="flat", encoder=torch_encoder)
    queries = bench._queries_from(corpus, 40, seed=4)
    out = bench.bench_encoder_backends(["torch", "torch-int8"], tmp_path / "flat", queries,
                                       [r["id"] for r in rows], (1, 8))
    assert out["queries"] == 40 and out["torch"]["recall_delta_vs_torch"] == 0.0
    assert out["torch"]["queries_lost_vs_torch"] == out["torch"]["queries_gained_vs_torch"] == 0
    q8 = out["torch-int8"]
    net = (q8["queries_gained_vs_torch"] - q8["queries_lost_vs_torch"]) / 40
    assert q8["recall_delta_vs_torch"] == pytest.approx(net, abs=1e-4)
    low, high = q8["recall_delta_ci95"]
    assert low <= q8["recall_delta_vs_torch"] <= high
    assert 0 < out["torch"]["recall_at_3"] <= 1
