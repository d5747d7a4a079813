"""Turn data files into small diagnostic DataFrames that the contracts check.

Every contract reads its file tolerantly: a bad line does not stop the read, it becomes a
row whose `parse_error` says what is wrong, so one validation run reports every bad row
(with its 1-based `line`) instead of only the first. Each raw record becomes one row of
typed diagnostic columns (lengths, flags, counts); a column is null where it does not
apply (a line that is not JSON has no `question_chars`), so each problem is reported once.

Corpora are streamed in chunks of `chunk_rows` rows; the only thing kept across chunks is a
`KeyIndex` of 8-byte id hashes (about 16 bytes per row, ~340 MB for wiki-18's 21M passages)
so uniqueness is checked over the whole file, not per chunk.

    for frame in corpus_frames("data/world/corpus.jsonl", bounds, chunk_rows=100_000, keys=k):
        ...   # one DataFrame per chunk

One module (about 400 lines) on purpose: every contract's row builder shares the tolerant
reader, the diagnostic-column rules and the key index, and they change together when a
file format does; split by file kind, each part would re-import all three.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mempo.config import ValidateBounds
from mempo.io import ReadStats, iter_jsonl

ROLES = ("system", "user", "assistant")
# verl's RL dataset reads these columns; `agent_name` picks MemPO's agent loop.
PREPARED_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info", "agent_name")


def key_hash(key: str) -> int:
    """A stable 64-bit hash of an id (blake2b), for whole-file uniqueness at 8 bytes a row."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass
class KeyIndex:
    """Line numbers and id hashes collected while chunks stream past (whole-file checks)."""

    lines: list[np.ndarray] = field(default_factory=list)
    hashes: list[np.ndarray] = field(default_factory=list)

    def add(self, lines: Sequence[int], keys: Sequence[str | None]) -> None:
        pairs = [(ln, key_hash(k)) for ln, k in zip(lines, keys, strict=True) if k is not None]
        if pairs:
            self.lines.append(np.fromiter((p[0] for p in pairs), dtype=np.int64, count=len(pairs)))
            self.hashes.append(np.fromiter((p[1] for p in pairs), dtype=np.uint64, count=len(pairs)))

    def frame(self, rows_read: int) -> pd.DataFrame:
        """`line`, `key_hash` for every row with an id, plus the file's `rows_read` in attrs."""
        df = pd.DataFrame({
            "line": np.concatenate(self.lines) if self.lines else np.zeros(0, dtype=np.int64),
            "key_hash": np.concatenate(self.hashes) if self.hashes else np.zeros(0, dtype=np.uint64),
        })
        df.attrs["rows_read"] = rows_read
        return df


def _tolerant_rows(
    path: Path, max_line_bytes: int
) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """`(line, object, error)` for every non-blank line, bad ones included (object None)."""
    stats = ReadStats(str(path))
    seen_bad = 0
    for lineno, obj in iter_jsonl(path, skip_bad=True, stats=stats, max_line_bytes=max_line_bytes):
        while seen_bad < len(stats.skipped):
            bad_line, why = stats.skipped[seen_bad]
            seen_bad += 1
            yield bad_line, None, why
        yield lineno, obj, None
    for bad_line, why in stats.skipped[seen_bad:]:
        yield bad_line, None, why


def _chunks(rows: Iterator[dict[str, Any]], chunk_rows: int, columns: dict[str, str]) -> Iterator[pd.DataFrame]:
    """Group row dicts into typed DataFrames; an empty input still yields one empty frame."""
    buf: list[dict[str, Any]] = []
    emitted = False
    for row in rows:
        buf.append(row)
        if len(buf) >= chunk_rows:
            yield _typed_frame(buf, columns)
            emitted = True
            buf = []
    if buf or not emitted:
        yield _typed_frame(buf, columns)


def _typed_frame(rows: list[dict[str, Any]], columns: dict[str, str]) -> pd.DataFrame:
    data = {name: pd.array([r.get(name) for r in rows], dtype=dtype) for name, dtype in columns.items()}
    return pd.DataFrame(data)


def _id_of(obj: dict[str, Any]) -> tuple[str | None, bool]:
    """The id as text and whether it is valid (a non-empty string or integer, not bool/NaN)."""
    if "id" not in obj:
        return None, False
    v = obj["id"]
    if isinstance(v, bool) or not isinstance(v, str | int):
        return (None if v is None else str(v)[:80]), False
    text = str(v)
    return text, bool(text.strip())


def _is_text(v: Any) -> bool:
    return isinstance(v, str) and bool(v.strip())


def _answer_ok(a: Any) -> bool:
    if isinstance(a, bool) or not isinstance(a, str | int | float):
        return False
    if isinstance(a, float) and not math.isfinite(a):
        return False
    return bool(str(a).strip())


# ------------------------------------------------------------------------------- QA sets

QA_COLUMNS = {
    "line": "Int64", "parse_error": "string", "id": "string", "id_ok": "boolean",
    "question_chars": "Int64", "answers_ok": "boolean", "n_answers": "Int64",
    "max_answer_chars": "Int64", "metadata_ok": "boolean",
}


def qa_row(line: int, obj: dict[str, Any] | None, error: str | None) -> dict[str, Any]:
    """Diagnostic columns of one FlashRAG QA line (see `QA_COLUMNS`)."""
    if obj is None:
        return {"line": line, "parse_error": error}
    qid, id_ok = _id_of(obj)
    q = obj.get("question")
    answers = obj.get("golden_answers")
    if isinstance(answers, str):  # the loader accepts a bare string as one answer
        answers = [answers]
    if isinstance(answers, list):
        n_answers = len(answers)
        answers_ok = n_answers > 0 and all(_answer_ok(a) for a in answers)
        max_chars = max((len(str(a)) for a in answers), default=0)
    else:
        n_answers, answers_ok, max_chars = -1, False, 0
    meta = obj.get("metadata")
    return {
        "line": line, "parse_error": None, "id": qid, "id_ok": id_ok,
        # -1: missing or not a string (NaN, a number, a list): fails the length check.
        "question_chars": len(q.strip()) if isinstance(q, str) else -1,
        "answers_ok": answers_ok, "n_answers": n_answers, "max_answer_chars": max_chars,
        "metadata_ok": meta is None or isinstance(meta, dict),
    }


def qa_frames(
    path: str | Path, bounds: ValidateBounds, chunk_rows: int, keys: KeyIndex
) -> Iterator[pd.DataFrame]:
    """Stream a FlashRAG QA file as diagnostic frames; ids go into `keys`."""
    def rows() -> Iterator[dict[str, Any]]:
        for line, obj, err in _tolerant_rows(Path(path), bounds.max_line_bytes):
            yield qa_row(line, obj, err)

    for df in _chunks(rows(), chunk_rows, QA_COLUMNS):
        ok = df["id_ok"].fillna(False).astype(bool)
        keys.add(df["line"][ok].tolist(), df["id"][ok].tolist())
        yield df


# ------------------------------------------------------------------------------- corpus

CORPUS_COLUMNS = {
    "line": "Int64", "parse_error": "string", "id": "string", "id_ok": "boolean",
    "contents_chars": "Int64", "title_ok": "boolean",
}


def corpus_row(line: int, obj: dict[str, Any] | None, error: str | None) -> dict[str, Any]:
    """Diagnostic columns of one wiki-18 corpus line (see `CORPUS_COLUMNS`)."""
    if obj is None:
        return {"line": line, "parse_error": error}
    pid, id_ok = _id_of(obj)
    contents = obj.get("contents")
    if isinstance(contents, str):
        title, _, body = contents.partition("\n")
        # "Title\ntext": a non-empty first line and some text after it.
        title_ok = bool(title.strip().strip('"')) and bool(body.strip())
        n_chars = len(contents.strip())
    else:
        title_ok, n_chars = False, -1
    return {"line": line, "parse_error": None, "id": pid, "id_ok": id_ok,
            "contents_chars": n_chars, "title_ok": title_ok}


def corpus_frames(
    path: str | Path, bounds: ValidateBounds, chunk_rows: int, keys: KeyIndex
) -> Iterator[pd.DataFrame]:
    """Stream a corpus (`.jsonl` / `.jsonl.gz`) as diagnostic frames; ids go into `keys`."""
    def rows() -> Iterator[dict[str, Any]]:
        for line, obj, err in _tolerant_rows(Path(path), bounds.max_line_bytes):
            yield corpus_row(line, obj, err)

    for df in _chunks(rows(), chunk_rows, CORPUS_COLUMNS):
        ok = df["id_ok"].fillna(False).astype(bool)
        keys.add(df["line"][ok].tolist(), df["id"][ok].tolist())
        yield df


# ------------------------------------------------------------------------------- prepared

PREPARED_ROW_COLUMNS = {
    "line": "Int64", "id": "string", "data_source": "string", "ability": "string",
    "agent_name": "string", "split": "string", "prompt_ok": "boolean", "prompt_chars": "Int64",
    "question_in_prompt": "boolean", "prompt_is_first_turn": "boolean",
    "reward_style": "string", "targets_ok": "boolean",
    "extra_info_ok": "boolean", "k": "Int64", "objectives_ok": "boolean", "eval_overlap": "Int64",
}


def _prompt_check(prompt: Any) -> tuple[bool, int, str]:
    """(well formed, total characters, text of the last user message)."""
    if not isinstance(prompt, list | tuple | np.ndarray) or len(prompt) == 0:
        return False, -1, ""
    n_chars, last_user, ok = 0, "", True
    for m in prompt:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return False, -1, ""
        n_chars += len(m["content"])
        if m["role"] == "user":
            last_user = m["content"]
    ok = prompt[-1].get("role") == "user" and bool(last_user.strip())
    return ok, n_chars, last_user


def _messages(prompt: Any) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _first_turn(question: str) -> list[dict[str, str]]:
    """The first-turn messages the core prompt module builds today for `question`."""
    from mempo.agent.format import build_messages

    return build_messages(question)


def _chain_ok(chain: Any) -> bool:
    """An objective's hop chain: absent (null), or hops with entity, relation and value text."""
    if chain is None:
        return True
    return isinstance(chain, list | tuple | np.ndarray) and len(chain) > 0 and all(
        isinstance(h, dict) and all(_is_text(h.get(key)) for key in ("entity", "relation", "value"))
        for h in chain)


def prepared_row(
    line: int, rec: dict[str, Any], normalize: Callable[[str], str] | None, eval_norms: set[str]
) -> dict[str, Any]:
    """Diagnostic columns of one prepared (verl-schema) row (see `PREPARED_ROW_COLUMNS`)."""
    prompt_ok, prompt_chars, user_text = _prompt_check(rec.get("prompt"))
    rm = rec.get("reward_model")
    style, targets_ok = None, False
    if isinstance(rm, dict):
        style = rm.get("style") if isinstance(rm.get("style"), str) else None
        gt = rm.get("ground_truth")
        targets = gt.get("target") if isinstance(gt, dict) else None
        targets_ok = isinstance(targets, list | tuple | np.ndarray) and len(targets) > 0 and all(
            _answer_ok(t) and isinstance(t, str) for t in targets)
    ei = rec.get("extra_info")
    ei = ei if isinstance(ei, dict) else {}
    question = ei.get("question")
    objectives = ei.get("objectives")
    k = ei.get("k")
    extra_ok = (isinstance(ei.get("index"), int) and not isinstance(ei.get("index"), bool)
                and _is_text(question) and _is_text(ei.get("id")) and isinstance(k, int))
    objectives_ok = (
        isinstance(objectives, list | tuple | np.ndarray) and len(objectives) > 0
        and isinstance(k, int) and len(objectives) == k
        and all(isinstance(o, dict) and _is_text(o.get("question"))
                and isinstance(o.get("golden_answers"), list | tuple | np.ndarray)
                and len(o["golden_answers"]) > 0
                and all(_answer_ok(a) for a in o["golden_answers"]) and _chain_ok(o.get("chain"))
                for o in objectives)
    )
    overlap = None
    if normalize is not None and objectives_ok:
        overlap = sum(normalize(str(o["question"])) in eval_norms for o in objectives)
    return {
        "line": line, "id": ei.get("id") if isinstance(ei.get("id"), str) else None,
        "data_source": rec.get("data_source") if isinstance(rec.get("data_source"), str) else None,
        "ability": rec.get("ability") if isinstance(rec.get("ability"), str) else None,
        "agent_name": rec.get("agent_name") if isinstance(rec.get("agent_name"), str) else None,
        "split": ei.get("split") if isinstance(ei.get("split"), str) else None,
        "prompt_ok": prompt_ok, "prompt_chars": prompt_chars,
        "question_in_prompt": _is_text(question) and str(question).strip() in user_text,
        "prompt_is_first_turn": prompt_ok and _is_text(question)
        and _messages(rec.get("prompt")) == _first_turn(str(question)),
        "reward_style": style, "targets_ok": targets_ok, "extra_info_ok": extra_ok,
        "k": k if isinstance(k, int) and not isinstance(k, bool) else None,
        "objectives_ok": objectives_ok, "eval_overlap": overlap,
    }


def prepared_schema_frame(path: str | Path) -> pd.DataFrame:
    """One row per column verl needs: `column`, `present`, `arrow_type`."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    names = set(schema.names)
    return pd.DataFrame({
        "column": pd.array(list(PREPARED_COLUMNS), dtype="string"),
        "present": pd.array([c in names for c in PREPARED_COLUMNS], dtype="boolean"),
        "arrow_type": pd.array([str(schema.field(c).type) if c in names else None
                                for c in PREPARED_COLUMNS], dtype="string"),
    })


def prepared_frames(
    path: str | Path,
    chunk_rows: int,
    keys: KeyIndex,
    normalize: Callable[[str], str] | None = None,
    eval_norms: set[str] | None = None,
) -> Iterator[pd.DataFrame]:
    """Stream a prepared parquet file (by row groups) as diagnostic frames.

    `eval_overlap` counts a row's objectives whose normalised question is in `eval_norms`
    (null when no normaliser is given).
    """
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    norms = eval_norms or set()
    offset = 0

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal offset
        for batch in pf.iter_batches(batch_size=chunk_rows):
            for i, rec in enumerate(batch.to_pylist()):
                yield prepared_row(offset + i + 1, rec, normalize, norms)
            offset += batch.num_rows

    for df in _chunks(rows(), chunk_rows, PREPARED_ROW_COLUMNS):
        ok = df["id"].notna()
        keys.add(df["line"][ok].tolist(), df["id"][ok].tolist())
        yield df


# ------------------------------------------------------------------------------- eval outputs

def eval_samples_frame(
    path: str | Path, key_columns: Sequence[str], metrics: Sequence[str]
) -> pd.DataFrame:
    """The per-sample eval table (`samples.parquet` or `.jsonl`) with a 1-based `line` column.

    Only the key columns and the rate metrics that exist are kept; a missing key column is
    added as all-null so the contract reports it instead of crashing.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        df = pd.read_parquet(path)
    else:
        df = pd.DataFrame([obj for _, obj in iter_jsonl(path)])
    out = pd.DataFrame({"line": pd.array(range(1, len(df) + 1), dtype="Int64")})
    for c in key_columns:
        out[c] = df[c].astype("string") if c in df.columns else pd.array([None] * len(df), dtype="string")
    for m in metrics:
        if m in df.columns:
            out[m] = pd.to_numeric(df[m], errors="coerce").astype("Float64")
    return out


def eval_metrics_frame(
    path: str | Path, rate_metrics: Sequence[str], count_metrics: Sequence[str] = ()
) -> pd.DataFrame:
    """`metrics.json` (flat `{"agent/benchmark/metric": number}`) as rows `key`, `value`,
    `rate_value` (the value when the metric is a rate) and `count_value` (when it is a count).

    Values that are not finite numbers become null (`value_ok` False) so they are reported.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        from mempo.errors import DataError

        raise DataError(f"cannot read metrics: {e}", path=path) from e
    if not isinstance(data, dict):
        from mempo.errors import DataError

        raise DataError("metrics must be a flat JSON object", path=path)
    keys, values, ok, is_rate, is_count = [], [], [], [], []
    for k, v in data.items():
        num = v if isinstance(v, int | float) and not isinstance(v, bool) else None
        finite = num is not None and math.isfinite(num)
        keys.append(str(k))
        values.append(float(num) if finite else None)
        ok.append(finite)
        name = str(k).rsplit("/", 1)[-1]
        is_rate.append(name in rate_metrics)
        is_count.append(name in count_metrics or name.endswith("_max") and name[:-4] in count_metrics)
    return pd.DataFrame({
        "key": pd.array(keys, dtype="string"),
        "value": pd.array(values, dtype="Float64"),
        "value_ok": pd.array(ok, dtype="boolean"),
        "rate_value": pd.array([v if r else None for v, r in zip(values, is_rate, strict=True)],
                               dtype="Float64"),
        "count_value": pd.array([v if c else None for v, c in zip(values, is_count, strict=True)],
                                dtype="Float64"),
    })
