"""`mempo validate` without `--report` is an ad-hoc check: it must never write into the
pipeline's own report folders (DVC outputs that the index and data stages depend on)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mempo.cli import main


def test_an_adhoc_check_leaves_the_pipeline_reports_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pipeline_report = tmp_path / "outputs" / "validation" / "corpus"
    pipeline_report.mkdir(parents=True)
    (pipeline_report / "passed.json").write_text('{"data": "outputs/world/corpus.jsonl"}')
    before = {p.name: p.read_bytes() for p in pipeline_report.iterdir()}
    other = tmp_path / "someone_elses.jsonl"
    other.write_text("".join(json.dumps({"id": str(i), "contents": f"T{i}\ntext {i}"}) + "\n" for i in range(5)))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"validate": {"out": str(tmp_path / "outputs" / "validation")}}))

    assert main(["--params", str(params), "validate", "--suite", "corpus", "--data", str(other)]) == 0
    assert {p.name: p.read_bytes() for p in pipeline_report.iterdir()} == before
    printed = capsys.readouterr().out
    report_dir = Path(printed.split("(report: ")[1].split(")")[0])
    assert (report_dir / "report.json").exists() and (report_dir / "passed.json").exists()
    assert pipeline_report not in report_dir.parents and report_dir != pipeline_report

    # an explicit --report still writes where it is told (what dvc.yaml does)
    assert main(["--params", str(params), "validate", "--suite", "corpus", "--data", str(other),
                 "--report", str(pipeline_report)]) == 0
    assert json.loads((pipeline_report / "passed.json").read_text())["data"] == str(other)
