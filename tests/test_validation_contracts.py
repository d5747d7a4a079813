"""Data contracts (Great Expectations) on real files: corrupt inputs stop at validation, name
the rows, and leave nothing a later stage reads; clean data passes with a report and marker."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from mempo.cli import main as cli_main
from mempo.config import DataParams, DataSource, ValidateParams
from mempo.errors import DataError, ValidationFailed
from mempo.validation import MARKER, REPORT, validate_data


def _q(qid: str, question: str = "Who wrote X?", answers: object = ("Ann",)) -> bytes:
    return (json.dumps({"id": qid, "question": question, "golden_answers": list(answers)}) + "\n").encode()


GOOD = _q("q1", "Where was Ann born?", ["Oslo"])

# name -> (file bytes, substrings the error must contain, first failing line)
CORRUPT_QA: dict[str, tuple[bytes, list[str], int | None]] = {
    "missing_field": (GOOD + b'{"id": "q2", "golden_answers": ["x"]}\n',
                      ["question is a non-empty string", "line=2 id='q2'"], 2),
    "empty_answer_list": (GOOD + _q("q2", answers=[]), ["golden_answers has 1..100", "n_answers=0 line=2"], 2),
    "duplicate_ids": (GOOD + _q("q1", "Another?"), ["ids are unique", "line=1 id='q1'", "line=2 id='q1'"], 1),
    "not_utf8": (GOOD + b'{"id": "q2", "question": "caf\xe9?", "golden_answers": ["x"]}\n',
                 ["not valid UTF-8", "line=2"], 2),
    "truncated_last_line": (GOOD + b'{"id": "q2", "question": "Who', ["truncated last line", "line=2"], 2),
    "wrong_types": (GOOD + b'{"id": "q2", "question": 123, "golden_answers": ["x"]}\n'
                    + b'{"id": "q3", "question": "Ok?", "golden_answers": {"a": 1}}\n',
                    ["question_chars=-1 line=2", "answers_ok=False line=3"], 2),
    "empty_file": (b"", ["at least one question", "observed 0"], None),
    "ten_mb_line": (GOOD + _q("q2", "x" * (10 << 20)), ["over the 1048576-byte limit", "line=2"], 2),
    "nan_answer": (GOOD + b'{"id": "q2", "question": "Ok?", "golden_answers": [NaN]}\n',
                   ["no NaN", "answers_ok=False line=2"], 2),
    "nan_question": (GOOD + b'{"id": "q2", "question": NaN, "golden_answers": ["x"]}\n',
                     ["question_chars=-1 line=2"], 2),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_QA))
def test_corrupt_qa_stops_data_prepare_names_rows_and_writes_nothing(
    case: str, tiny_world: Path, tmp_path: Path
) -> None:
    content, needles, first_line = CORRUPT_QA[case]
    bad = tmp_path / "train.jsonl"
    bad.write_bytes(content)
    out = tmp_path / "data"
    reports = tmp_path / "validation"
    data = DataParams(
        sources=[DataSource(name="world", path=str(bad), split="train"),
                 DataSource(name="world", path=str(tiny_world / "qa/val.jsonl"), split="val")],
        eval_sets=[str(tiny_world / "qa/test.jsonl")], out=str(out),
    )
    from mempo.data import prepare_data

    with pytest.raises(ValidationFailed) as info:
        prepare_data(data, ValidateParams(out=str(reports)))
    err = info.value
    for needle in needles:
        assert needle in err.message, (needle, err.message)
    assert err.path == str(bad)
    assert err.row == first_line
    assert not out.exists(), "a failed gate must not write the data folder"
    report_dir = reports / "qa" / "world-train"
    assert not (report_dir / MARKER).exists()
    report = json.loads((report_dir / REPORT).read_text())
    assert report["success"] is False and report["failed"]
    assert (report_dir / "docs" / "index.html").exists()


def test_clean_corpus_passes_with_report_docs_and_marker(tiny_world: Path, tmp_path: Path) -> None:
    [report] = validate_data("corpus", tiny_world / "corpus.jsonl", ValidateParams(out=str(tmp_path)))
    assert report.success and report.rows == sum(1 for _ in open(tiny_world / "corpus.jsonl"))
    marker = json.loads((tmp_path / "corpus" / MARKER).read_text())
    assert marker["rows"] == report.rows and len(marker["sha256"]) == 64
    body = json.loads((tmp_path / "corpus" / REPORT).read_text())
    assert body["success"] and all(e["success"] for e in body["expectations"])
    assert (tmp_path / "corpus" / "docs" / "index.html").stat().st_size > 0


def test_corpus_is_streamed_and_duplicate_ids_are_found_across_chunks(tmp_path: Path) -> None:
    lines = [{"id": str(i), "contents": f"Title {i}\nText of passage {i}."} for i in range(7)]
    lines[5]["id"] = "1"  # a duplicate in a later chunk
    lines[3]["contents"] = "only a title, no text"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(x) + "\n" for x in lines))
    params = ValidateParams(out=str(tmp_path / "v"), chunk_rows=2)
    with pytest.raises(ValidationFailed) as info:
        validate_data("corpus", corpus, params)
    report = info.value.report  # type: ignore[attr-defined]
    assert report.frames >= 4 + 1  # 4 chunks of rows + the whole-file id batch
    failed = {o.description: o for o in report.failed}
    dup = failed["ids are unique across the whole file"]
    assert dup.sample_rows == [{"line": 2, "id": "1"}, {"line": 6, "id": "1"}]
    title = failed["contents is 'Title\\ntext': a non-empty title line, then text"]
    assert title.unexpected_count == 1 and title.sample_rows[0]["line"] == 4


CORRUPT_CORPUS: dict[str, tuple[bytes, str, int | None]] = {
    "missing_contents": (b'{"id": "1"}\n', "contents_chars=-1 line=2", 2),
    "no_title_line": (b'{"id": "1", "contents": "just text"}\n', "title_ok=False line=2", 2),
    "wrong_id_type": (b'{"id": [1], "contents": "T\\nx"}\n', "id_ok=False line=2", 2),
    "not_utf8": (b'{"id": "1", "contents": "T\\ncaf\xe9"}\n', "not valid UTF-8", 2),
    "truncated": (b'{"id": "1", "contents": "T\\nx', "truncated last line", 2),
    "nan_contents": (b'{"id": "1", "contents": NaN}\n', "contents_chars=-1 line=2", 2),
    "too_long": (b'{"id": "1", "contents": "T\\n' + b"y" * 30_000 + b'"}\n', "contents_chars=30002 line=2", 2),
}


@pytest.mark.parametrize("gz", [False, True], ids=["jsonl", "jsonl.gz"])
@pytest.mark.parametrize("case", sorted(CORRUPT_CORPUS))
def test_corrupt_corpus_lines_are_named(case: str, gz: bool, tmp_path: Path) -> None:
    import gzip

    tail, needle, line = CORRUPT_CORPUS[case]
    raw = b'{"id": "0", "contents": "Title\\nSome text."}\n' + tail
    path = tmp_path / ("corpus.jsonl.gz" if gz else "corpus.jsonl")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    with pytest.raises(ValidationFailed) as info:
        validate_data("corpus", path, ValidateParams(), report_dir=None)
    assert needle in info.value.message and info.value.row == line


def test_stale_marker_is_removed_when_a_rerun_fails(tmp_path: Path) -> None:
    qa = tmp_path / "qa.jsonl"
    qa.write_bytes(GOOD)
    params = ValidateParams(out=str(tmp_path / "v"))
    validate_data("qa", qa, params)
    assert (tmp_path / "v" / "qa" / MARKER).exists()
    qa.write_bytes(GOOD + GOOD)  # now a duplicate id
    with pytest.raises(ValidationFailed):
        validate_data("qa", qa, params)
    assert not (tmp_path / "v" / "qa" / MARKER).exists()
    qa.write_bytes(GOOD)
    validate_data("qa", qa, params)
    assert (tmp_path / "v" / "qa" / MARKER).exists()
    qa.unlink()  # data gone: the old verdict must not survive either
    with pytest.raises(DataError):
        validate_data("qa", qa, params)
    assert not (tmp_path / "v" / "qa" / MARKER).exists()


@pytest.fixture(scope="module")
def prepared_dir(tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mempo.data import prepare_data

    out = tmp_path_factory.mktemp("prepared") / "data"
    data = DataParams(
        sources=[DataSource(name="world", path=str(tiny_world / "qa/train.jsonl"), split="train"),
                 DataSource(name="world", path=str(tiny_world / "qa/val.jsonl"), split="val")],
        eval_sets=[str(tiny_world / "qa/test.jsonl")], out=str(out), gate=False,
    )
    prepare_data(data)
    return out


def test_prepared_folder_passes_and_gets_one_marker(prepared_dir: Path, tiny_world: Path, tmp_path: Path) -> None:
    reports = validate_data("prepared", prepared_dir, ValidateParams(out=str(tmp_path)),
                            eval_sets=[tiny_world / "qa/test.jsonl"])
    assert [Path(r.data).name for r in reports] == ["train.parquet", "val.parquet"]
    assert all(r.success for r in reports)
    marker = json.loads((tmp_path / "prepared" / MARKER).read_text())
    assert set(marker["files"]) == {"train.parquet", "val.parquet"}
    assert any(o.description.startswith("no objective's question") for o in reports[0].outcomes)


def test_prepared_contract_catches_schema_agent_and_leakage(
    prepared_dir: Path, tiny_world: Path, tmp_path: Path
) -> None:
    df = pq.read_table(prepared_dir / "train.parquet").to_pandas()
    df.loc[2, "agent_name"] = "tool_agent"
    test_q = json.loads((tiny_world / "qa/test.jsonl").read_text().splitlines()[0])["question"]
    ei = dict(df.loc[4, "extra_info"])
    objs = [dict(o) for o in ei["objectives"]]
    objs[0]["question"] = test_q.upper()  # normalisation makes it the same question
    ei["objectives"] = objs
    df.at[4, "extra_info"] = ei
    df.at[6, "prompt"] = [{"role": "system", "content": "an old system prompt"}, df.loc[6, "prompt"][1]]
    df = df.drop(columns=["ability"])
    bad = tmp_path / "train.parquet"
    df.to_parquet(bad)
    with pytest.raises(ValidationFailed) as info:
        validate_data("prepared", bad, ValidateParams(out=str(tmp_path / "v")),
                      eval_sets=[tiny_world / "qa/test.jsonl"])
    failed = {o.description: o for o in info.value.report.failed}  # type: ignore[attr-defined]
    assert failed["agent_name is 'mem_agent'"].sample_rows[0]["line"] == 3
    assert failed["no objective's question is in an evaluation set (normalised)"].sample_rows[0]["line"] == 5
    drift = failed["prompt is exactly mempo.agent.format.build_messages(question)"]
    assert [r["line"] for r in drift.sample_rows] == [7]
    schema = failed["the parquet has every column verl's RLHFDataset and the agent loop read"]
    assert schema.sample_rows == [{"column": "ability", "present": False}]


def test_sft_split_passes_and_a_broken_hop_chain_fails(tiny_world: Path, tmp_path: Path) -> None:
    from mempo.config import load_params
    from mempo.data.schema import write_prepared
    from mempo.data.sft_split import write_sft_split

    p = load_params(None, {"sft.world": str(tiny_world), "sft.max_questions": 20, "sft.multi_tasks": 3,
                           "sft.val_questions": 5, "sft.val_multi_tasks": 2})
    write_sft_split(p.sft, tmp_path / "data")
    reports = validate_data("prepared", tmp_path / "data", ValidateParams(out=str(tmp_path / "ok")),
                            eval_sets=[tiny_world / "qa/test.jsonl"])
    assert [Path(r.data).name for r in reports] == ["sft.parquet", "sft_val.parquet"]
    assert all(r.success for r in reports)
    rows = pq.read_table(tmp_path / "data" / "sft.parquet").to_pylist()
    assert all(o["chain"] for r in rows for o in r["extra_info"]["objectives"])  # the teacher's hops kept
    rows[2]["extra_info"]["objectives"][0]["chain"][0]["value"] = " "
    write_prepared(rows, tmp_path / "bad" / "sft.parquet")
    with pytest.raises(ValidationFailed) as info:
        validate_data("prepared", tmp_path / "bad" / "sft.parquet", ValidateParams(out=str(tmp_path / "v")))
    failed = {o.description: o for o in info.value.report.failed}  # type: ignore[attr-defined]
    [objectives] = [o for d, o in failed.items() if d.startswith("extra_info.objectives has k entries")]
    assert [r["line"] for r in objectives.sample_rows] == [3]


def test_eval_contract_checks_ranges_and_one_row_per_question(tmp_path: Path) -> None:
    samples = pd.DataFrame({
        "agent": ["memory", "memory", "memory"], "benchmark": ["world"] * 3,
        "id": ["a", "b", "b"], "em": [1.0, 0.0, 1.5], "f1": [1.0, 0.2, 0.9], "turns": [2, -1, 3],
    })
    samples.to_parquet(tmp_path / "samples.parquet")
    (tmp_path / "metrics.json").write_text(json.dumps({"memory/world/em": 0.5, "memory/world/f1": math.inf,
                                                       "memory/world/turns": 3.0,
                                                       "memory/world/peak_prompt_tokens_max": -4,
                                                       }).replace("Infinity", "NaN"))
    with pytest.raises(ValidationFailed) as info:
        validate_data("eval", tmp_path, ValidateParams(out=str(tmp_path / "v")))
    failed = {o.description: o for o in info.value.report.failed}  # type: ignore[attr-defined]
    assert failed["em is in [0, 1]"].sample_rows[0]["line"] == 3
    assert failed["one row per agent x benchmark x id"].unexpected_count == 2
    assert failed["every metric is a finite number"].sample_rows[0]["key"] == "memory/world/f1"
    assert "f1 is in [0, 1]" not in failed
    assert failed["turns is not negative"].sample_rows[0]["line"] == 2
    assert failed["count metrics are not negative"].sample_rows[0]["key"] == "memory/world/peak_prompt_tokens_max"


def test_cli_exits_3_on_a_failed_contract_and_0_on_a_clean_one(tiny_world: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(GOOD + _q("q2", answers=[]))
    rc = cli_main(["validate", "--suite", "qa", "--data", str(bad), "--report", str(tmp_path / "r1")])
    assert rc == 3
    assert f"{bad}:2" in capsys.readouterr().err
    rc = cli_main(["validate", "--suite", "qa", "--data", str(tiny_world / "qa/val.jsonl"),
                   "--report", str(tmp_path / "r2")])
    assert rc == 0 and (tmp_path / "r2" / MARKER).exists()
