"""Generate the knowledge world: entities, Wikipedia-style passages and FlashRAG QA sets.

    mempo world generate --out data/world --size small --seed 13

Writes (every file atomically, the folder as a whole):

    DIR/corpus.jsonl          {"id", "contents": "Title\\ntext"}  (wiki-18 / Search-R1 format)
    DIR/qa/train.jsonl        FlashRAG: {"id", "question", "golden_answers", "metadata"}
    DIR/qa/val.jsonl, DIR/qa/test.jsonl
    DIR/entities.json         the world's facts (for debugging and the scripted teacher)
    DIR/manifest.json         seed, size, counts, sha256 of every file

Questions are anchored on "subject" people. Subjects are split train/val/test (and train
into two halves, `part: sft|rl`), so no person asked about in val/test is asked about in
train. Mayors and company founders are "notable" people: they appear inside chains and as
answers but are never the subject of a question. Every question carries its supporting chain
in `metadata.chain`: one hop per retrieval, each with the entity to look up, the relation, the
value found, and the id of the passage that states it.

Same seed and size, same bytes: one `random.Random(seed)` draws the entities
(`mempo.world.entities`), then the passages (`mempo.world.passages`), then the questions
(`mempo.world.questions`), in that order.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mempo.io import atomic_dir, sha256_file, write_json, write_jsonl
from mempo.world.entities import SIZES, World, build_entities
from mempo.world.passages import write_passages
from mempo.world.questions import make_questions


def build_world(size: str = "small", seed: int = 13) -> tuple[World, dict[str, list[dict[str, Any]]]]:
    """Build the world in memory: (entities with passages, {split: FlashRAG rows})."""
    if size not in SIZES:
        raise ValueError(f"unknown world size {size!r}; choose one of {sorted(SIZES)}")
    spec = SIZES[size]
    rng = random.Random(seed)
    w = build_entities(spec, rng)
    write_passages(w, rng)
    return w, make_questions(w, spec, rng)


def generate_world(out: str | Path, size: str = "small", seed: int = 13) -> dict[str, Any]:
    """Write the world to `out` (replacing it atomically). Returns the manifest."""
    w, splits = build_world(size, seed)
    out = Path(out)
    with atomic_dir(out) as tmp:
        write_jsonl(tmp / "corpus.jsonl", w.passages)
        for split, rows in splits.items():
            write_jsonl(tmp / "qa" / f"{split}.jsonl", rows)
        entities = {
            kind: {k: asdict(v) for k, v in getattr(w, kind).items()}
            for kind in ("people", "cities", "countries", "companies", "books", "rivers")
        }
        write_json(tmp / "entities.json", entities, indent=None)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "generator": "mempo.world",
            "seed": seed,
            "size": size,
            "passages": len(w.passages),
            "questions": {s: len(r) for s, r in splits.items()},
            "types": {s: dict(sorted(Counter(r["metadata"]["type"] for r in rows).items()))
                      for s, rows in splits.items()},
            "hops": {s: dict(sorted(Counter(str(r["metadata"]["hops"]) for r in rows).items()))
                     for s, rows in splits.items()},
            "sha256": {f: sha256_file(tmp / f) for f in files},
        }
        write_json(tmp / "manifest.json", manifest)
    return manifest
