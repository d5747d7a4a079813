"""mempo.pipeline pieces: DVC downstream sets, the retrieval service lifecycle (also when the
block fails), and a failing stage ending the MLflow parent run FAILED."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import mlflow
import pytest
import yaml

from mempo.dvc_runner import downstream_of
from mempo.errors import MempoError
from mempo.pipeline import retrieval_service, run_pipeline, write_params_with

REPO = Path(__file__).resolve().parents[1]


def test_downstream_of_train_is_eval_and_register() -> None:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert downstream_of(stages, ["train"]) == {"train", "eval", "register"}
    assert downstream_of(stages, ["register"]) == {"register"}
    assert downstream_of(stages, ["world"]) == set(stages)


def test_write_params_with_validates_and_applies(tmp_path: Path) -> None:
    out = write_params_with(REPO / "params.yaml", tmp_path / "p.yaml", {"mempo.lambda_mem": 0.25})
    assert yaml.safe_load(out.read_text())["mempo"]["lambda_mem"] == 0.25
    with pytest.raises(MempoError, match="train.lambda_mem_typo"):
        write_params_with(REPO / "params.yaml", tmp_path / "q.yaml", {"train.lambda_mem_typo": 1})


@pytest.fixture(scope="module")
def bm25_index(tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mempo.retrieval.index import build_index

    out = tmp_path_factory.mktemp("index") / "index"
    build_index(tiny_world / "corpus.jsonl", out, method="bm25")
    return out


def _port_closed(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def test_retrieval_service_serves_and_stops_even_when_the_block_fails(bm25_index: Path) -> None:
    with pytest.raises(RuntimeError, match="stage failed"), retrieval_service(bm25_index, start_timeout_s=120) as url:
        assert url.startswith("http://127.0.0.1:")
        body = httpx.post(f"{url}/retrieve", json={"queries": ["river"], "topk": 2, "return_scores": True},
                          timeout=30).json()
        assert len(body["result"][0]) == 2
        raise RuntimeError("stage failed")
    assert _port_closed(url)


def test_retrieval_service_reports_a_missing_index(tmp_path: Path) -> None:
    with pytest.raises(MempoError, match="index not found"), retrieval_service(tmp_path / "none"):
        pass


def test_a_failing_stage_fails_the_run_and_its_parent_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "ok": {"cmd": "echo fine > ok.txt", "outs": ["ok.txt"]},
        "boom": {"cmd": "exit 7", "deps": ["ok.txt"]},
    }}))
    (tmp_path / "params.yaml").write_text("pipeline: {serve_retriever: false, promote: false}\n")
    for cmd in (["git", "init", "-q"], [str(Path(sys.executable).parent / "dvc"), "init", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MEMPO_PARENT_RUN_ID", raising=False)
    with pytest.raises(MempoError, match="failed"):
        run_pipeline(tmp_path)
    runs = mlflow.MlflowClient(uri).search_runs(
        [mlflow.MlflowClient(uri).get_experiment_by_name("mempo").experiment_id],
        "tags.`mempo.stage` = 'pipeline'",
    )
    assert [r.info.status for r in runs] == ["FAILED"]
    assert (tmp_path / "ok.txt").read_text().strip() == "fine"
    assert "MEMPO_PARENT_RUN_ID" not in os.environ


def test_run_pipeline_pushes_its_outputs_to_the_default_remote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dvc = str(Path(sys.executable).parent / "dvc")
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "ok": {"cmd": "echo fine > ok.txt", "outs": ["ok.txt"]},
    }}))
    (tmp_path / "params.yaml").write_text("pipeline: {serve_retriever: false, promote: false}\n")
    for cmd in (["git", "init", "-q"], [dvc, "init", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MEMPO_PARENT_RUN_ID", raising=False)
    # No default remote: nothing to push, and the summary says so.
    result = run_pipeline(tmp_path)
    assert result.notes == ["DVC remote:  none configured, nothing pushed (dvc remote add -d ...)"]
    # With one (as the repository's .dvc/config sets `local`), the outputs land in it.
    subprocess.run([dvc, "remote", "add", "-d", "local", "remote"], cwd=tmp_path, check=True, capture_output=True)
    result = run_pipeline(tmp_path)
    assert result.ran == [] and result.notes[0].startswith("DVC remote:  outputs pushed to 'local'")
    cloud = subprocess.run([dvc, "status", "--cloud", "--json"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert json.loads(cloud.stdout) == {}
    assert [p.read_text() for p in (tmp_path / "remote").rglob("*") if p.is_file()] == ["fine\n"]


def test_train_full_lists_every_train_key_but_the_ones_it_sets_itself() -> None:
    """`train_full` pins lambda_mem to 0 and sets policy and out on its command line, so it
    lists the other `train.*` keys one by one; a new `train` key must be listed there too."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    train_keys = set(yaml.safe_load((REPO / "params.yaml").read_text())["train"])
    listed = {p.removeprefix("train.") for p in stages["train_full"]["params"] if str(p).startswith("train.")}
    assert listed == train_keys - {"lambda_mem", "policy", "out", "log_memory_reward"}
    assert "train" not in stages["train_full"]["params"]
