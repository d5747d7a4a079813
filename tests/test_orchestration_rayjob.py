"""The cluster train step without a cluster: the rendered RayJob against KubeRay's v1 schema,
and submit / wait / collect through the real Kubernetes client against a loopback stand-in
for the API server (tests/k8s_fake.py) playing SUCCEEDED, FAILED and DeadlineExceeded."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import pytest
import yaml
from k8s_fake import FakeKubeAPI

from mempo.config import load_params
from mempo.errors import ConfigError
from mempo.orchestration.rayjob import RayJobFailed, train_on_rayjob
from mempo.orchestration.rayjob_manifest import (
    KUEUE_QUEUE_LABEL,
    TrainRun,
    base_rayjob,
    job_name,
    render_rayjob,
    validate_rayjob,
    with_run,
)

RUNNING = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "rayClusterName": "mempo-train-x-abcde"}
INIT = {"jobDeploymentStatus": "Initializing"}
DONE = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}


def _cluster(tmp_path: Path, **extra):
    return load_params(None, {"cluster.shared_mount": str(tmp_path), "cluster.poll_s": 0.01, **extra}).cluster


def _run(tmp_path: Path, **extra) -> TrainRun:
    fields = {"name": job_name(str(tmp_path / "train")), "policy": str(tmp_path / "sft" / "model"),
              "data": str(tmp_path / "data"), "out": str(tmp_path / "train"),
              "retriever": "http://mempo-retriever.mempo.svc.cluster.local:8013", "parent_run_id": "0123abcd",
              "overrides": ("verl.total_training_steps=3",)}
    return TrainRun(**{**fields, **extra})


def test_rendered_rayjob_is_a_valid_kuberay_v1_rayjob_sized_from_params(tmp_path):
    cluster = _cluster(tmp_path, **{"cluster.nnodes": 2, "cluster.gpus_per_node": 4, "cluster.queue": "gpu-team"})
    run = _run(tmp_path)
    m = render_rayjob(cluster, run)  # validates against the schema subset of the CRD
    assert m["apiVersion"] == "ray.io/v1" and m["kind"] == "RayJob"
    assert m["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "gpu-team"
    spec = m["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == cluster.ttl_after_finished_s
    assert spec["activeDeadlineSeconds"] == cluster.active_deadline_s
    head = spec["rayClusterSpec"]["headGroupSpec"]
    workers = spec["rayClusterSpec"]["workerGroupSpecs"][0]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 2
    worker = workers["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert worker["image"] == cluster.image
    # the tracking URI comes from the Secret in every pod, never inline
    for pod in (head, workers):
        env = {e["name"]: e for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert env["MLFLOW_TRACKING_URI"]["valueFrom"]["secretKeyRef"] == {"name": "mempo-mlflow",
                                                                           "key": "MLFLOW_TRACKING_URI"}
        assert "value" not in env["MLFLOW_TRACKING_URI"]
        # and the retrieval service's token from the retriever's Secret (rollout tool calls send it)
        assert env["MEMPO_RETRIEVER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "mempo-retriever",
                                                                             "key": "MEMPO_RETRIEVER_TOKEN"}
        assert "value" not in env["MEMPO_RETRIEVER_TOKEN"]
        mounts = {v["mountPath"]: v["name"] for v in pod["template"]["spec"]["containers"][0]["volumeMounts"]}
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
                  for v in pod["template"]["spec"]["volumes"]}
        assert claims[mounts[str(tmp_path)]] == "mempo-runs"
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert runtime_env["MEMPO_PARENT_RUN_ID"] == "0123abcd"
    assert runtime_env["MEMPO_RETRIEVER_URL"] == run.retriever
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["mempo", "--params", "/app/params.yaml"]
    assert argv[argv.index("train"):argv.index("train") + 2] == ["train", "verl"]
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--gpus-per-node") + 1] == "4"
    assert argv[argv.index("--out") + 1] == run.out and "verl.total_training_steps=3" in argv
    assert "--ray-address" in argv


def test_entrypoint_quotes_hostile_values_and_paths_must_be_on_the_shared_volume(tmp_path):
    cluster = _cluster(tmp_path)
    evil = str(tmp_path / "x'; touch pwned; echo '")
    m = render_rayjob(cluster, _run(tmp_path, policy=evil, overrides=("verl.experiment_name=a;rm -rf /",)))
    argv = shlex.split(m["spec"]["entrypoint"])  # what Ray's shell will see: one argument each
    assert argv[argv.index("--policy") + 1] == evil
    assert "verl.experiment_name=a;rm -rf /" in argv
    for field, bad in (("policy", "outputs/sft/model"), ("out", "/elsewhere/train"), ("data", str(tmp_path / ".." / "x"))):
        with pytest.raises(ConfigError, match=f"verl.{field}"):
            render_rayjob(cluster, _run(tmp_path, **{field: bad}))
    with pytest.raises(ConfigError, match="DNS-1123"):
        render_rayjob(cluster, _run(tmp_path, name="Bad_Name"))


def test_schema_rejects_misspelt_and_mistyped_fields(tmp_path):
    m = render_rayjob(_cluster(tmp_path), _run(tmp_path))
    typo = json.loads(json.dumps(m))
    typo["spec"]["shutdownAfterJobFinish"] = True  # the API server would prune it silently
    with pytest.raises(ConfigError, match="shutdownAfterJobFinish"):
        validate_rayjob(typo)
    wrong = json.loads(json.dumps(m))
    wrong["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "2"
    with pytest.raises(ConfigError, match="replicas"):
        validate_rayjob(wrong)
    missing = json.loads(json.dumps(m))
    del missing["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(ConfigError, match="groupName"):
        validate_rayjob(missing)


def _job_side(out: Path, finished_status: str = "SUCCEEDED"):
    """What the Ray job does on the shared volume while the operator reports it running."""
    steps = iter(range(1, 100))

    def on_status(name: str, status: dict) -> None:
        if status.get("jobStatus") == "RUNNING":
            (out / "verl").mkdir(parents=True, exist_ok=True)
            (out / "verl" / "progress.json").write_text(json.dumps({"step": next(steps), "total": 3}))
        if status.get("jobStatus") == finished_status == "SUCCEEDED":
            (out / "model").mkdir(parents=True, exist_ok=True)
            (out / "model" / "config.json").write_text("{}")

    return on_status


def test_submit_wait_collect_succeeded(tmp_path, caplog):
    cluster, run = _cluster(tmp_path), _run(tmp_path)
    script = [INIT, RUNNING, RUNNING, RUNNING, DONE]
    caplog.set_level(logging.INFO, logger="mempo.orchestration.rayjob")
    with FakeKubeAPI(script, _job_side(Path(run.out))) as api:
        result = train_on_rayjob(cluster, run, api=api.client(), sleep=lambda s: None)
        assert api.created[0]["metadata"]["name"] == run.name  # the server-side schema check passed
    assert result["submitted"] == "created" and result["status"] == "Complete/SUCCEEDED"
    assert result["model"] == str(Path(run.out) / "model") and result["verl_step"] == 3
    text = caplog.text
    assert "Initializing" in text and "Running/RUNNING" in text and "verl step 3/3" in text


@pytest.mark.parametrize("final, match", [
    ({"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed",
      "message": "Job entrypoint command failed with exit code 2"}, "AppFailed: Job entrypoint command failed"),
    ({"jobDeploymentStatus": "Failed", "jobStatus": "RUNNING", "reason": "DeadlineExceeded",
      "message": "The RayJob has passed the activeDeadlineSeconds. StartTime: ..."}, "DeadlineExceeded"),
    ({"jobDeploymentStatus": "Complete", "jobStatus": "STOPPED"}, "failed: STOPPED"),
])
def test_wait_fails_with_the_jobs_reason(tmp_path, final, match):
    cluster, run = _cluster(tmp_path), _run(tmp_path)
    with FakeKubeAPI([INIT, RUNNING, final], _job_side(Path(run.out), "never")) as api:
        with pytest.raises(RayJobFailed, match=match):
            train_on_rayjob(cluster, run, api=api.client(), sleep=lambda s: None)
    assert not (Path(run.out) / "model").exists()


def test_succeeded_without_a_merged_model_is_an_error(tmp_path):
    cluster, run = _cluster(tmp_path), _run(tmp_path)
    with FakeKubeAPI([RUNNING, DONE]) as api:
        with pytest.raises(Exception, match="no merged model"):
            train_on_rayjob(cluster, run, api=api.client(), sleep=lambda s: None)


def test_a_retried_step_attaches_replaces_or_refuses(tmp_path):
    cluster, run = _cluster(tmp_path), _run(tmp_path)
    manifest = with_run(base_rayjob(cluster), run)
    # a previous attempt's job still running: attach, do not create a second one
    with FakeKubeAPI([RUNNING, DONE], _job_side(Path(run.out))) as api:
        api.put(manifest, RUNNING)
        assert train_on_rayjob(cluster, run, api=api.client(), sleep=lambda s: None)["submitted"] == "attached"
        assert not api.created
    # a previous attempt's job failed: delete it, submit again
    with FakeKubeAPI([RUNNING, DONE], _job_side(Path(run.out))) as api:
        api.put(manifest, {"jobDeploymentStatus": "Failed", "reason": "AppFailed"})
        assert train_on_rayjob(cluster, run, api=api.client(), sleep=lambda s: None)["submitted"] == "replaced"
        assert ("DELETE", f"/apis/ray.io/v1/namespaces/mempo/rayjobs/{run.name}") in api.requests
        assert len(api.created) == 1
    # same name, another run's entrypoint: never touched
    other = with_run(base_rayjob(cluster), _run(tmp_path, data=str(tmp_path / "other")))
    with FakeKubeAPI([RUNNING]) as api:
        api.put(other, RUNNING)
        with pytest.raises(ConfigError, match="another entrypoint"):
            train_on_rayjob(cluster, run, api=api.client(), sleep=lambda s: None)
        assert not any(method == "DELETE" for method, _ in api.requests)


def test_client_side_deadline_deletes_the_job_and_a_vanished_job_fails(tmp_path):
    cluster, run = _cluster(tmp_path, **{"cluster.active_deadline_s": 60}), _run(tmp_path)
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += 600.0  # ten minutes per poll: the 60 s deadline + 30 min grace pass after 4 polls

    with FakeKubeAPI([RUNNING]) as api:
        with pytest.raises(RayJobFailed, match="did not finish within"):
            train_on_rayjob(cluster, run, api=api.client(), sleep=sleep, clock=lambda: now[0])
        assert not api.objects  # deleted: the GPUs are freed
    with FakeKubeAPI([RUNNING]) as api:
        def vanish(name: str, status: dict) -> None:
            api.objects.clear()  # someone deleted it meanwhile (this GET still answers)

        api.on_status = vanish
        with pytest.raises(RayJobFailed, match="disappeared"):
            train_on_rayjob(cluster, run, api=api.client(), sleep=lambda s: None)


def test_api_server_refusal_is_reported(tmp_path):
    cluster, run = _cluster(tmp_path), _run(tmp_path)
    manifest = with_run(base_rayjob(cluster), run)
    manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    from mempo.orchestration.rayjob import submit_rayjob

    with FakeKubeAPI([RUNNING]) as api:
        with pytest.raises(RayJobFailed, match=r"refused RayJob .*\(422\)"):
            submit_rayjob(api.client(), manifest)


def test_cli_submits_through_the_kubeconfig_and_prints_the_result(tmp_path, monkeypatch, capsys):
    from mempo.cli import main

    out = tmp_path / "train"
    with FakeKubeAPI([INIT, RUNNING, DONE], _job_side(out)) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.setenv("MEMPO_PARENT_RUN_ID", "feedbeef")
        rc = main(["--params", str(tmp_path / "none.yaml"), "--set", f"cluster.shared_mount={tmp_path}",
                   "--set", "cluster.poll_s=0.01", "train", "rayjob", "--policy", str(tmp_path / "sft"),
                   "--data", str(tmp_path / "data"), "--out", str(out), "--retriever", "http://r:8013"])
        created = api.created[0]
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == str(out / "model") and result["rayjob"] == job_name(str(out))
    assert yaml.safe_load(created["spec"]["runtimeEnvYAML"])["env_vars"]["MEMPO_PARENT_RUN_ID"] == "feedbeef"
    # the dry run prints the same manifest and submits nothing
    rc = main(["--params", str(tmp_path / "none.yaml"), "--set", f"cluster.shared_mount={tmp_path}",
               "train", "rayjob", "--policy", str(tmp_path / "sft"), "--data", str(tmp_path / "data"),
               "--out", str(out), "--retriever", "http://r:8013", "--dry-run"])
    assert rc == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["spec"]["entrypoint"] == created["spec"]["entrypoint"]


def test_kfp_component_stages_artifacts_runs_the_rayjob_and_hands_the_model_on(tmp_path, monkeypatch):
    """`train_rayjob_op`'s function called directly, as KFP's executor would, against the
    stand-in API server (through a kubeconfig): inputs staged on the run volume, the merged
    model copied into the `trained` artifact; a retry reuses the staged inputs and the job."""
    from kfp.dsl import Dataset, Metrics, Model

    from components.train import train_rayjob_op

    shared = tmp_path / "volume"
    (tmp_path / "sft" / "model").mkdir(parents=True)
    (tmp_path / "sft" / "model" / "config.json").write_text('{"sft": 1}')
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").write_bytes(b"PAR1")
    template = base_rayjob(_cluster(shared))
    trained = Model(uri=str(tmp_path / "artifacts" / "trained"))
    metrics = Metrics(uri=str(tmp_path / "artifacts" / "metrics"))
    staged: dict = {}

    def job_side(name: str, status: dict) -> None:
        stage = shared / "kfp" / name
        staged["policy"] = (stage / "policy" / "config.json").read_text()
        staged["data"] = (stage / "data" / "train.parquet").read_bytes()
        _job_side(stage / "train")(name, status)

    with FakeKubeAPI([INIT, RUNNING, DONE], job_side) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "kubeconfig")))
        kwargs = dict(params_file=str(tmp_path / "none.yaml"), overrides={"cluster.poll_s": 0.01, "verl.lr": 2e-6},
                      rayjob=template, retriever_url="http://r:8013", parent_run_id="p1",
                      init=Model(uri=str(tmp_path / "sft")), data=Dataset(uri=str(tmp_path / "data")),
                      trained=trained, metrics=metrics)
        train_rayjob_op.python_func(**kwargs)
        created = api.created[0]
        # a retry of the step: same artifact URI -> same job name -> attached, nothing re-staged
        api.script = [DONE]
        train_rayjob_op.python_func(**kwargs)
        assert len(api.created) == 1
    assert staged == {"policy": '{"sft": 1}', "data": b"PAR1"}
    assert (Path(trained.path) / "model" / "config.json").exists()
    assert metrics.metadata["verl_steps"] == 1.0 and "rayjob_seconds" in metrics.metadata
    argv = shlex.split(created["spec"]["entrypoint"])
    assert "verl.lr=2e-06" in argv and not any(a.startswith("cluster.") for a in argv)
    assert argv[argv.index("--policy") + 1] == str(shared / "kfp" / created["metadata"]["name"] / "policy")
