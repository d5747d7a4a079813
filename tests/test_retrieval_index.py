"""Index build and load: BM25 and every dense index type on the tiny world, resume of an
interrupted build, encoder mismatch refused, e5 handling, bad inputs, Ray embedding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mempo.errors import ConfigError, DataError, MempoError
from mempo.retrieval import InProcessRetriever
from mempo.retrieval.dense import effective_index_params, footprint_ratio
from mempo.retrieval.index import build_index, load_index, partial_dir, read_manifest, shard_path


def _entity_queries(world: Path) -> list[tuple[str, str]]:
    """(entity name, gold doc id) for every hop of every QA chain in the tiny world."""
    pairs = set()
    for split in ("train", "val", "test"):
        for line in (world / "qa" / f"{split}.jsonl").read_text().splitlines():
            for hop in json.loads(line)["metadata"]["chain"]:
                pairs.add((hop["entity"], hop["doc_id"]))
    return sorted(pairs)


def _recall_at_3(r: InProcessRetriever, pairs: list[tuple[str, str]]) -> float:
    results = r.search([name for name, _ in pairs], topk=3)
    return sum(gold in [h.id for h in hits] for (_, gold), hits in zip(pairs, results, strict=True)) / len(pairs)


@pytest.fixture(scope="module")
def minilm():
    """One loaded MiniLM encoder shared by the module (loading it is the slow part)."""
    from mempo.retrieval.encoder import Encoder

    return Encoder("all-MiniLM-L6-v2", batch_size=32)


@pytest.fixture(scope="module")
def flat_index(tiny_world: Path, tmp_path_factory: pytest.TempPathFactory, minilm) -> Path:
    out = tmp_path_factory.mktemp("flat") / "idx"
    build_index(tiny_world / "corpus.jsonl", out, method="dense", index_type="flat",
                encoder=minilm, shard_size=64)
    return out


@pytest.fixture(scope="module")
def random_bert(tmp_path_factory: pytest.TempPathFactory) -> callable:
    """Factory: a randomly initialised 1-layer BERT folder (MiniLM's tokenizer) of a given width."""
    from transformers import BertConfig, BertModel

    from mempo.retrieval.encoder import resolve_encoder

    _, minilm = resolve_encoder("all-MiniLM-L6-v2")

    def make(name: str, hidden: int) -> Path:
        out = tmp_path_factory.mktemp("enc") / name
        import torch

        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=2 * hidden)
        BertModel(cfg).save_pretrained(out)
        for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(minilm / f, out / f)
        return out

    return make


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "ivfpq"])
def test_dense_index_types_return_gold_passage(tiny_world: Path, tmp_path: Path, index_type: str,
                                               minilm, flat_index: Path) -> None:
    out = flat_index if index_type == "flat" else tmp_path / "idx"
    if index_type != "flat":
        # Same vectors as the flat index (reused shards), another FAISS structure on top.
        m = build_index(tiny_world / "corpus.jsonl", out, method="dense", index_type=index_type,
                        index_params={"pq_m": 16, "pq_rerank": 10, "ivf_nlist": 8},
                        encoder=minilm, shard_size=64, reuse_embeddings_from=flat_index)
        assert m["resume"] == {"shards_embedded": 0, "shards_reused": 2}
    manifest = read_manifest(out)
    assert manifest["count"] == 124 and manifest["dim"] == 384 and manifest["shards"] == 2
    assert manifest["index_type"] == index_type and manifest["encoder"]["name"] == "all-MiniLM-L6-v2"
    assert not partial_dir(out).exists()
    r = load_index(out, encoder=minilm)
    assert _recall_at_3(r, _entity_queries(tiny_world)) >= 0.95
    top = r.search(["a river"], topk=5)[0]
    assert len(top) == 5 and all(a.score >= b.score for a, b in zip(top, top[1:], strict=False))


def test_bm25_index_folder_roundtrip(tiny_world: Path, tmp_path: Path) -> None:
    manifest = build_index(tiny_world / "corpus.jsonl", tmp_path / "bm25", method="bm25")
    assert manifest["method"] == "bm25" and manifest["count"] == 124
    r = load_index(tmp_path / "bm25")
    assert _recall_at_3(r, _entity_queries(tiny_world)) >= 0.95
    # Same answers as the in-memory BM25 retriever built straight from the corpus.
    mem = InProcessRetriever.from_corpus(tiny_world / "corpus.jsonl")
    assert r.search(["capital city", "river"], 3) == mem.search(["capital city", "river"], 3)
    with pytest.raises(MempoError, match="BM25"):
        load_index(tmp_path / "bm25", encoder="all-MiniLM-L6-v2")


def test_interrupted_build_resumes_from_finished_shards(tiny_world: Path, tmp_path: Path,
                                                        minilm) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join((tiny_world / "corpus.jsonl").read_text().splitlines()[:40]) + "\n")
    out = tmp_path / "idx"
    done: list[tuple[int, bool]] = []

    def crash_after_two(i: int, reused: bool) -> None:
        done.append((i, reused))
        if len(done) == 2:
            raise KeyboardInterrupt  # what Ctrl-C / a killed pod looks like to the build

    with pytest.raises(KeyboardInterrupt):
        build_index(corpus, out, method="dense", shard_size=10,
                    encoder=minilm, on_shard_done=crash_after_two)
    assert not out.exists()  # nothing half-written where readers look
    kept = sorted(p.name for p in (partial_dir(out) / "embeddings").glob("*.npy"))
    assert kept == ["emb-00000.npy", "emb-00001.npy"]
    first_two = [np.load(shard_path(partial_dir(out), i)) for i in range(2)]

    resumed: list[tuple[int, bool]] = []
    manifest = build_index(corpus, out, method="dense", shard_size=10, encoder=minilm,
                           on_shard_done=lambda i, reused: resumed.append((i, reused)))
    assert resumed == [(0, True), (1, True), (2, False), (3, False)]
    assert manifest["resume"] == {"shards_embedded": 2, "shards_reused": 2}
    assert manifest["shards"] == 4 and manifest["count"] == 40
    for i in range(2):
        np.testing.assert_array_equal(np.load(shard_path(out, i)), first_two[i])
    assert not partial_dir(out).exists()
    # The resumed index answers like the in-memory dense retriever over the same passages.
    first = json.loads(corpus.read_text().splitlines()[25])
    hit = load_index(out, encoder=minilm).search([first["contents"]], topk=1)[0][0]
    assert hit.id == first["id"] and hit.score == pytest.approx(1.0, abs=1e-2)


def test_changed_corpus_discards_stale_shards(tiny_world: Path, tmp_path: Path, minilm) -> None:
    corpus = tmp_path / "corpus.jsonl"
    lines = (tiny_world / "corpus.jsonl").read_text().splitlines()[:30]
    corpus.write_text("\n".join(lines) + "\n")
    out = tmp_path / "idx"
    with pytest.raises(KeyboardInterrupt):
        build_index(corpus, out, method="dense", shard_size=10, encoder=minilm,
                    on_shard_done=lambda i, r: (_ for _ in ()).throw(KeyboardInterrupt()))
    corpus.write_text("\n".join(lines[:20]) + "\n")  # a different corpus: old shards are stale
    seen: list[bool] = []
    manifest = build_index(corpus, out, method="dense", shard_size=10, encoder=minilm,
                           on_shard_done=lambda i, reused: seen.append(reused))
    assert seen == [False, False] and manifest["count"] == 20


def test_encoder_mismatch_is_refused(flat_index: Path, tmp_path: Path, random_bert) -> None:
    out = flat_index
    narrow = random_bert("narrow-bert", 32)
    with pytest.raises(ConfigError, match="dim"):
        load_index(out, encoder=str(narrow))
    same_dim = random_bert("other-bert", 384)
    with pytest.raises(ConfigError, match="embeds differently"):
        load_index(out, encoder=str(same_dim))
    # The same model under another path is accepted.
    from mempo.retrieval.encoder import resolve_encoder

    copy = tmp_path / "my-minilm-copy"
    shutil.copytree(resolve_encoder("all-MiniLM-L6-v2")[1], copy)
    assert load_index(out, encoder=str(copy)).search(["river"], 1)[0]


def test_e5_models_get_prefixes_and_mean_pooling(random_bert) -> None:
    from mempo.retrieval.encoder import Encoder

    enc = Encoder(str(random_bert("tiny-e5-test", 32)), batch_size=4)
    d = enc.describe()
    assert (d["query_prefix"], d["passage_prefix"], d["pooling"]) == ("query: ", "passage: ", "mean")
    q = enc.encode_queries(["hello"])
    assert q.shape == (1, 32) and np.isclose(np.linalg.norm(q[0]), 1.0, atol=1e-4)
    # The prefix changes the embedding: query and passage views of a text differ.
    assert not np.allclose(q, enc.encode_passages(["hello"]))


def test_bad_inputs_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        build_index(tmp_path / "missing.jsonl", tmp_path / "idx")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "A\\ntext"}\n{"id": "2"}\n')
    with pytest.raises(DataError) as e:
        build_index(bad, tmp_path / "idx")
    assert "bad.jsonl:2" in str(e.value) and "contents" in str(e.value)
    assert not (tmp_path / "idx").exists()
    with pytest.raises(DataError, match="manifest"):
        load_index(tmp_path)
    with pytest.raises(ConfigError, match="local model folder"):
        build_index(tmp_path / "bad.jsonl", tmp_path / "idx", method="dense", encoder="no/such-model")
    with pytest.raises(ConfigError, match="must divide"):
        effective_index_params("ivfpq", 10_000, 384, {"pq_m": 7})


def test_footprint_ratio_is_analytical() -> None:
    flat = footprint_ratio("flat", {})
    assert flat == pytest.approx(1.0)
    ivfpq = {"ivf_nlist": 4096, "ivf_nprobe": 64, "pq_m": 64, "pq_nbits": 8}
    # 3072 bytes of float32 per 768-d vector vs 64 code bytes + 8 id bytes.
    assert footprint_ratio("ivfpq", ivfpq) == pytest.approx(3072 / 72, rel=0.01)
    hnsw = effective_index_params("hnsw", 1000, 768, {"hnsw_m": 32})
    assert footprint_ratio("hnsw", hnsw) < 1.0  # HNSW trades memory for speed


def test_cli_index_build(tiny_world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mempo.cli import main

    out = tmp_path / "cli-idx"
    rc = main(["--params", str(tmp_path / "none.yaml"), "index", "build",
               "--corpus", str(tiny_world / "corpus.jsonl"), "--out", str(out), "--method", "bm25"])
    assert rc == 0 and read_manifest(out)["count"] == 124
    assert json.loads(capsys.readouterr().out.splitlines()[0])["method"] == "bm25"
    rc = main(["--params", str(tmp_path / "none.yaml"), "index", "build",
               "--corpus", str(tmp_path / "nope.jsonl"), "--out", str(out)])
    assert rc != 0


@pytest.mark.slow
def test_ray_embedding_matches_local(tiny_world: Path, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from mempo.retrieval.encoder import Encoder
    from mempo.retrieval.ray_embed import embed_with_ray, ensure_ray

    lines = (tiny_world / "corpus.jsonl").read_text().splitlines()[:24]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    texts = [json.loads(line)["contents"] for line in lines]
    ensure_ray(num_cpus=2)
    try:
        # batch_size 8 over 24 passages: 3 batches that must come back in corpus order.
        m = build_index(corpus, tmp_path / "ray-idx", method="dense", use_ray=True,
                        batch_size=8, shard_size=100)
        assert m["count"] == 24
        vecs = np.load(shard_path(tmp_path / "ray-idx", 0)).astype(np.float32)
        local = Encoder("all-MiniLM-L6-v2").encode_passages(texts)
        np.testing.assert_allclose(vecs, local, atol=2e-3)
        assert embed_with_ray(texts[:3], encoder="all-MiniLM-L6-v2").shape == (3, 384)
    finally:
        ray.shutdown()
