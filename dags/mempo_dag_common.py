"""Shared task factory of the mempo DAGs (listed in .airflowignore: a helper, not a DAG file).

One `mempo_task(...)` call per step. Which operator it builds is chosen when the DAG file is
parsed, from `MEMPO_AIRFLOW_MODE`:

- `local` (default): a BashOperator running the `mempo` CLI in the scheduler's environment
  (`MEMPO_CLI` names the executable; default `mempo` on PATH). Used by `airflow dags test`.
- `kubernetes`: a KubernetesPodOperator running the same CLI arguments in the stage's image
  (`MEMPO_IMAGE_REGISTRY`/`MEMPO_IMAGE_TAG`), with the shared run volume mounted at
  `/mnt/mempo` and the MLflow URI from the `mempo-mlflow` ConfigMap/Secret.

Only URIs travel between tasks: each task reads and writes folders under the run's work
dir (`{{ params.workdir }}/<run>`) and the MLflow registry; nothing else goes through XCom.
Heavy imports (the kubernetes client) happen only in kubernetes mode.
"""

from __future__ import annotations

import os
import shlex
from datetime import timedelta
from typing import Any

MODE = os.environ.get("MEMPO_AIRFLOW_MODE", "local").strip().lower()
REGISTRY = os.environ.get("MEMPO_IMAGE_REGISTRY", "ghcr.io/mempo")
TAG = os.environ.get("MEMPO_IMAGE_TAG", "0.1.0")
NAMESPACE = os.environ.get("MEMPO_K8S_NAMESPACE", "mempo")
RUN_VOLUME_CLAIM = os.environ.get("MEMPO_RUN_PVC", "mempo-runs")
RUN_MOUNT = "/mnt/mempo"
CLI = os.environ.get("MEMPO_CLI", "mempo")

DEFAULT_ARGS: dict[str, Any] = {
    "owner": "mempo",
    "retries": 2,
    "retry_delay": timedelta(minutes=5),
    "retry_exponential_backoff": True,
    "max_retry_delay": timedelta(minutes=30),
}

# The run's folder: one per DAG run, so retries and reruns overwrite only their own run.
RUN_DIR = '{{ params.workdir }}/{{ run_id | replace(":", "-") | replace("+", "_") }}'

if MODE not in {"local", "kubernetes"}:
    raise ValueError(f"MEMPO_AIRFLOW_MODE must be local or kubernetes, got {MODE!r}")


def image(name: str) -> str:
    """The image of one stage, e.g. `ghcr.io/mempo/mempo-train:0.1.0` (containers/<name>)."""
    return f"{REGISTRY}/mempo-{name}:{TAG}"


def mempo_task(
    task_id: str,
    args: list[str],
    *,
    image_name: str = "base",
    gpus: int = 0,
    cpu: str = "2",
    memory: str = "8Gi",
    timeout: timedelta = timedelta(hours=2),
    doc: str = "",
    **kwargs: Any,
) -> Any:
    """One step running `mempo ARGS...` (Jinja-templated), locally or in a pod.

    `gpus`, `cpu`, `memory` are the pod's requests/limits (kubernetes mode only).
    """
    common = {"task_id": task_id, "execution_timeout": timeout, "doc_md": doc or None, **kwargs}
    if MODE == "local":
        from airflow.providers.standard.operators.bash import BashOperator

        return BashOperator(
            bash_command=" ".join(shlex.quote(a) for a in [CLI, *args]),
            cwd="{{ params.project_dir }}",
            env={"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            append_env=True,
            **common,
        )
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from kubernetes.client import models as k8s

    limits = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return KubernetesPodOperator(
        name=f"mempo-{task_id.replace('_', '-')}",
        namespace=NAMESPACE,
        image=image(image_name),
        cmds=["mempo"],
        arguments=args,
        env_vars={"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
        env_from=[
            k8s.V1EnvFromSource(config_map_ref=k8s.V1ConfigMapEnvSource(name="mempo-mlflow")),
            k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name="mempo-mlflow", optional=True)),
            # MEMPO_RETRIEVER_TOKEN for the retrieval service (containers/retriever/k8s); required
            k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name="mempo-retriever", optional=False)),
        ],
        volumes=[k8s.V1Volume(
            name="runs",
            persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=RUN_VOLUME_CLAIM),
        )],
        volume_mounts=[k8s.V1VolumeMount(name="runs", mount_path=RUN_MOUNT)],
        container_resources=k8s.V1ResourceRequirements(requests=limits, limits=limits),
        node_selector={"nvidia.com/gpu.present": "true"} if gpus else None,
        tolerations=[k8s.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")] if gpus else None,
        security_context=k8s.V1PodSecurityContext(run_as_non_root=True, run_as_user=10001, fs_group=10001),
        get_logs=True,
        on_finish_action="delete_succeeded_pod",
        **common,
    )
