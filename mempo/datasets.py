"""Loaders for the two public formats every stage reads.

- Corpus (wiki-18 / Search-R1): `.jsonl` or `.jsonl.gz`, one `{"id": str, "contents":
  "Title\\ntext"}` a line. Streamed: wiki-18 has 21M lines and is never loaded whole.
- QA sets (FlashRAG): `.jsonl`, one `{"id", "question", "golden_answers": [str, ...],
  "metadata": {...}}` a line, read into `mempo.tasks.Task`s.

A malformed line raises `DataError` naming the file, line and field; `skip_bad=True` skips
and counts such lines instead (see `ReadStats`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mempo.errors import DataError
from mempo.io import ReadStats, iter_jsonl
from mempo.tasks import Task, task_from_parts


def title_of(contents: str) -> str:
    """The title line of wiki-18 `contents` ("Title\\ntext"; wiki-18 quotes some titles)."""
    return contents.split("\n", 1)[0].strip().strip('"')


def text_of(contents: str) -> str:
    """The passage text of wiki-18 `contents`, without the title line."""
    parts = contents.split("\n", 1)
    return parts[1].strip() if len(parts) > 1 else ""


class WikiContents:
    """`title` and `text` of a `contents` field in wiki-18's "Title\\ntext" form (for
    `Passage` and the retriever's `Hit`)."""

    contents: str

    @property
    def title(self) -> str:
        return title_of(self.contents)

    @property
    def text(self) -> str:
        return text_of(self.contents)


@dataclass(frozen=True)
class Passage(WikiContents):
    """One retrieval unit: `contents` is "Title\\ntext" as in wiki-18."""

    id: str
    contents: str

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


def _id_field(obj: dict[str, Any], path: Path, lineno: int) -> str:
    if "id" not in obj:
        raise DataError("missing required field", path=path, row=lineno, field="id")
    value = obj["id"]
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise DataError(
            f"must be a string or integer, got {type(value).__name__}",
            path=path, row=lineno, field="id",
        )
    if str(value).strip() == "":
        raise DataError("must not be empty", path=path, row=lineno, field="id")
    return str(value)


def passage_from_obj(obj: dict[str, Any], path: Path, lineno: int) -> Passage:
    """Validate one corpus object; raises `DataError` naming file, line and field."""
    pid = _id_field(obj, path, lineno)
    if "contents" not in obj:
        raise DataError("missing required field", path=path, row=lineno, field="contents")
    contents = obj["contents"]
    if not isinstance(contents, str):
        raise DataError(
            f"must be a string, got {type(contents).__name__}",
            path=path, row=lineno, field="contents",
        )
    if not contents.strip():
        raise DataError("must not be empty", path=path, row=lineno, field="contents")
    return Passage(pid, contents)


def qa_from_obj(obj: dict[str, Any], path: Path, lineno: int) -> Task:
    """Validate one FlashRAG QA object into a `Task` (its objectives and hop chains parsed
    here, once); raises `DataError` naming file, line and field."""
    qid = _id_field(obj, path, lineno)
    q = obj.get("question")
    if q is None:
        raise DataError("missing required field", path=path, row=lineno, field="question")
    if not isinstance(q, str):
        raise DataError(f"must be a string, got {type(q).__name__}", path=path, row=lineno, field="question")
    if not q.strip():
        raise DataError("must not be empty", path=path, row=lineno, field="question")
    answers = obj.get("golden_answers")
    if answers is None:
        raise DataError("missing required field", path=path, row=lineno, field="golden_answers")
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list):
        raise DataError(
            f"must be a list of strings, got {type(answers).__name__}",
            path=path, row=lineno, field="golden_answers",
        )
    if not answers:
        raise DataError("must not be an empty list", path=path, row=lineno, field="golden_answers")
    clean: list[str] = []
    for i, a in enumerate(answers):
        if isinstance(a, bool) or not isinstance(a, str | int | float):
            raise DataError(
                f"item {i} must be a string, got {type(a).__name__}",
                path=path, row=lineno, field="golden_answers",
            )
        if isinstance(a, float) and a != a:  # NaN
            raise DataError(f"item {i} is NaN", path=path, row=lineno, field="golden_answers")
        if not str(a).strip():
            raise DataError(f"item {i} is empty", path=path, row=lineno, field="golden_answers")
        clean.append(str(a))
    meta = obj.get("metadata") or {}
    if not isinstance(meta, dict):
        raise DataError(
            f"must be an object, got {type(meta).__name__}", path=path, row=lineno, field="metadata"
        )
    return task_from_parts(qid, q, clean, meta, path, lineno)


def _validated(
    path: str | Path, make: Any, skip_bad: bool, stats: ReadStats | None
) -> Iterator[Any]:
    path = Path(path)
    stats = stats if stats is not None else ReadStats(str(path))
    for lineno, obj in iter_jsonl(path, skip_bad=skip_bad, stats=stats):
        try:
            yield make(obj, path, lineno)
        except DataError as e:
            if not skip_bad:
                raise
            stats.rows -= 1
            stats.skipped.append((lineno, e.one_line()))


def iter_corpus(
    path: str | Path, *, skip_bad: bool = False, stats: ReadStats | None = None
) -> Iterator[Passage]:
    """Stream passages from a wiki-18-format corpus (`.jsonl` or `.jsonl.gz`)."""
    return _validated(path, passage_from_obj, skip_bad, stats)


def load_qa(
    path: str | Path, *, skip_bad: bool = False, stats: ReadStats | None = None
) -> list[Task]:
    """Load a FlashRAG-format QA file as `Task`s. An empty file is an error (nothing to train or test on)."""
    items = list(_validated(path, qa_from_obj, skip_bad, stats))
    if not items:
        raise DataError("no questions in file (empty or every line skipped)", path=path)
    return items
