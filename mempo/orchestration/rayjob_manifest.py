"""The KubeRay `RayJob` (ray.io/v1) manifest of the cluster train step: rendered and validated.

    from mempo.orchestration.rayjob_manifest import TrainRun, render_rayjob
    manifest = render_rayjob(params.cluster, TrainRun(name=..., policy=..., data=..., out=..., retriever=...))
    mempo train rayjob ... --dry-run        # prints the same, validated, and submits nothing

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

`validate_rayjob` checks it against the subset of KubeRay's CRD this module writes
(kuberay_rayjob_v1.schema.json), so a misspelt field fails here, not silently in the API
server. Pure: nothing here talks to Kubernetes (`mempo.orchestration.rayjob` submits).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mempo.errors import ConfigError

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
