"""Retrieval: index build, in-process and HTTP retrievers, the Search-R1-compatible service.

    from mempo.retrieval import open_retriever, format_passages
    with open_retriever("outputs/index") as r:          # or "http://127.0.0.1:8013"
        hits = r.search(["Thys Dreindreilvaix"], topk=3)[0]
        print(format_passages(hits))

Build an index with `mempo index build --corpus FILE --out DIR`; serve it with
`mempo serve retriever --index DIR`.
"""

from __future__ import annotations

from typing import Any

from mempo.retrieval.base import Hit, Retriever, format_passages
from mempo.retrieval.inprocess import InProcessRetriever

__all__ = ["Hit", "InProcessRetriever", "Retriever", "format_passages", "open_retriever"]


def open_retriever(spec: str, **kw: Any) -> Retriever:
    """A retriever from a spec string.

    - `"http://host:port"` (or https): an `HttpRetriever` on the service (kw: token,
      timeout_s, retries, ...);
    - a path ending in `.jsonl` / `.jsonl.gz`: a corpus file indexed in memory with BM25
      (kw: method="dense" to embed instead);
    - anything else: an index folder built by `mempo index build`, loaded in process
      (kw: encoder, device).
    """
    spec = str(spec)
    if spec.startswith(("http://", "https://")):
        from mempo.retrieval.http import HttpRetriever

        return HttpRetriever(spec, **kw)
    if spec.endswith((".jsonl", ".jsonl.gz")):
        return InProcessRetriever.from_corpus(spec, **kw)
    return InProcessRetriever.load(spec, **kw)
