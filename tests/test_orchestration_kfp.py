"""The Kubeflow pipeline: it compiles, the committed YAML is fresh, the cluster pipeline's train
step carries the KubeRay RayJob it submits (and asks no GPU for itself), and the CPU-sized
pipeline runs end to end under kfp.local with the local trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
STAGES = {"world", "validate", "index", "data", "policy", "sft", "train", "eval", "register", "promote"}


def test_one_component_file_per_stage() -> None:
    files = {p.stem for p in (REPO / "components").glob("*.py")} - {"__init__", "images", "lineage"}
    assert files == STAGES


def test_committed_yaml_is_fresh(tmp_path: Path) -> None:
    # Compile in a fresh interpreter, exactly as `make compile` does.
    subprocess.run([sys.executable, "-m", "pipelines.mempo_pipeline", str(tmp_path)], cwd=REPO, check=True,
                   capture_output=True)
    for name in ("mempo_pipeline.yaml", "mempo_pipeline_cpu.yaml"):
        committed = (REPO / "pipelines" / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"pipelines/{name} is stale: run `make compile`"


def _docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((REPO / "pipelines" / name).read_text()))


def _spec(name: str) -> dict:
    return _docs(name)[0]


def test_cluster_pipeline_resources_caching_and_images() -> None:
    spec = _spec("mempo_pipeline.yaml")
    tasks = spec["root"]["dag"]["tasks"]
    executors = spec["deploymentSpec"]["executors"]

    def container(task: str) -> dict:
        return executors[spec["components"][tasks[task]["componentRef"]["name"]]["executorLabel"]]["container"]

    assert "train-op" not in tasks  # the local trainer runs in the CPU pipeline only
    train = container("train-rayjob-op")
    assert "accelerator" not in train.get("resources", {})  # the GPUs are the RayJob's
    assert container("sft-op")["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert "accelerator" not in container("register-op").get("resources", {})
    assert train["image"].endswith("/mempo-base:0.1.0")
    assert container("eval-op")["image"].endswith("/mempo-eval:0.1.0")
    for name in ("register-op", "promote-op", "open-parent-run-op", "close-parent-run-op"):
        assert tasks[name]["cachingOptions"].get("enableCache", False) is False, name
    assert tasks["train-rayjob-op"]["cachingOptions"]["enableCache"] is True
    assert all(t.get("taskInfo", {}).get("name") for t in tasks.values())
    for label, ex in executors.items():
        image = ex["container"]["image"]
        name = image.rsplit("/", 1)[1].split(":")[0].removeprefix("mempo-")
        assert (REPO / "containers" / name / "Dockerfile").is_file(), f"{label}: no Dockerfile for {image}"
        # install_kfp_package=False: the command must not pip-install kfp at start-up.
        assert "pip install" not in " ".join(ex["container"]["command"])
    retries = {n: t.get("retryPolicy", {}).get("maxRetryCount") for n, t in tasks.items()}
    assert retries["train-rayjob-op"] == 2 and retries["promote-op"] == 3


def test_cluster_train_step_carries_the_rayjob_and_mounts_the_run_volume() -> None:
    from mempo.config import load_params
    from mempo.orchestration.rayjob_manifest import TrainRun, validate_rayjob, with_run

    spec, platform = _docs("mempo_pipeline.yaml")
    task = spec["root"]["dag"]["tasks"]["train-rayjob-op"]
    rayjob = task["inputs"]["parameters"]["rayjob"]["runtimeValue"]["constant"]
    cluster = load_params(REPO / "params.yaml").cluster
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    assert rayjob["spec"]["activeDeadlineSeconds"] == cluster.active_deadline_s
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True
    workers = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert workers["replicas"] == cluster.nnodes
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(
        cluster.gpus_per_node)
    assert workers["template"]["spec"]["containers"][0]["image"] == cluster.image
    # what the step submits at run time: the template plus the run's fields, still a valid RayJob
    m = cluster.shared_mount
    validate_rayjob(with_run(rayjob, TrainRun("mempo-train-abc", f"{m}/p", f"{m}/d", f"{m}/o", "http://r:8013")))
    executor = spec["deploymentSpec"]["executors"][
        spec["components"][task["componentRef"]["name"]]["executorLabel"]]
    label = next(k for k, v in spec["deploymentSpec"]["executors"].items() if v is executor)
    mounts = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"][label]["pvcMount"]
    assert [(p["mountPath"], p["pvcNameParameter"]["runtimeValue"]["constant"]) for p in mounts] == [
        (cluster.shared_mount, cluster.shared_claim)]


def test_cpu_pipeline_requests_no_gpu_and_trains_locally() -> None:
    spec = _spec("mempo_pipeline_cpu.yaml")
    for ex in spec["deploymentSpec"]["executors"].values():
        assert "accelerator" not in ex["container"].get("resources", {})
    tasks = spec["root"]["dag"]["tasks"]
    assert "train-op" in tasks and "train-rayjob-op" not in tasks


@pytest.mark.slow
def test_cpu_pipeline_runs_end_to_end_under_kfp_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kfp import local

    from mempo.config import profile_overrides
    from pipelines.mempo_pipeline import mempo_pipeline_cpu

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ARTIFACTS_DESTINATION", str(tmp_path / "mlartifacts"))
    monkeypatch.setenv("MEMPO_PROJECT_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"),
               raise_on_error=True)
    tiny = profile_overrides(REPO / "params.tiny.yaml")
    task = mempo_pipeline_cpu(params_file=str(REPO / "params.yaml"), overrides=tiny, mlflow_uri=uri)
    assert task.output is True  # the first model has no champion: floors and required metrics decide
    client = mlflow.MlflowClient(uri)
    champion = client.get_model_version_by_alias("mempo-agent", "champion")
    assert champion.tags["promotion.decision"] == "promoted"
    assert "metric.memory/world/em" in champion.tags
    parent = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.`mempo.orchestrator` = 'kubeflow'"
    )
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    children = client.search_runs(
        [parent[0].info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent[0].info.run_id}'"
    )
    assert {r.data.tags["mempo.stage"] for r in children} >= {"sft", "train", "eval", "register", "promote"}
    assert os.path.isdir(tmp_path / "root")


def test_cluster_steps_that_search_get_the_retriever_token_from_its_secret() -> None:
    from mempo.config import load_params

    cluster = load_params(REPO / "params.yaml").cluster
    spec, platform = _docs("mempo_pipeline.yaml")
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    tasks = spec["root"]["dag"]["tasks"]

    def label(task: str) -> str:
        return spec["components"][tasks[task]["componentRef"]["name"]]["executorLabel"]

    for task in ("sft-op", "eval-op"):
        secrets = executors[label(task)]["secretAsEnv"]
        assert [(s["secretName"], k["secretKey"], k["envVar"]) for s in secrets for k in s["keyToEnv"]] == [
            (cluster.retriever_secret, cluster.retriever_secret_key, "MEMPO_RETRIEVER_TOKEN")]
        assert all(s["optional"] is False for s in secrets)
    # never a literal value: no container of the compiled spec sets it
    for ex in spec["deploymentSpec"]["executors"].values():
        assert "MEMPO_RETRIEVER_TOKEN" not in json.dumps(ex["container"].get("env", []))
