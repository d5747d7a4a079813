"""`mempo corpus wiki-sample`: real Wikipedia summaries -> wiki-18 corpus, searchable."""

from __future__ import annotations

import json
from pathlib import Path

from mempo.cli import main
from mempo.datasets import iter_corpus
from mempo.retrieval import InProcessRetriever
from mempo.retrieval.wiki_sample import split_words


def test_split_words() -> None:
    assert split_words("a b c d e", 2) == ["a b", "c d", "e"]
    assert split_words("a b c", 0) == ["a b c"]
    assert split_words("   ", 5) == []


def test_wiki_sample_cli_writes_wiki18_corpus(tmp_path: Path) -> None:
    out = tmp_path / "wiki.jsonl"
    rc = main(["--params", str(tmp_path / "none.yaml"), "corpus", "wiki-sample", "--out", str(out),
               "--limit", "120", "--words-per-passage", "60"])
    assert rc == 0
    passages = list(iter_corpus(out))  # the project's own corpus loader accepts it
    titles = [p.title for p in passages]
    assert len(set(titles)) == 120 and len(passages) > 120  # long leads span several passages
    assert [p.id for p in passages] == [str(i) for i in range(len(passages))]
    assert all(p.contents.startswith('"') and len(p.text.split()) <= 60 for p in passages)
    manifest = json.loads(out.with_name(out.name + ".manifest.json").read_text())
    assert manifest["passages"] == len(passages) and "CC BY-SA" in manifest["license"]

    r = InProcessRetriever.from_corpus(out)
    multi = next(t for t in titles if titles.count(t) > 1)
    first = passages[titles.index(multi)]
    article = r.access(ids=[first.id])[0]
    assert [p.title for p in article] == [multi] * titles.count(multi)
    assert " ".join(p.text for p in article).startswith(first.text)
    hit = r.search([first.text[:80]], topk=1)[0][0]
    assert hit.title == multi
