"""Shared fixtures. Heavy artifacts (the tiny world, indexes, policies) are built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` knowledge world (seed 13), generated once per test session. Read-only."""
    from mempo.world import generate_world

    out = tmp_path_factory.mktemp("world") / "world"
    generate_world(out, size="tiny", seed=13)
    return out


@pytest.fixture(scope="session")
def rollout_world(tiny_world: Path) -> tuple:
    """(BPE tokenizer with the agent's tags, BM25 retriever, train questions) of the tiny world,
    for rollout tests. Read-only."""
    from mempo.agent.format import SYSTEM_PROMPT, TAGS
    from mempo.datasets import iter_corpus, load_qa
    from mempo.policy.tiny import train_tiny_tokenizer
    from mempo.retrieval.inprocess import InProcessRetriever

    texts = [SYSTEM_PROMPT] * 20 + [p.contents for p in iter_corpus(tiny_world / "corpus.jsonl")]
    tok = train_tiny_tokenizer(iter(texts), TAGS, vocab_size=800)
    retriever = InProcessRetriever.from_corpus(tiny_world / "corpus.jsonl", method="bm25")
    return tok, retriever, load_qa(tiny_world / "qa" / "train.jsonl")


@pytest.fixture()
def mlflow_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh sqlite MLflow store per test (never the project's own mlflow.db)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ARTIFACTS_DESTINATION", str(tmp_path / "mlartifacts"))
    return uri
