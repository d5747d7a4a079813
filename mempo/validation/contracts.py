"""The four data contracts as Great Expectations suites: corpus, qa, prepared, eval.

A contract is one or more batches, each a suite over a stream of diagnostic frames
(`mempo.validation.frames`):

- `corpus`: every line is a UTF-8 JSON object under the size limit; a non-empty string or
  integer id; contents "Title\\ntext" within length bounds; ids unique over the whole file;
  at least one passage.
- `qa`: every line parses; a valid id; a non-empty question within bounds; `golden_answers`
  a non-empty list of non-empty strings (no NaN) within bounds; metadata an object; ids
  unique; at least one question.
- `prepared`: the parquet has every column verl reads; prompt is chat messages ending in a
  user message that holds the question, exactly as the current prompt module builds it; `reward_model` is `rule` with a non-empty target
  list; `extra_info` has index, id, split, question, k and k objectives with answers (and a
  null or well-formed hop chain each);
  `agent_name` is `mem_agent`; no objective's question is in an evaluation set; ids unique.
- `eval`: per-sample outputs have their key columns, one row per key, rate metrics in
  [0, 1], counts (turns, tokens, latency) not negative; `metrics.json` values are finite,
  its rates in [0, 1] and its counts not negative.

    contract = build_contract("qa", "data/world/qa/train.jsonl", params.validation)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from mempo.config import ValidateParams
from mempo.errors import DataError
from mempo.validation import frames as fr

SUITES = ("corpus", "qa", "prepared", "eval")
AGENT_NAME = "mem_agent"
MAX_K = 16


@dataclass(frozen=True)
class Check:
    """One expectation, described without importing GE (`kind` is the GE class name)."""

    kind: str
    description: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchSpec:
    """A suite run over a stream of frames (`frames` is called once, after earlier batches)."""

    name: str
    checks: list[Check]
    frames: Callable[[], Iterable[pd.DataFrame]]
    index_columns: list[str]


@dataclass
class Contract:
    suite: str
    data: Path
    batches: list[BatchSpec]
    rows_read: Callable[[], int] = lambda: 0
    # For readable duplicate reports: the ids at some 1-based lines (read again on failure).
    ids_at: Callable[[set[int]], dict[int, str]] | None = None


def _jsonl_ids_at(path: str | Path) -> Callable[[set[int]], dict[int, str]]:
    def ids_at(lines: set[int]) -> dict[int, str]:
        from mempo.io import iter_jsonl

        found: dict[int, str] = {}
        for lineno, obj in iter_jsonl(path, skip_bad=True, max_line_bytes=1 << 30):
            if lineno in lines:
                found[lineno] = str(obj.get("id"))
                if len(found) == len(lines):
                    break
        return found

    return ids_at


def _parquet_ids_at(path: Path) -> Callable[[set[int]], dict[int, str]]:
    def ids_at(lines: set[int]) -> dict[int, str]:
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=["extra_info"])
        return {ln: str((table.slice(ln - 1, 1).to_pylist()[0]["extra_info"] or {}).get("id"))
                for ln in lines if 0 < ln <= table.num_rows}

    return ids_at


def _col(kind: str, column: str, description: str, **kwargs: Any) -> Check:
    return Check(kind, description, {"column": column, **kwargs})


def _true(column: str, description: str) -> Check:
    return _col("ExpectColumnValuesToBeInSet", column, description, value_set=[True])


def _parsed(bounds_bytes: int) -> Check:
    return _col("ExpectColumnValuesToBeNull", "parse_error",
                f"every line is a UTF-8 JSON object of at most {bounds_bytes} bytes")


def _ids_batch(keys: fr.KeyIndex, rows_read: Callable[[], int], what: str) -> BatchSpec:
    return BatchSpec(
        name="ids",
        checks=[
            Check("ExpectTableRowCountToBeBetween", f"the file has at least one {what} with a valid id",
                  {"min_value": 1}),
            _col("ExpectColumnValuesToBeUnique", "key_hash", "ids are unique across the whole file"),
        ],
        frames=lambda: [keys.frame(rows_read())],
        index_columns=["line"],
    )


class _Counter:
    """Counts rows of frames as they stream past (the report's `rows`)."""

    def __init__(self) -> None:
        self.n = 0

    def wrap(self, frames: Iterable[pd.DataFrame]) -> Iterable[pd.DataFrame]:
        for df in frames:
            self.n += len(df)
            yield df


def corpus_contract(path: str | Path, params: ValidateParams) -> Contract:
    """The `corpus` contract (wiki-18 format), streamed in `params.chunk_rows` chunks."""
    b = params.bounds
    keys, count = fr.KeyIndex(), _Counter()
    rows = BatchSpec(
        name="rows",
        checks=[
            _parsed(b.max_line_bytes),
            _true("id_ok", "id is a non-empty string or integer"),
            _col("ExpectColumnValuesToBeBetween", "contents_chars",
                 f"contents is a string of {b.corpus_min_chars}..{b.corpus_max_chars} characters",
                 min_value=b.corpus_min_chars, max_value=b.corpus_max_chars),
            _true("title_ok", "contents is 'Title\\ntext': a non-empty title line, then text"),
        ],
        frames=lambda: count.wrap(fr.corpus_frames(path, b, params.chunk_rows, keys)),
        index_columns=["line", "id"],
    )
    return Contract("corpus", Path(path), [rows, _ids_batch(keys, lambda: count.n, "passage")],
                    rows_read=lambda: count.n, ids_at=_jsonl_ids_at(path))


def qa_contract(path: str | Path, params: ValidateParams) -> Contract:
    """The `qa` contract (FlashRAG format)."""
    b = params.bounds
    keys, count = fr.KeyIndex(), _Counter()
    rows = BatchSpec(
        name="rows",
        checks=[
            _parsed(b.max_line_bytes),
            _true("id_ok", "id is a non-empty string or integer"),
            _col("ExpectColumnValuesToBeBetween", "question_chars",
                 f"question is a non-empty string of at most {b.question_max_chars} characters",
                 min_value=1, max_value=b.question_max_chars),
            _true("answers_ok", "golden_answers is a non-empty list of non-empty strings (no NaN)"),
            _col("ExpectColumnValuesToBeBetween", "n_answers",
                 f"golden_answers has 1..{b.max_answers} answers", min_value=1, max_value=b.max_answers),
            _col("ExpectColumnValuesToBeBetween", "max_answer_chars",
                 f"every answer has at most {b.answer_max_chars} characters",
                 min_value=0, max_value=b.answer_max_chars),
            _true("metadata_ok", "metadata, when present, is an object"),
        ],
        frames=lambda: count.wrap(fr.qa_frames(path, b, params.chunk_rows, keys)),
        index_columns=["line", "id"],
    )
    return Contract("qa", Path(path), [rows, _ids_batch(keys, lambda: count.n, "question")],
                    rows_read=lambda: count.n, ids_at=_jsonl_ids_at(path))


def prepared_contract(
    path: str | Path,
    params: ValidateParams,
    eval_questions: Sequence[str] = (),
    normalize: Callable[[str], str] | None = None,
) -> Contract:
    """The `prepared` contract (verl parquet). `eval_questions` are checked for leakage."""
    path = Path(path)
    _check_parquet(path)
    b = params.bounds
    keys, count = fr.KeyIndex(), _Counter()
    eval_norms = {normalize(q) for q in eval_questions} if normalize else set()
    schema = BatchSpec(
        name="schema",
        checks=[_true("present", "the parquet has every column verl's RLHFDataset and the agent loop read")],
        frames=lambda: [fr.prepared_schema_frame(path)],
        index_columns=["column"],
    )
    checks = [
        _col("ExpectColumnValuesToNotBeNull", "data_source", "data_source is a string"),
        _true("prompt_ok", "prompt is chat messages (role, content) ending with a user message"),
        _col("ExpectColumnValuesToBeBetween", "prompt_chars",
             f"the prompt has 1..{b.prompt_max_chars} characters", min_value=1, max_value=b.prompt_max_chars),
        _true("question_in_prompt", "the user message holds extra_info.question"),
        # A parquet built with an older template would train a prompt the agent never sees.
        _true("prompt_is_first_turn", "prompt is exactly mempo.agent.format.build_messages(question)"),
        _col("ExpectColumnValuesToNotBeNull", "ability", "ability is a string"),
        _col("ExpectColumnValuesToBeInSet", "reward_style", "reward_model.style is 'rule'", value_set=["rule"]),
        _col("ExpectColumnValuesToNotBeNull", "reward_style", "reward_model has a style"),
        _true("targets_ok", "reward_model.ground_truth.target is a non-empty list of non-empty strings"),
        _true("extra_info_ok", "extra_info has index (int), id, question and k"),
        _col("ExpectColumnValuesToBeInSet", "split", "extra_info.split is train or val",
             value_set=["train", "val"]),
        _col("ExpectColumnValuesToBeBetween", "k", f"k is 1..{MAX_K} objectives", min_value=1, max_value=MAX_K),
        _true("objectives_ok", "extra_info.objectives has k entries, each a question with answers "
              "and a null or well-formed hop chain"),
        _col("ExpectColumnValuesToBeInSet", "agent_name", f"agent_name is '{AGENT_NAME}'",
             value_set=[AGENT_NAME]),
        _col("ExpectColumnValuesToNotBeNull", "agent_name", "every row names its agent loop"),
    ]
    if normalize is not None:
        checks.append(_col("ExpectColumnValuesToBeBetween", "eval_overlap",
                           "no objective's question is in an evaluation set (normalised)",
                           min_value=0, max_value=0))
    rows = BatchSpec(
        name="rows", checks=checks,
        frames=lambda: count.wrap(fr.prepared_frames(path, params.chunk_rows, keys, normalize, eval_norms)),
        index_columns=["line", "id"],
    )
    return Contract("prepared", path, [schema, rows, _ids_batch(keys, lambda: count.n, "row")],
                    rows_read=lambda: count.n, ids_at=_parquet_ids_at(path))


def _check_parquet(path: Path) -> None:
    import pyarrow.parquet as pq

    if not path.exists():
        raise DataError("file not found", path=path)
    try:
        pq.read_schema(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"not a readable parquet file: {e}", path=path) from e


def eval_contract(path: str | Path, params: ValidateParams) -> Contract:
    """The `eval` contract: a folder with `samples.parquet` (+ `metrics.json`), or a samples file."""
    path = Path(path)
    b = params.bounds
    if path.is_dir():
        samples = next((path / n for n in ("samples.parquet", "samples.jsonl") if (path / n).exists()), None)
        metrics = path / "metrics.json"
        if samples is None:
            raise DataError("no samples.parquet or samples.jsonl in the eval folder", path=path)
    else:
        if not path.exists():
            raise DataError("file not found", path=path)
        samples, metrics = path, path.parent / "metrics.json"
    keys = list(b.eval_key_columns)
    sample_df = fr.eval_samples_frame(samples, keys, [*b.eval_rate_metrics, *b.eval_count_metrics])
    checks = [Check("ExpectTableRowCountToBeBetween", "at least one evaluated sample", {"min_value": 1})]
    checks += [_col("ExpectColumnValuesToNotBeNull", c, f"every sample has its {c}") for c in keys]
    checks.append(Check("ExpectCompoundColumnsToBeUnique", "one row per " + " x ".join(keys),
                        {"column_list": keys}))
    checks += [_col("ExpectColumnValuesToBeBetween", m, f"{m} is in [0, 1]", min_value=0.0, max_value=1.0)
               for m in b.eval_rate_metrics if m in sample_df.columns]
    checks += [_col("ExpectColumnValuesToBeBetween", m, f"{m} is not negative", min_value=0.0)
               for m in b.eval_count_metrics if m in sample_df.columns]
    batches = [BatchSpec("samples", checks, lambda: [sample_df], ["line", *keys])]
    if metrics.exists():
        metrics_df = fr.eval_metrics_frame(metrics, b.eval_rate_metrics, b.eval_count_metrics)
        batches.append(BatchSpec(
            "metrics",
            [_true("value_ok", "every metric is a finite number"),
             _col("ExpectColumnValuesToBeBetween", "rate_value", "rate metrics are in [0, 1]",
                  min_value=0.0, max_value=1.0),
             _col("ExpectColumnValuesToBeBetween", "count_value", "count metrics are not negative",
                  min_value=0.0)],
            lambda: [metrics_df], ["key"],
        ))
    return Contract("eval", samples, batches, rows_read=lambda: len(sample_df))


def build_contract(
    suite: str,
    data: str | Path,
    params: ValidateParams,
    eval_questions: Sequence[str] = (),
    normalize: Callable[[str], str] | None = None,
) -> Contract:
    """The named contract over `data` (see the module docstring)."""
    if suite == "corpus":
        return corpus_contract(data, params)
    if suite == "qa":
        return qa_contract(data, params)
    if suite == "prepared":
        return prepared_contract(data, params, eval_questions, normalize)
    if suite == "eval":
        return eval_contract(data, params)
    raise DataError(f"unknown suite '{suite}' (choose from {', '.join(SUITES)})", field="suite")
