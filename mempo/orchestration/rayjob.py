"""The cluster train step: a KubeRay `RayJob` (ray.io/v1) that runs `mempo train verl`.

    mempo train rayjob --policy /mnt/mempo/runs/R/sft/model --data /mnt/mempo/runs/R/data \
        --out /mnt/mempo/runs/R/train --retriever http://mempo-retriever.mempo.svc.cluster.local:8013
    mempo train rayjob ... --dry-run        # print the validated RayJob, submit nothing

The Airflow `mempo_retrain` DAG (kubernetes mode) and the cluster Kubeflow pipeline call
`train_on_rayjob`; the CPU pipeline, `make run` and the local DAG keep the local trainer.

What the RayJob holds (`base_rayjob` from params.yaml `cluster:`, then `with_run`):
- a CPU head pod and one worker group of `cluster.nnodes` pods with `cluster.gpus_per_node`
  GPUs each (verl's `trainer.nnodes` x `trainer.n_gpus_per_node`), all in the train image
  (containers/train) and all mounting the run volume `cluster.shared_claim` at
  `cluster.shared_mount`, where the inputs, verl's checkpoints and the merged model live;
- `MEMPO_RETRIEVER_TOKEN` from the Secret `cluster.retriever_secret` (the retriever's own).
- `MLFLOW_TRACKING_URI` from the Secret `cluster.mlflow_secret` in every pod (never inline:
  the URI may carry credentials); the parent run id and the retriever URL in `runtimeEnvYAML`;
- the entrypoint `mempo ... train verl --ray-address auto ...` (every argument shell-quoted:
  Ray runs the entrypoint through a shell);
- `shutdownAfterJobFinishes`, `ttlSecondsAfterFinished`, `activeDeadlineSeconds` (the cost
  cap), `backoffLimit` (each retry is a new RayCluster; verl's `resume_mode=auto` continues
  from the newest checkpoint on the shared volume) and the Kueue queue label when one is set.

Submission goes through the Kubernetes Python client's `CustomObjectsApi` (pinned in
requirements.lock); `api` arguments take anything with its `create/get/delete_namespaced_
custom_object` methods. A retried step finds its RayJob by name: a running or finished one is
attached to, a failed one is replaced. While waiting, the step logs every status change and
the verl step the trainer writes to `<out>/verl/progress.json` (mempo.verl_plugin.trainer);
it fails with KubeRay's reason and message (`DeadlineExceeded`, `AppFailed`, ...).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import shlex
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mempo.errors import ConfigError, DataError, MempoError

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
SCHEMA_PATH = Path(__file__).with_name("kuberay_rayjob_v1.schema.json")
# KubeRay refuses RayJob names longer than this (it derives cluster and service names from it).
MAX_NAME_CHARS = 47
RUN_VOLUME = "runs"
# Written into the manifest so a template rendered at compile time (Kubeflow) carries its
# own sizing; `with_run` reads the entrypoint's --nnodes etc. from here, never from elsewhere.
ANNOTATIONS = {
    "nnodes": "mempo.io/nnodes",
    "gpus_per_node": "mempo.io/gpus-per-node",
    "image_workdir": "mempo.io/image-workdir",
    "shared_mount": "mempo.io/shared-mount",
}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class RayJobFailed(MempoError):
    """The RayJob failed, was deleted, or did not finish within its deadline."""


@dataclass(frozen=True)
class TrainRun:
    """One run's side of the RayJob: names, paths on the shared volume, tracking.

    Attributes:
        name: RayJob name (DNS-1123, <= 47 characters; see `job_name`).
        policy, data, out: `mempo train verl`'s --policy / --data / --out, as the Ray pods see
            them (under the shared mount).
        retriever: the retrieval service URL reachable from every Ray pod.
        parent_run_id: MLflow parent run the verl stage run nests under ("" = none).
        overrides: `key=value` params overrides forwarded to `mempo --set` in the entrypoint.
    """

    name: str
    policy: str
    data: str
    out: str
    retriever: str
    parent_run_id: str = ""
    overrides: Sequence[str] = field(default_factory=tuple)


@dataclass(frozen=True)
class RayJobState:
    """What KubeRay reports in `.status` (empty strings until the operator has written them)."""

    deployment: str = ""
    job: str = ""
    reason: str = ""
    message: str = ""
    cluster: str = ""

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> RayJobState:
        s = obj.get("status") or {}
        return cls(str(s.get("jobDeploymentStatus") or ""), str(s.get("jobStatus") or ""),
                   str(s.get("reason") or ""), str(s.get("message") or ""), str(s.get("rayClusterName") or ""))

    @property
    def succeeded(self) -> bool:
        return self.deployment == "Complete" and self.job == "SUCCEEDED"

    @property
    def failed(self) -> bool:
        return self.deployment in ("Failed", "ValidationFailed") or (
            self.deployment == "Complete" and self.job in ("FAILED", "STOPPED"))

    def describe(self) -> str:
        text = f"{self.deployment or 'New'}/{self.job or '-'}"
        return text + (f" ({self.reason}: {self.message})" if self.reason or self.message else "")


def job_name(key: str, prefix: str = "mempo-train") -> str:
    """A stable RayJob name for one run: `prefix-<12 hex of sha256(key)>` (a retry finds it again)."""
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]
    name = f"{prefix}-{digest}"
    if len(name) > MAX_NAME_CHARS or not _DNS_LABEL.fullmatch(name):
        raise ConfigError(f"RayJob name {name!r} must be a DNS-1123 label of <= {MAX_NAME_CHARS} characters")
    return name


def _quantity(value: str | int) -> str:
    return str(value)


def _pod_template(cluster: Any, *, container: str, cpus: str, memory: str, gpus: int,
                  ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One Ray pod in the train image: run volume, /dev/shm, the MLflow Secret, non-root."""
    resources = {"cpu": _quantity(cpus), "memory": _quantity(memory)}
    if gpus:
        resources[cluster.gpu_resource] = _quantity(gpus)
    body: dict[str, Any] = {
        "name": container,
        "image": cluster.image,
        "imagePullPolicy": cluster.image_pull_policy,
        "env": [
            {"name": "MLFLOW_TRACKING_URI",
             "valueFrom": {"secretKeyRef": {"name": cluster.mlflow_secret, "key": cluster.mlflow_secret_key}}},
            # the retrieval service's token: the tool calls of every rollout worker send it
            {"name": "MEMPO_RETRIEVER_TOKEN",
             "valueFrom": {"secretKeyRef": {"name": cluster.retriever_secret, "key": cluster.retriever_secret_key}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
        ],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": [
            {"name": RUN_VOLUME, "mountPath": cluster.shared_mount},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    if ports:
        body["ports"] = ports
    spec: dict[str, Any] = {
        "containers": [body],
        "volumes": [
            {"name": RUN_VOLUME, "persistentVolumeClaim": {"claimName": cluster.shared_claim}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cluster.shm_size}},
        ],
        # the train image's user (containers/train/Dockerfile); fsGroup makes the volume writable
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
    }
    if gpus:
        if cluster.node_selector:
            spec["nodeSelector"] = dict(cluster.node_selector)
        spec["tolerations"] = [{"key": cluster.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]
    if cluster.service_account:
        spec["serviceAccountName"] = cluster.service_account
    return {"metadata": {"labels": {"app.kubernetes.io/name": "mempo-train",
                                    "app.kubernetes.io/part-of": "mempo"}}, "spec": spec}


def base_rayjob(cluster: Any) -> dict[str, Any]:
    """The RayJob without the run's fields (name, entrypoint, runtime env), from params `cluster:`.

    Args:
        cluster: `mempo.config.ClusterParams`.
    Returns:
        A `ray.io/v1` RayJob manifest (dict); `with_run` completes it.
    """
    labels = {"app.kubernetes.io/name": "mempo-train", "app.kubernetes.io/part-of": "mempo"}
    if cluster.queue:
        labels[KUEUE_QUEUE_LABEL] = cluster.queue
    head_ports = [{"name": "gcs-server", "containerPort": 6379}, {"name": "dashboard", "containerPort": 8265},
                  {"name": "client", "containerPort": 10001}]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RayJob",
        "metadata": {
            "name": "",
            "namespace": cluster.namespace,
            "labels": labels,
            "annotations": {
                ANNOTATIONS["nnodes"]: str(cluster.nnodes),
                ANNOTATIONS["gpus_per_node"]: str(cluster.gpus_per_node),
                ANNOTATIONS["image_workdir"]: cluster.image_workdir,
                ANNOTATIONS["shared_mount"]: cluster.shared_mount,
            },
        },
        "spec": {
            "entrypoint": "",
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": int(cluster.ttl_after_finished_s),
            "activeDeadlineSeconds": int(cluster.active_deadline_s),
            "backoffLimit": int(cluster.backoff_limit),
            "rayClusterSpec": {
                "rayVersion": cluster.ray_version,
                "enableInTreeAutoscaling": False,
                "headGroupSpec": {
                    # no GPUs on the head: the driver and verl's TaskRunner need CPUs only
                    "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
                    "template": _pod_template(cluster, container="ray-head", cpus=cluster.head_cpus,
                                              memory=cluster.head_memory, gpus=0, ports=head_ports),
                },
                "workerGroupSpecs": [{
                    "groupName": "gpu",
                    "replicas": int(cluster.nnodes),
                    "minReplicas": int(cluster.nnodes),
                    "maxReplicas": int(cluster.nnodes),
                    "rayStartParams": {},
                    "template": _pod_template(cluster, container="ray-worker", cpus=cluster.cpus_per_node,
                                              memory=cluster.memory_per_node, gpus=int(cluster.gpus_per_node)),
                }],
            },
        },
    }


def entrypoint_argv(template: Mapping[str, Any], run: TrainRun) -> list[str]:
    """`mempo ... train verl ...` for the Ray head, sized by the template's annotations."""
    notes = template["metadata"]["annotations"]
    workdir = notes[ANNOTATIONS["image_workdir"]].rstrip("/")
    sets: list[str] = []
    for item in run.overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        if not item.split("=", 1)[0].strip().startswith("cluster."):  # sizing is the manifest's
            sets += ["--set", item]
    return [
        "mempo", "--params", f"{workdir}/params.yaml", *sets,
        # absolute: Ray does not promise the entrypoint's working directory
        "--set", f"verl.config={workdir}/configs/verl/mempo_trainer.yaml",
        "--set", f"verl.shared_dir={notes[ANNOTATIONS['shared_mount']]}",
        "train", "verl",
        "--policy", run.policy, "--data", run.data, "--out", run.out, "--retriever", run.retriever,
        "--ray-address", "auto",
        "--nnodes", notes[ANNOTATIONS["nnodes"]], "--gpus-per-node", notes[ANNOTATIONS["gpus_per_node"]],
    ]


def with_run(template: Mapping[str, Any], run: TrainRun) -> dict[str, Any]:
    """A copy of `template` (from `base_rayjob`) with the run's name, entrypoint and runtime env."""
    if not _DNS_LABEL.fullmatch(run.name) or len(run.name) > MAX_NAME_CHARS:
        raise ConfigError(f"RayJob name {run.name!r} must be a DNS-1123 label of <= {MAX_NAME_CHARS} characters")
    manifest = copy.deepcopy(dict(template))
    shared = Path(manifest["metadata"]["annotations"][ANNOTATIONS["shared_mount"]])
    for name in ("policy", "data", "out"):
        path = Path(getattr(run, name))
        if not path.is_absolute() or ".." in path.parts or shared not in (path, *path.parents):
            raise ConfigError(f"must be an absolute path under the shared volume {shared} (the Ray pods see "
                              f"nothing else), got {str(path)!r}", field=f"verl.{name}")
    manifest["metadata"]["name"] = run.name
    env_vars = {"MEMPO_RETRIEVER_URL": run.retriever, "PYTHONUNBUFFERED": "1"}
    if run.parent_run_id:
        env_vars["MEMPO_PARENT_RUN_ID"] = run.parent_run_id
    spec = manifest["spec"]
    spec["entrypoint"] = shlex.join(entrypoint_argv(manifest, run))
    spec["runtimeEnvYAML"] = yaml.safe_dump({"env_vars": env_vars}, sort_keys=True)
    return manifest


def render_rayjob(cluster: Any, run: TrainRun) -> dict[str, Any]:
    """`with_run(base_rayjob(cluster), run)`, validated against the KubeRay schema subset."""
    manifest = with_run(base_rayjob(cluster), run)
    validate_rayjob(manifest)
    return manifest


def validate_rayjob(manifest: Mapping[str, Any], schema_path: Path = SCHEMA_PATH) -> None:
    """ConfigError naming the first field of `manifest` the KubeRay v1 RayJob schema rejects.

    The schema (mempo/orchestration/kuberay_rayjob_v1.schema.json) is the subset of KubeRay's
    CRD this module writes, with unknown fields forbidden: the API server would silently
    prune a misspelt field instead.
    """
    import jsonschema

    schema = json.loads(schema_path.read_text(encoding="utf-8"))
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(manifest), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.absolute_path) or "(top level)"
        raise ConfigError(f"not a valid KubeRay v1 RayJob: {first.message}", field=where)


def kubernetes_api() -> Any:
    """`CustomObjectsApi` with the in-cluster service account, else the local kubeconfig."""
    import os

    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:  # KUBECONFIG read now: the client reads it only once, when first imported
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        except config.ConfigException as e:
            raise ConfigError(f"no Kubernetes credentials: not in a pod and no usable kubeconfig ({e})") from e
    return client.CustomObjectsApi()


def _api_error(e: Exception) -> tuple[int | None, str]:
    status = getattr(e, "status", None)
    body = getattr(e, "body", None) or ""
    try:
        message = json.loads(body).get("message", "") if body else ""
    except (ValueError, AttributeError):
        message = str(body)[:300]
    return status, message or str(getattr(e, "reason", "") or e)


def _get(api: Any, namespace: str, name: str) -> dict[str, Any] | None:
    from kubernetes.client.exceptions import ApiException

    try:
        return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def delete_rayjob(api: Any, namespace: str, name: str) -> None:
    """Delete the RayJob (its RayCluster and pods go with it, by owner reference)."""
    from kubernetes.client.exceptions import ApiException

    try:
        api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                            body={"propagationPolicy": "Foreground"})
    except ApiException as e:
        if e.status != 404:
            raise


def submit_rayjob(api: Any, manifest: Mapping[str, Any], *, poll_s: float = 2.0, gone_timeout_s: float = 300.0,
                  sleep: Callable[[float], Any] = time.sleep) -> str:
    """Create the RayJob, or pick up the one a previous attempt of this step created.

    Returns "created", "attached" (running or finished: waited for as it is) or "replaced"
    (a failed one was deleted and created anew). An existing RayJob of the same name with
    another entrypoint is a ConfigError (another run's job: never touched).
    """
    from kubernetes.client.exceptions import ApiException

    meta = manifest["metadata"]
    namespace, name = meta["namespace"], meta["name"]

    def create() -> None:
        try:
            api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, dict(manifest))
        except ApiException as e:
            status, message = _api_error(e)
            if status == 409:
                raise
            raise RayJobFailed(f"the Kubernetes API refused RayJob {name} ({status}): {message}") from e

    try:
        create()
        log.info("created RayJob %s/%s", namespace, name)
        return "created"
    except ApiException:  # 409: it exists
        pass
    existing = _get(api, namespace, name) or {}
    if (existing.get("spec") or {}).get("entrypoint") != manifest["spec"]["entrypoint"]:
        raise ConfigError(f"RayJob {namespace}/{name} exists with another entrypoint (another run?); "
                          "delete it or use another --name", field="metadata.name")
    state = RayJobState.from_object(existing)
    if not state.failed:
        log.info("attached to existing RayJob %s/%s (%s)", namespace, name, state.describe())
        return "attached"
    log.warning("RayJob %s/%s failed before (%s): deleting it and submitting again", namespace, name,
                state.describe())
    delete_rayjob(api, namespace, name)
    waited = 0.0
    while _get(api, namespace, name) is not None:
        if waited >= gone_timeout_s:
            raise RayJobFailed(f"RayJob {namespace}/{name} was not deleted within {gone_timeout_s:.0f} s")
        sleep(poll_s)
        waited += poll_s
    create()
    return "replaced"


def read_progress(path: Path | None) -> dict[str, Any] | None:
    """The trainer's `progress.json` ({"step", "total", ...}), None while there is none."""
    if path is None:
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def wait_for_rayjob(api: Any, namespace: str, name: str, *, poll_s: float, timeout_s: float,
                    progress: Path | None = None, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], Any] = time.sleep, max_api_errors: int = 10) -> RayJobState:
    """Poll the RayJob until it succeeds; log its status changes and the verl step.

    Raises RayJobFailed with KubeRay's reason and message when it fails, when it disappears,
    or (after deleting it, so the GPUs are freed) when `timeout_s` passes first, which
    covers an operator that stopped enforcing `activeDeadlineSeconds`.
    """
    start = clock()
    seen: tuple[str, str] | None = None
    step: Any = None
    api_errors = 0
    while True:
        try:
            obj = _get(api, namespace, name)
            api_errors = 0
        except Exception as e:  # noqa: BLE001 - an API hiccup must not fail a two-day job
            api_errors += 1
            status, message = _api_error(e)
            log.warning("reading RayJob %s failed (%s %s); %d of %d", name, status, message, api_errors,
                        max_api_errors)
            if api_errors >= max_api_errors:
                raise RayJobFailed(f"cannot read RayJob {namespace}/{name}: {message}") from e
            sleep(poll_s)
            continue
        if obj is None:
            raise RayJobFailed(f"RayJob {namespace}/{name} disappeared while it ran (deleted by someone?)")
        state = RayJobState.from_object(obj)
        if (state.deployment, state.job) != seen:
            seen = (state.deployment, state.job)
            log.info("RayJob %s: %s%s", name, state.describe(),
                     f" on RayCluster {state.cluster}" if state.cluster else "")
        info = read_progress(progress)
        if info and info.get("step") != step:
            step = info.get("step")
            log.info("RayJob %s: verl step %s/%s", name, step, info.get("total", "?"))
        if state.succeeded:
            return state
        if state.failed:
            raise RayJobFailed(f"RayJob {namespace}/{name} failed: {state.reason or state.job or state.deployment}"
                               + (f": {state.message}" if state.message else ""))
        if clock() - start > timeout_s:
            delete_rayjob(api, namespace, name)
            raise RayJobFailed(f"RayJob {namespace}/{name} did not finish within {timeout_s:.0f} s "
                               f"(last: {state.describe()}); deleted it")
        sleep(poll_s)


def train_on_rayjob(cluster: Any, run: TrainRun, *, template: Mapping[str, Any] | None = None,
                    api: Any = None, sleep: Callable[[float], Any] = time.sleep,
                    clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Render (or complete `template`), validate, submit, wait; return where the model is.

    Args:
        cluster: `mempo.config.ClusterParams` (poll interval, deadline; sizing unless `template`).
        run: the run's fields (`TrainRun`); `run.out` must be on the shared volume as this
            process sees it too (the merged model is checked there).
        template: a manifest from `base_rayjob` rendered earlier (the compiled Kubeflow
            pipeline carries one); default: rendered now from `cluster`.
        api: a `CustomObjectsApi` (default: `kubernetes_api()`).
    Returns:
        {"rayjob", "submitted", "status", "model", "seconds", "verl_step"}.
    """
    manifest = with_run(template if template is not None else base_rayjob(cluster), run)
    validate_rayjob(manifest)
    api = api if api is not None else kubernetes_api()
    namespace = manifest["metadata"]["namespace"]
    t0 = clock()
    how = submit_rayjob(api, manifest, sleep=sleep)
    progress = Path(run.out) / "verl" / "progress.json"
    deadline = float(manifest["spec"]["activeDeadlineSeconds"]) + 30 * 60  # + time to schedule pods
    state = wait_for_rayjob(api, namespace, run.name, poll_s=cluster.poll_s, timeout_s=deadline,
                            progress=progress, clock=clock, sleep=sleep)
    model = Path(run.out) / "model"
    if not (model / "config.json").exists():
        raise DataError("the RayJob succeeded but left no merged model (is the run volume mounted here at the "
                        "same path as in the Ray pods?)", path=model)
    info = read_progress(progress) or {}
    return {"rayjob": run.name, "submitted": how, "status": state.describe(), "model": str(model),
            "seconds": round(clock() - t0, 1), "verl_step": info.get("step")}


def _stage(src: Path, dest: Path) -> None:
    """Copy `src` (folder) to `dest` once; a retried step reuses what its first attempt staged."""
    if dest.exists():
        return
    from mempo.io import atomic_dir

    with atomic_dir(dest) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)


def train_staged(cluster: Any, template: Mapping[str, Any], *, key: str, policy: Path, data: Path,
                 model_out: Path, retriever: str, parent_run_id: str = "", overrides: Sequence[str] = (),
                 api: Any = None, sleep: Callable[[float], Any] = time.sleep) -> dict[str, Any]:
    """The Kubeflow side of the RayJob step: artifacts in, RayJob, merged model out.

    Copies the `policy` and `data` folders (the step's input artifacts) to
    `<shared mount>/kfp/<RayJob name>/` on the run volume (this pod mounts it where the Ray
    pods do), runs `train_on_rayjob` there, and copies `train/model` to `model_out` (the
    step's output artifact). `key` names the job (`job_name(key)`): the output artifact's URI,
    stable across retries of the step.
    """
    shared = Path(template["metadata"]["annotations"][ANNOTATIONS["shared_mount"]])
    name = job_name(key)
    stage = shared / "kfp" / name
    _stage(Path(policy), stage / "policy")
    _stage(Path(data), stage / "data")
    run = TrainRun(name=name, policy=str(stage / "policy"), data=str(stage / "data"), out=str(stage / "train"),
                   retriever=retriever, parent_run_id=parent_run_id, overrides=tuple(overrides))
    result = train_on_rayjob(cluster, run, template=template, api=api, sleep=sleep)
    shutil.copytree(stage / "train" / "model", model_out, dirs_exist_ok=True)
    return {**result, "model": str(model_out), "staged": str(stage)}
