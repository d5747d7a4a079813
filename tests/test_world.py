"""The knowledge world: determinism, answerable chains, real multi-hop, leak-free splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mempo.datasets import iter_corpus, load_qa
from mempo.io import sha256_file
from mempo.world import generate_world
from mempo.world.generate import build_world


def _tree_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = generate_world(tmp_path / "a", size="tiny", seed=5)
    b = generate_world(tmp_path / "b", size="tiny", seed=5)
    assert _tree_hashes(tmp_path / "a") == _tree_hashes(tmp_path / "b")
    assert a["sha256"] == b["sha256"]
    c = generate_world(tmp_path / "c", size="tiny", seed=6)
    assert c["sha256"]["corpus.jsonl"] != a["sha256"]["corpus.jsonl"]


def test_layout_and_formats(tiny_world: Path) -> None:
    passages = list(iter_corpus(tiny_world / "corpus.jsonl"))
    assert len({p.id for p in passages}) == len(passages)
    assert all("\n" in p.contents and p.title and p.text for p in passages)
    for split in ("train", "val", "test"):
        items = load_qa(tiny_world / "qa" / f"{split}.jsonl")
        assert items and all(i.golden_answers and i.question.endswith("?") for i in items)
        assert {i.metadata["type"] for i in items} <= {"single", "bridge", "comparison"}
    manifest = json.loads((tiny_world / "manifest.json").read_text())
    assert manifest["passages"] == len(passages)


def test_every_hop_is_stated_in_its_supporting_passage(tiny_world: Path) -> None:
    docs = {p.id: p.contents for p in iter_corpus(tiny_world / "corpus.jsonl")}
    for split in ("train", "val", "test"):
        for item in load_qa(tiny_world / "qa" / f"{split}.jsonl"):
            chain = item.objectives[0].chain
            assert item.metadata["hops"] == len(chain)
            assert set(item.metadata["supporting_ids"]) == {h.doc_id for h in chain}
            for hop in chain:
                assert hop.entity in docs[hop.doc_id], (item.id, hop)
                assert hop.value in docs[hop.doc_id], (item.id, hop)
            if item.metadata["type"] != "comparison":
                assert chain[-1].value == item.golden_answers[0]
                # each hop starts from the previous hop's value
                for prev, nxt in zip(chain, chain[1:], strict=False):
                    assert nxt.entity == prev.value


def test_bridge_questions_need_every_hop(tiny_world: Path) -> None:
    docs = {p.id: p.contents for p in iter_corpus(tiny_world / "corpus.jsonl")}
    bridges = [i for s in ("train", "test") for i in load_qa(tiny_world / "qa" / f"{s}.jsonl")
               if i.metadata["type"] == "bridge"]
    assert len(bridges) > 20
    for item in bridges:
        first = docs[item.objectives[0].chain[0].doc_id]
        assert item.golden_answers[0] not in first, item.id
        # and the answer is never in the question itself
        assert item.golden_answers[0] not in item.question


def test_splits_are_entity_disjoint(tiny_world: Path) -> None:
    subjects = {}
    for split in ("train", "val", "test"):
        items = load_qa(tiny_world / "qa" / f"{split}.jsonl")
        subjects[split] = {s for i in items for s in i.metadata["subjects"]}
        if split == "train":
            parts = {}
            for i in items:
                for s in i.metadata["subjects"]:
                    parts.setdefault(i.metadata["part"], set()).add(s)
            assert set(parts) == {"sft", "rl"}
            assert not parts["sft"] & parts["rl"]
    assert not subjects["train"] & subjects["val"]
    assert not subjects["train"] & subjects["test"]
    assert not subjects["val"] & subjects["test"]


def test_names_are_unique_and_made_up() -> None:
    world, _ = build_world("tiny", seed=13)
    names = [p.name for p in world.people.values()] + [c.name for c in world.cities.values()]
    assert len(names) == len(set(names))


def test_unknown_size_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown world size"):
        build_world("huge", seed=1)
