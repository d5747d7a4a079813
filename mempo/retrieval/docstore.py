"""Passage storage behind a retriever: row -> passage, id -> row, title -> article rows.

An index folder keeps the corpus it was built from as `docs.jsonl` plus `doc_offsets.npy`
(byte offset of each line, int64, shape (n + 1,)), so a passage is one `pread` away and the
texts are never all held in memory (wiki-18 is 21M passages, ~14 GB of text). Ids and titles
(`doc_keys.json`) are loaded into dicts for exact lookups.

    store = DocStore.from_passages(iter_corpus("corpus.jsonl"))   # in memory
    store.save("outputs/index")                                   # docs.jsonl + offsets + keys
    store = DocStore.load("outputs/index")                        # file-backed
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from mempo.datasets import Passage
from mempo.errors import DataError
from mempo.io import atomic_path, write_json

DOCS_FILE = "docs.jsonl"
OFFSETS_FILE = "doc_offsets.npy"
KEYS_FILE = "doc_keys.json"


def _title_of(contents: str) -> str:
    return contents.split("\n", 1)[0].strip().strip('"')


class DocStore:
    """Passages in corpus order with id and title lookups. Thread-safe for reads."""

    def __init__(
        self,
        ids: list[str],
        titles: list[str],
        *,
        contents: list[str] | None = None,
        docs_path: Path | None = None,
        offsets: np.ndarray | None = None,
    ) -> None:
        if contents is None and (docs_path is None or offsets is None):
            raise ValueError("DocStore needs either contents or docs_path + offsets")
        self.ids = ids
        self.titles = titles
        self._contents = contents
        self._docs_path = docs_path
        self._offsets = offsets
        self._fd: int | None = None
        self._lock = threading.Lock()
        self.row_of_id: dict[str, int] = {}
        for row, pid in enumerate(ids):
            # First occurrence wins: duplicated ids are a corpus bug the corpus stage reports.
            self.row_of_id.setdefault(pid, row)
        self.rows_of_title: dict[str, list[int]] = {}
        self._rows_of_folded: dict[str, list[int]] = {}
        for row, t in enumerate(titles):
            self.rows_of_title.setdefault(t, []).append(row)
            self._rows_of_folded.setdefault(t.casefold(), []).append(row)

    def __len__(self) -> int:
        return len(self.ids)

    # ------------------------------------------------------------------ build / io

    @classmethod
    def from_passages(cls, passages: Iterable[Passage]) -> DocStore:
        """Hold `passages` in memory (tests, small corpora, `from_corpus`)."""
        ids, titles, contents = [], [], []
        for p in passages:
            ids.append(p.id)
            titles.append(p.title)
            contents.append(p.contents)
        if not ids:
            raise DataError("corpus has no passages")
        return cls(ids, titles, contents=contents)

    def save(self, folder: str | Path) -> None:
        """Write docs.jsonl, doc_offsets.npy and doc_keys.json into `folder`."""
        DocStore.write((self.passage(r) for r in range(len(self))), folder)

    @staticmethod
    def write(passages: Iterable[Passage], folder: str | Path) -> int:
        """Stream `passages` into `folder` (docs.jsonl, offsets, keys) without holding their
        texts in memory. Returns the passage count."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        ids: list[str] = []
        titles: list[str] = []
        offsets = [0]
        with atomic_path(folder / DOCS_FILE) as tmp, open(tmp, "wb") as fh:
            for p in passages:
                line = (json.dumps(p.to_dict(), ensure_ascii=False) + "\n").encode("utf-8")
                fh.write(line)
                offsets.append(offsets[-1] + len(line))
                ids.append(p.id)
                titles.append(p.title)
        if not ids:
            raise DataError("corpus has no passages")
        with atomic_path(folder / OFFSETS_FILE) as tmp, open(tmp, "wb") as fh:
            np.save(fh, np.asarray(offsets, dtype=np.int64))
        write_json(folder / KEYS_FILE, {"ids": ids, "titles": titles}, indent=None)
        return len(ids)

    @classmethod
    def load(cls, folder: str | Path) -> DocStore:
        """Open a saved store; passage texts stay on disk."""
        folder = Path(folder)
        for name in (DOCS_FILE, OFFSETS_FILE, KEYS_FILE):
            if not (folder / name).exists():
                raise DataError(f"index folder is missing {name} (rebuild the index)", path=folder)
        keys = json.loads((folder / KEYS_FILE).read_text(encoding="utf-8"))
        offsets = np.load(folder / OFFSETS_FILE)
        if len(offsets) != len(keys["ids"]) + 1:
            raise DataError("doc_offsets.npy does not match doc_keys.json (rebuild the index)",
                            path=folder)
        return cls(keys["ids"], keys["titles"], docs_path=folder / DOCS_FILE, offsets=offsets)

    # ------------------------------------------------------------------ reads

    def contents(self, row: int) -> str:
        """The "Title\\ntext" of passage `row` (0-based corpus order)."""
        if self._contents is not None:
            return self._contents[row]
        assert self._offsets is not None and self._docs_path is not None
        if self._fd is None:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(self._docs_path, os.O_RDONLY)
        start, end = int(self._offsets[row]), int(self._offsets[row + 1])
        raw = os.pread(self._fd, end - start, start)  # pread: no shared file position, thread-safe
        return json.loads(raw)["contents"]

    def passage(self, row: int) -> Passage:
        return Passage(self.ids[row], self.contents(row))

    def passages(self, rows: Sequence[int]) -> list[Passage]:
        return [self.passage(int(r)) for r in rows]

    def article_by_id(self, pid: str) -> list[Passage]:
        """All passages sharing the title of passage `pid`, in corpus order ([] if unknown)."""
        row = self.row_of_id.get(str(pid))
        if row is None:
            return []
        return self.passages(self.rows_of_title[self.titles[row]])

    def article_by_title(self, title: str) -> list[Passage]:
        """All passages titled `title` (exact, else case-insensitive), in corpus order."""
        t = _title_of(title)
        rows = self.rows_of_title.get(t) or self._rows_of_folded.get(t.casefold()) or []
        return self.passages(rows)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
