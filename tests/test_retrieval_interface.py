"""The retriever interface: Hit, format_passages, in-process BM25 from a corpus file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from mempo.datasets import Passage
from mempo.errors import MempoError
from mempo.retrieval import Hit, InProcessRetriever, format_passages, open_retriever


def test_format_passages_matches_search_r1_layout() -> None:
    hits = [Hit("1", "Paris\nParis is the capital.", 0.9), Hit("2", '"Rome"\nRome is old.', 0.5)]
    assert format_passages(hits) == (
        "Doc 1(Title: Paris) Paris is the capital.\nDoc 2(Title: Rome) Rome is old."
    )
    assert format_passages([Passage("3", "Solo")]) == "Doc 1(Title: Solo) "
    assert hits[0].to_dict() == {"document": {"id": "1", "contents": "Paris\nParis is the capital."},
                                 "score": 0.9}
    assert hits[0].to_dict(with_score=False) == {"id": "1", "contents": "Paris\nParis is the capital."}


def _gold_single_hop(world: Path) -> list[tuple[str, str]]:
    """(entity name, gold doc id) for the first hop of each training question."""
    pairs = []
    for line in (world / "qa" / "train.jsonl").read_text().splitlines():
        hop = json.loads(line)["metadata"]["chain"][0]
        pairs.append((hop["entity"], hop["doc_id"]))
    return sorted(set(pairs))


def test_bm25_from_corpus_finds_gold_passage_by_entity_name(tiny_world: Path) -> None:
    r = open_retriever(str(tiny_world / "corpus.jsonl"))
    assert isinstance(r, InProcessRetriever)
    pairs = _gold_single_hop(tiny_world)
    results = r.search([name for name, _ in pairs], topk=3)
    found = sum(gold in [h.id for h in hits] for (_, gold), hits in zip(pairs, results, strict=True))
    assert len(results) == len(pairs) and all(len(h) == 3 for h in results)
    assert found / len(pairs) >= 0.95
    # Scores come best first.
    assert all(h[0].score >= h[-1].score for h in results)


def test_access_returns_whole_article_and_empty_for_unknown(tiny_world: Path) -> None:
    r = InProcessRetriever.from_corpus(tiny_world / "corpus.jsonl")
    first = r.search(["capital"], topk=1)[0][0]
    by_id, unknown = r.access(ids=[first.id, "no-such-id"])
    assert first.id in [p.id for p in by_id] and all(p.title == first.title for p in by_id)
    assert unknown == []
    assert r.access(titles=[first.title.upper()])[0] == by_id
    with pytest.raises(MempoError):
        r.access(ids=["1"], titles=["x"])


def test_async_methods_match_sync(tiny_world: Path) -> None:
    r = InProcessRetriever.from_corpus(tiny_world / "corpus.jsonl")
    sync = r.search(["river", "company"], topk=2)
    assert asyncio.run(r.asearch(["river", "company"], topk=2)) == sync
    assert asyncio.run(r.aaccess(ids=[sync[0][0].id])) == r.access(ids=[sync[0][0].id])
