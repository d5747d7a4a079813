"""mempo.tracking against a real sqlite MLflow store: URI resolution, nesting, tags, FAILED runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from mempo import tracking


def test_tracking_uri_defaults_to_project_sqlite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ARTIFACTS_DESTINATION", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.delenv("MEMPO_PROJECT_ROOT", raising=False)
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert tracking.artifact_root(experiment="x") == f"{(tmp_path.resolve() / 'mlartifacts').as_uri()}/x"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking.tracking_uri() == "http://127.0.0.1:5000"
    assert tracking.artifact_root() is None


def test_stage_runs_nest_under_pipeline_run_and_carry_lineage(
    mlflow_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DVC_STAGE", "train")
    data = tmp_path / "in.jsonl"
    data.write_text('{"a": 1}\n')
    with tracking.pipeline_run("pipe", params={"train": {"lambda_mem": 1.0}}) as parent_id:
        with tracking.stage_run("train", params={"lambda_mem": 1.0}, data={"train": data}) as run:
            logged = tracking.log_metrics({"loss": 0.5, "eval": {"em": 1}, "note": "text"}, step=3)
            tracking.log_json({"em": 1.0}, "metrics.json")
        monkeypatch.setenv("DVC_STAGE", "eval")  # as DVC sets it for each stage's process
        with pytest.raises(RuntimeError), tracking.stage_run("eval"):
            raise RuntimeError("stage crashed")
        failed_id = mlflow.last_active_run().info.run_id
    client = mlflow.MlflowClient(mlflow_uri)
    child = client.get_run(run.info.run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent_id
    assert child.info.experiment_id == client.get_run(parent_id).info.experiment_id
    assert child.data.tags["dvc.stage"] == "train"
    assert child.data.tags["mempo.stage"] == "train"
    assert len(child.data.tags["mlflow.source.git.commit"]) in (40, len("unknown"))
    assert len(child.data.tags["data.train.sha256"]) == 64
    # what decides the run's rounding besides code and inputs, on the stage and the pipeline run
    import torch

    for rid in (run.info.run_id, parent_id):
        tags = client.get_run(rid).data.tags
        assert tags["mempo.numerics.cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert tags["mempo.numerics.torch"] == torch.__version__
    assert child.data.params == {"lambda_mem": "1.0"}
    wall = child.data.metrics.pop(tracking.STAGE_WALL_METRIC)
    assert child.data.metrics == {"loss": 0.5, "eval/em": 1.0}
    assert wall >= 0
    # Both stage runs have their wall time, the failed one too, in start order.
    assert list(tracking.stage_wall_times(parent_id)) == ["train", "eval"]
    assert set(logged) == {"loss", "eval/em"}
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["metrics.json"]
    assert client.get_run(failed_id).info.status == "FAILED"
    assert client.get_run(failed_id).data.tags["mlflow.parentRunId"] == parent_id
    assert client.get_run(parent_id).info.status == "FINISHED"
    assert "MEMPO_PARENT_RUN_ID" not in __import__("os").environ


def test_stage_run_in_child_process_nests_via_env(mlflow_uri: str, tmp_path: Path) -> None:
    code = (
        "from mempo.tracking import stage_run\n"
        "with stage_run('index') as r: print(r.info.run_id)\n"
    )
    with tracking.pipeline_run("pipe") as parent_id:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    child_id = out.stdout.strip().splitlines()[-1]
    run = mlflow.MlflowClient(mlflow_uri).get_run(child_id)
    assert run.data.tags["mlflow.parentRunId"] == parent_id
    assert run.info.status == "FINISHED"


def test_use_tracking_sets_only_the_values_a_component_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///pod.db")
    monkeypatch.setenv("MEMPO_PARENT_RUN_ID", "placeholder")
    monkeypatch.delenv("MEMPO_PARENT_RUN_ID")  # recorded, so the value set below is undone
    tracking.use_tracking("", "")
    assert tracking.tracking_uri() == "sqlite:///pod.db" and "MEMPO_PARENT_RUN_ID" not in os.environ
    tracking.use_tracking("http://mlflow.example:5000", "abc123")
    assert tracking.tracking_uri() == "http://mlflow.example:5000"
    assert os.environ["MEMPO_PARENT_RUN_ID"] == "abc123"


def test_stage_wall_time_is_a_metric_and_in_the_pipeline_summary(mlflow_uri: str, tmp_path: Path) -> None:
    import time

    from mempo.pipeline import _stage_time_lines

    with tracking.pipeline_run("pipe") as parent_id:
        with tracking.stage_run("sft"):
            time.sleep(0.05)
        with tracking.stage_run("train"):
            pass
    times = tracking.stage_wall_times(parent_id)
    assert list(times) == ["sft", "train"] and times["sft"] >= 0.05
    lines = _stage_time_lines(tmp_path, parent_id, total_s=10.0)
    assert lines[0] == "Stage times (wall):"
    assert lines[1].split() == ["sft", f"{times['sft']:.1f}", "s"]
    assert lines[-1].split()[:2] == ["other", f"{10.0 - sum(times.values()):.1f}"]
    # run side by side, the two count once in the rest: as the longer of them
    lines = _stage_time_lines(tmp_path, parent_id, total_s=10.0, side_by_side=[["sft", "train"]])
    assert lines[1].endswith("(side by side with train)")
    assert lines[-1].split()[:2] == ["other", f"{10.0 - max(times.values()):.1f}"]


def test_the_summary_links_the_pipeline_run_in_the_uis_model_training_view(mlflow_uri: str) -> None:
    from mempo.pipeline import _run_page

    with tracking.pipeline_run("pipe") as parent_id:
        pass
    exp_id = mlflow.MlflowClient(mlflow_uri).get_run(parent_id).info.experiment_id
    assert _run_page(mlflow_uri, parent_id) == (
        f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs/{parent_id}?workflowType=machine_learning")
    assert _run_page(mlflow_uri, "0" * 32) is None  # no such run: no link rather than a wrong one


def test_the_pipeline_run_carries_its_wall_time_and_the_headline_numbers(mlflow_uri: str, tmp_path: Path) -> None:
    from mempo.pipeline import log_pipeline_metrics

    headline = tmp_path / "register" / "headline.json"
    headline.parent.mkdir()
    headline.write_text('{"em.world": 0.8281, "em.k2": 0.375, "tok.full": 2238.7, "note": "text"}')
    with tracking.pipeline_run("pipe") as parent_id:
        logged = log_pipeline_metrics(parent_id, tmp_path, headline, 12.34)
    metrics = mlflow.MlflowClient(mlflow_uri).get_run(parent_id).data.metrics
    assert metrics == logged == {"pipeline_wall_s": 12.3, "headline/em.world": 0.8281, "headline/em.k2": 0.375,
                                 "headline/tok.full": 2238.7}
    with tracking.pipeline_run("pipe") as other:  # no register stage yet: the wall time alone
        assert log_pipeline_metrics(other, tmp_path, tmp_path / "absent.json", 1.0) == {"pipeline_wall_s": 1.0}


def test_stage_wall_times_name_runs_by_dvc_stage_and_keep_repeated_names(
    mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sft_full and train_full run the sft / train code: their runs are named like the plain
    # stages, and keyed by run name one time would replace the other.
    with tracking.pipeline_run("pipe") as parent_id:
        for stage in ("sft", "sft_full"):
            monkeypatch.setenv("DVC_STAGE", stage)
            with tracking.stage_run("sft"):
                pass
        monkeypatch.delenv("DVC_STAGE")
        for _ in range(2):  # outside DVC: no dvc.stage tag, the run name twice
            with tracking.stage_run("eval"):
                pass
    assert list(tracking.stage_wall_times(parent_id)) == ["sft", "sft_full", "eval", "eval#2"]
    # in the UI too, the full-history cold start's run is named by its DVC stage
    client = mlflow.MlflowClient()
    exp = client.get_run(parent_id).info.experiment_id
    children = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent_id}'",
                                  order_by=["attributes.start_time ASC"])
    assert [r.info.run_name for r in children] == ["sft", "sft_full", "eval", "eval"]
    assert {r.data.tags["mempo.stage"] for r in children[:2]} == {"sft"}


def test_dir_hash_changes_with_content(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("one")
    h1 = tracking.path_hash(tmp_path / "d")
    (tmp_path / "d" / "a.txt").write_text("two")
    assert tracking.path_hash(tmp_path / "d") != h1


def test_tracking_off_is_a_noop(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MEMPO_TRACKING", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'never.db'}")
    with tracking.stage_run("train") as run:
        tracking.log_metrics({"x": 1.0})
    assert run.info.run_id is None
    assert not (tmp_path / "never.db").exists()


def test_stage_runs_get_the_hashes_dvc_recorded(mlflow_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  train:\n    cmd: mempo train grpo\n"
        "    deps:\n    - path: data/prepared\n      md5: abc.dir\n"
        "    params:\n      params.yaml:\n        train.lambda_mem: 1.0\n"
        "    outs:\n    - path: outputs/train/model\n      md5: def.dir\n"
    )
    monkeypatch.setenv("MEMPO_PROJECT_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_STAGE", "train")
    with tracking.pipeline_run("pipe") as parent_id:
        with tracking.stage_run("train") as run:
            pass
    assert tracking.tag_stage_runs_with_dvc_hashes(parent_id) == 1
    tags = mlflow.MlflowClient(mlflow_uri).get_run(run.info.run_id).data.tags
    assert tags["dvc.deps.data/prepared"] == "abc.dir"
    assert tags["dvc.outs.outputs/train/model"] == "def.dir"
    assert len(tags["dvc.params.sha256"]) == 16


def test_numerics_tags_name_the_kernel_settings_that_were_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from mempo.tracking.lineage import numerics_tags

    for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(k, raising=False)
    assert "mempo.numerics.MKL_CBWR" not in numerics_tags()
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    assert numerics_tags()["mempo.numerics.MKL_CBWR"] == "AVX2"
