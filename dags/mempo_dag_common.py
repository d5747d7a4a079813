"""Shared task factory of the mempo DAGs (listed in .airflowignore: a helper, not a DAG file).

One `mempo_task(...)` call per step. Which operator it builds is chosen when the DAG file is
parsed, from `MEMPO_AIRFLOW_MODE`:

- `local` (default): a BashOperator running the `mempo` CLI in the scheduler's environment
  (`MEMPO_CLI` names the executable; default `mempo` on PATH). Used by `airflow dags test`.
- `kubernetes`: a KubernetesPodOperator running the same CLI arguments in the stage's image
  (`MEMPO_IMAGE_REGISTRY`/`MEMPO_IMAGE_TAG`), no shell, with the run volume mounted at
  `/mnt/mempo` (plus the index volume for the index DAG) and the MLflow URI from the
  `mempo-mlflow` ConfigMap/Secret.

DAG-run params never become command text. A task's `env` maps variable names to Jinja
templates (`{"MEMPO_QA_DIR": "{{ params.qa_dir }}"}`), and its arguments refer to them as
`${MEMPO_QA_DIR}`: bash expands them inside double quotes (no word splitting, no command
substitution of the value), Kubernetes expands them as `$(MEMPO_QA_DIR)` (no shell at all).
`mempo_task` refuses an argument holding a Jinja template or an undeclared reference, so a
new task cannot bring the old `'{{ params.x }}'`-in-the-command pattern back. Values that
end up inside YAML (`--set data.sources=[...]`) are also constrained by `Param` patterns
(`PATH_PATTERN`: no quotes, spaces, braces, commas, `$`), checked when a run is triggered.

Only URIs travel between tasks: each task reads and writes folders under the run's work
dir (`{{ params.workdir }}/<run>`) and the MLflow registry; nothing else goes through XCom.
Heavy imports (the kubernetes client) happen only in kubernetes mode.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

MODE = os.environ.get("MEMPO_AIRFLOW_MODE", "local").strip().lower()
REGISTRY = os.environ.get("MEMPO_IMAGE_REGISTRY", "ghcr.io/mempo")
TAG = os.environ.get("MEMPO_IMAGE_TAG", "0.1.0")
NAMESPACE = os.environ.get("MEMPO_K8S_NAMESPACE", "mempo")
RUN_VOLUME_CLAIM = os.environ.get("MEMPO_RUN_PVC", "mempo-runs")
RUN_MOUNT = "/mnt/mempo"
# The index volume: the index DAG's build and publish pods and the retriever Deployment
# (containers/retriever/k8s/deployment.yaml) mount this one claim at this one path.
INDEX_VOLUME_CLAIM = os.environ.get("MEMPO_INDEX_PVC", "mempo-indexes")
INDEX_MOUNT = "/mnt/mempo-indexes"
CLI = os.environ.get("MEMPO_CLI", "mempo")

DEFAULT_ARGS: dict[str, Any] = {
    "owner": "mempo",
    "retries": 2,
    "retry_delay": timedelta(minutes=5),
    "retry_exponential_backoff": True,
    "max_retry_delay": timedelta(minutes=30),
}

# Param patterns: what a path, URL or name may hold (checked when a DAG run is triggered).
PATH_PATTERN = r"^[A-Za-z0-9_./:@+=-]+$"
NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"

# The run's folder name: one per DAG run, so retries and reruns overwrite only their own run.
# (Airflow's run ids match [A-Za-z0-9_.~:+-]+; ':' and '+' are replaced for the file system.)
RUN_NAME = '{{ run_id | replace(":", "-") | replace("+", "_") }}'
RUN_DIR = "{{ params.workdir }}/" + RUN_NAME

if MODE not in {"local", "kubernetes"}:
    raise ValueError(f"MEMPO_AIRFLOW_MODE must be local or kubernetes, got {MODE!r}")

_REF = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")


@dataclass(frozen=True)
class Mount:
    """A PersistentVolumeClaim mounted into a kubernetes-mode pod."""

    claim: str
    path: str
    read_only: bool = False


RUN_VOLUME = Mount(RUN_VOLUME_CLAIM, RUN_MOUNT)
INDEX_VOLUME = Mount(INDEX_VOLUME_CLAIM, INDEX_MOUNT)


def image(name: str) -> str:
    """The image of one stage, e.g. `ghcr.io/mempo/mempo-train:0.1.0` (containers/<name>)."""
    return f"{REGISTRY}/mempo-{name}:{TAG}"


def ref(name: str) -> str:
    """`${NAME}`: an argument's reference to one of the task's `env` variables."""
    return "${" + name + "}"


def check_args(args: list[str], env: dict[str, str]) -> None:
    """ValueError for a Jinja template in an argument or a reference to an undeclared variable."""
    for a in args:
        if "{{" in a or "{%" in a:
            raise ValueError(f"argument {a!r} holds a template: put it in `env` and refer to it as ${{NAME}}")
        for name in _REF.findall(a):
            if name not in env:
                raise ValueError(f"argument {a!r} refers to ${{{name}}}, which is not in the task's env")


def bash_word(arg: str) -> str:
    """`arg` as one double-quoted bash word in which only `${NAME}` references expand."""
    out, pos = [], 0
    for m in _REF.finditer(arg):
        out.append(_escape_dq(arg[pos:m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(_escape_dq(arg[pos:]))
    return '"' + "".join(out) + '"'


def _escape_dq(text: str) -> str:
    return "".join("\\" + c if c in '\\"`$' else c for c in text)


def k8s_arg(arg: str) -> str:
    """`arg` for a container's args: `${NAME}` -> `$(NAME)`, a literal `$(` -> `$$(`."""
    out, pos = [], 0
    for m in _REF.finditer(arg):
        out.append(arg[pos:m.start()].replace("$(", "$$("))
        out.append(f"$({m.group(1)})")
        pos = m.end()
    out.append(arg[pos:].replace("$(", "$$("))
    return "".join(out)


def bash_command(argv: list[str]) -> str:
    """The BashOperator command for `argv` (the first word is the executable, shell-quoted)."""
    return "exec " + " ".join([shlex.quote(argv[0]), *(bash_word(a) for a in argv[1:])])


def mempo_task(
    task_id: str,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    image_name: str = "base",
    gpus: int = 0,
    cpu: str = "2",
    memory: str = "8Gi",
    mounts: tuple[Mount, ...] = (RUN_VOLUME,),
    service_account: str | None = None,
    timeout: timedelta = timedelta(hours=2),
    doc: str = "",
    **kwargs: Any,
) -> Any:
    """One step running `mempo ARGS...`, locally or in a pod.

    `env` maps variable names to Jinja templates (rendered per run); `args` refer to them as
    `${NAME}` and hold no templates themselves. `gpus`, `cpu`, `memory`, `mounts` and
    `service_account` shape the pod (kubernetes mode only).
    """
    env = dict(env or {})
    check_args(args, env)
    common = {"task_id": task_id, "execution_timeout": timeout, "doc_md": doc or None, **kwargs}
    if MODE == "local":
        from airflow.providers.standard.operators.bash import BashOperator

        return BashOperator(
            bash_command=bash_command([CLI, *args]),
            cwd="{{ params.project_dir }}",
            env={"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **env},
            append_env=True,
            **common,
        )
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from kubernetes.client import models as k8s

    limits = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    volumes = [k8s.V1Volume(name=f"vol-{i}", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
        claim_name=m.claim, read_only=m.read_only)) for i, m in enumerate(mounts)]
    volume_mounts = [k8s.V1VolumeMount(name=f"vol-{i}", mount_path=m.path, read_only=m.read_only)
                     for i, m in enumerate(mounts)]
    return KubernetesPodOperator(
        name=f"mempo-{task_id.replace('_', '-')}",
        namespace=NAMESPACE,
        image=image(image_name),
        cmds=["mempo"],
        arguments=[k8s_arg(a) for a in args],
        env_vars={"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **env},
        env_from=[
            k8s.V1EnvFromSource(config_map_ref=k8s.V1ConfigMapEnvSource(name="mempo-mlflow")),
            k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name="mempo-mlflow", optional=True)),
            # MEMPO_RETRIEVER_TOKEN for the retrieval service (containers/retriever/k8s); required
            k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name="mempo-retriever", optional=False)),
        ],
        volumes=volumes,
        volume_mounts=volume_mounts,
        container_resources=k8s.V1ResourceRequirements(requests=limits, limits=limits),
        node_selector={"nvidia.com/gpu.present": "true"} if gpus else None,
        tolerations=[k8s.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")] if gpus else None,
        security_context=k8s.V1PodSecurityContext(run_as_non_root=True, run_as_user=10001, fs_group=10001),
        service_account_name=service_account,
        get_logs=True,
        on_finish_action="delete_succeeded_pod",
        **common,
    )


def kubectl_task(task_id: str, args: list[str], *, service_account: str, timeout: timedelta,
                 doc: str = "", **kwargs: Any) -> Any:
    """A kubernetes-mode step running `kubectl ARGS...` (exec form, no shell; constant args)."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    check_args(args, {})
    return KubernetesPodOperator(
        task_id=task_id,
        name=f"mempo-{task_id.replace('_', '-')}",
        namespace=NAMESPACE,
        image="bitnami/kubectl:1.31.4",
        cmds=["kubectl"],
        arguments=list(args),
        service_account_name=service_account,
        on_finish_action="delete_succeeded_pod",
        execution_timeout=timeout,
        doc_md=doc or None,
        **kwargs,
    )
