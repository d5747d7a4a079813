"""The cluster train step: submit the KubeRay `RayJob` that runs `mempo train verl`, wait for it.

    mempo train rayjob --policy /mnt/mempo/runs/R/sft/model --data /mnt/mempo/runs/R/data \
        --out /mnt/mempo/runs/R/train --retriever http://mempo-retriever.mempo.svc.cluster.local:8013
    mempo train rayjob ... --dry-run        # print the validated RayJob, submit nothing

The Airflow `mempo_retrain` DAG (kubernetes mode) and the cluster Kubeflow pipeline call
`train_on_rayjob` / `train_staged`; the CPU pipeline, `make run` and the local DAG keep the
local trainer. The manifest itself (what the RayJob holds) is built and validated in
`mempo.orchestration.rayjob_manifest`.

Submission goes through the Kubernetes Python client's `CustomObjectsApi` (pinned in
requirements.lock); `api` arguments take anything with its `create/get/delete_namespaced_
custom_object` methods. A retried step finds its RayJob by name: a running or finished one is
attached to, a failed one is replaced. While waiting, the step logs every status change and
the verl step the trainer writes to `<out>/verl/progress.json` (mempo.verl_plugin.trainer);
it fails with KubeRay's reason and message (`DeadlineExceeded`, `AppFailed`, ...).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mempo.errors import ConfigError, DataError, MempoError
from mempo.orchestration.rayjob_manifest import (
    ANNOTATIONS,
    GROUP,
    PLURAL,
    VERSION,
    TrainRun,
    base_rayjob,
    job_name,
    validate_rayjob,
    with_run,
)

log = logging.getLogger(__name__)


class RayJobFailed(MempoError):
    """The RayJob failed, was deleted, or did not finish within its deadline."""


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
