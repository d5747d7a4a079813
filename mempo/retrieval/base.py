"""The retriever interface every consumer (agent, trainers, eval) codes against.

Two implementations share it: `InProcessRetriever` (an index folder or a corpus loaded in
this process; tests and the local trainer) and `HttpRetriever` (the `mempo serve retriever`
service, Search-R1's `/retrieve` contract). Get one with `mempo.retrieval.open_retriever`.

    from mempo.retrieval import open_retriever, format_passages
    r = open_retriever("outputs/index")            # or "http://127.0.0.1:8013"
    hits = r.search(["Thys Dreindreilvaix"], topk=3)[0]
    print(format_passages(hits))                  # Doc 1(Title: ...) ...
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mempo.datasets import Passage, WikiContents


@dataclass(frozen=True)
class Hit(WikiContents):
    """One search result: a passage (`contents` = "Title\\ntext") and its score.

    Scores are method-specific: inner product of normalised embeddings (cosine, in [-1, 1])
    for dense indexes, BM25 score (>= 0, unbounded) for BM25. Higher is better for both.
    """

    id: str
    contents: str
    score: float

    def passage(self) -> Passage:
        return Passage(self.id, self.contents)

    def to_dict(self, with_score: bool = True) -> dict[str, Any]:
        """Search-R1's item layout: `{"document": {id, contents}, "score"}` or `{id, contents}`."""
        doc = {"id": self.id, "contents": self.contents}
        return {"document": doc, "score": self.score} if with_score else doc


def format_passages(hits: Sequence[Hit | Passage]) -> str:
    """Format passages the way Search-R1 shows them to the model.

    Example: `[Hit("7", "Paris\\nParis is ...", 0.9)]` -> `"Doc 1(Title: Paris) Paris is ..."`;
    several hits are joined by newlines. This is the one formatting function; the agent's
    `<information>` block reuses it.
    """
    lines = []
    for i, h in enumerate(hits, start=1):
        lines.append(f"Doc {i}(Title: {h.title}) {h.text}")
    return "\n".join(lines)


class Retriever(abc.ABC):
    """Batched search over a passage corpus, plus whole-article access.

    Implementations must be safe to call from several threads. Use as a context manager or
    call `close()` to release sockets / memory.
    """

    @abc.abstractmethod
    def search(self, queries: list[str], topk: int = 3) -> list[list[Hit]]:
        """Top-`topk` hits for each query, best first. Returns one list per query."""

    @abc.abstractmethod
    def access(
        self, ids: list[str] | None = None, titles: list[str] | None = None
    ) -> list[list[Passage]]:
        """The whole article each id (or title) belongs to: all passages with that title,
        in corpus order. Unknown ids/titles give an empty list for that item. Give exactly
        one of `ids` / `titles`."""

    async def asearch(self, queries: list[str], topk: int = 3) -> list[list[Hit]]:
        """Async `search`; the default runs the sync call in a worker thread."""
        return await asyncio.to_thread(self.search, queries, topk)

    async def aaccess(
        self, ids: list[str] | None = None, titles: list[str] | None = None
    ) -> list[list[Passage]]:
        """Async `access`; the default runs the sync call in a worker thread."""
        return await asyncio.to_thread(self.access, ids, titles)

    def close(self) -> None:  # noqa: B027 - optional hook, most retrievers hold nothing
        """Release resources (HTTP connections, index memory)."""

    def __enter__(self) -> Retriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
