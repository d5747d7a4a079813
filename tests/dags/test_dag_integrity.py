"""DAG integrity: the DAG files import cleanly, are configured as promised, and parse fast
in both modes (local BashOperators, production KubernetesPodOperators)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
DAG_FILES = sorted(p for p in DAGS.glob("mempo_*.py") if p.name != "mempo_dag_common.py")
RETRAIN_ORDER = ["prepare_data", "validate_data", "train", "evaluate", "register", "promote"]


def _bag(mode: str, monkeypatch: pytest.MonkeyPatch):
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("MEMPO_AIRFLOW_MODE", mode)
    sys.modules.pop("mempo_dag_common", None)  # MODE is read when the helper is imported
    return DagBag(dag_folder=str(DAGS))


@pytest.mark.parametrize("mode", ["local", "kubernetes"])
def test_dags_import_without_errors_and_follow_the_rules(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bag = _bag(mode, monkeypatch)
    assert bag.import_errors == {}
    assert set(bag.dags) == {"mempo_retrain", "mempo_index"}
    for dag in bag.dags.values():
        assert dag.tags and "mempo" in dag.tags
        assert dag.catchup is False
        assert dag.max_active_runs == 1
        assert dag.doc_md
        for task in dag.tasks:
            # the RayJob step retries once: its RayJob has its own backoffLimit
            assert task.retries >= (1 if task.task_id == "train" and mode == "kubernetes" else 2), task.task_id
            assert task.execution_timeout is not None, task.task_id
    retrain = bag.dags["mempo_retrain"]
    assert str(retrain.schedule) in ("@weekly", "0 0 * * 0") or "weekly" in str(retrain.timetable.summary).lower()
    order, task = [], retrain.get_task("prepare_data")
    while task is not None:
        order.append(task.task_id)
        nxt = list(task.downstream_list)
        assert len(nxt) <= 1
        task = nxt[0] if nxt else None
    assert order == RETRAIN_ORDER
    kind = "KubernetesPodOperator" if mode == "kubernetes" else "BashOperator"
    assert {type(t).__name__ for t in retrain.tasks} == {kind}


def test_production_pods_use_real_images_and_gpu_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    bag = _bag("kubernetes", monkeypatch)
    retrain = bag.dags["mempo_retrain"]
    train = retrain.get_task("train")
    # the GPUs belong to the RayJob the train step submits, not to the submitting pod
    assert "nvidia.com/gpu" not in train.container_resources.limits
    assert train.arguments[train.arguments.index("train"):][:2] == ["train", "rayjob"]
    assert train.service_account_name == "mempo-rayjob-submitter"
    assert retrain.get_task("evaluate").container_resources.limits["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in retrain.get_task("register").container_resources.limits
    for dag in bag.dags.values():
        for t in dag.tasks:
            if t.image.startswith(("ghcr.io/mempo/mempo-", os.environ.get("MEMPO_IMAGE_REGISTRY", "ghcr.io/mempo"))):
                name = t.image.rsplit("/", 1)[1].split(":")[0].removeprefix("mempo-")
                assert (REPO / "containers" / name / "Dockerfile").is_file(), t.image
                assert t.cmds == ["mempo"]


def test_every_task_runs_a_real_mempo_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    from mempo.cli import build_parser

    parser = build_parser()
    bag = _bag("kubernetes", monkeypatch)
    for dag in bag.dags.values():
        for t in dag.tasks:
            if t.cmds != ["mempo"]:
                continue
            # Fill the templates with plausible values; argparse must accept the arguments.
            args = [a.replace("$(MEMPO_PARAMS_FILE)", "params.yaml") for a in t.arguments]
            args = [a if "$(" not in a else "x" for a in args]
            try:
                parser.parse_args(args)
            except SystemExit as e:
                pytest.fail(f"{dag.dag_id}.{t.task_id}: `mempo {' '.join(args)}` is not a valid command ({e})")


PARSE_TIMER = """
import json, sys, time
from airflow.dag_processing.dagbag import DagBag
DagBag(dag_folder=sys.argv[1])        # warm: airflow and the operators' modules imported once
before = set(sys.modules)
times = {}
for path in sys.argv[2:]:
    t0 = time.perf_counter()
    bag = DagBag(dag_folder=path)
    times[path] = time.perf_counter() - t0
    assert not bag.import_errors, bag.import_errors
heavy = sorted(m for m in set(sys.modules) - before
               if m.split(".")[0] in {"torch", "transformers", "mlflow", "mempo", "faiss", "ray", "kfp"})
print(json.dumps({"times": times, "heavy": heavy}))
"""


@pytest.mark.parametrize("mode", ["local", "kubernetes"])
def test_each_dag_file_parses_in_under_a_second_without_heavy_imports(mode: str, tmp_path: Path) -> None:
    env = {**os.environ, "MEMPO_AIRFLOW_MODE": mode}
    out = subprocess.run(
        [sys.executable, "-c", PARSE_TIMER, str(DAGS), *map(str, DAG_FILES)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["times"]) == set(map(str, DAG_FILES))
    for path, seconds in result["times"].items():
        assert seconds < 1.0, f"{path} took {seconds:.2f} s to parse"
    assert result["heavy"] == []
