"""Where MLflow runs go: the project folder, the tracking URI, the artifact root, experiments.

    from mempo.tracking.where import configure, tracking_uri
    configure()          # points mlflow at tracking_uri() and returns it

`MLFLOW_TRACKING_URI` if set, else `sqlite:///<project>/mlflow.db` with artifacts under
`<project>/mlartifacts` (`MLFLOW_ARTIFACTS_DESTINATION` overrides the artifact folder for new
experiments). The project folder is `MEMPO_PROJECT_ROOT`, else `DVC_ROOT` (set by
`dvc repro`), else the nearest parent of the working directory holding `dvc.yaml`, else the
working directory. `MEMPO_TRACKING=0` turns tracking off (`tracking_enabled`).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_PARENT_RUN = "MEMPO_PARENT_RUN_ID"
ENV_PROJECT_ROOT = "MEMPO_PROJECT_ROOT"
ENV_TRACKING_OFF = "MEMPO_TRACKING"
DEFAULT_EXPERIMENT = "mempo"


def project_root(start: str | Path | None = None) -> Path:
    """The project folder: `MEMPO_PROJECT_ROOT`, `DVC_ROOT`, the nearest parent with dvc.yaml, or cwd."""
    for var in (ENV_PROJECT_ROOT, "DVC_ROOT"):
        if os.environ.get(var):
            return Path(os.environ[var]).resolve()
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "dvc.yaml").exists():
            return folder
    return here


def tracking_uri(root: str | Path | None = None) -> str:
    """`MLFLOW_TRACKING_URI`, else `sqlite:///<project>/mlflow.db` (an absolute path)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{project_root(root) / 'mlflow.db'}"


def artifact_root(root: str | Path | None = None, experiment: str | None = None) -> str | None:
    """Where a new experiment keeps artifacts, or None to let a tracking server decide.

    `MLFLOW_ARTIFACTS_DESTINATION` if set, else for a local store `<project>/mlartifacts`,
    then `/<experiment>` when given; for an http(s) server None (the server's
    `--artifacts-destination` applies).
    """
    env = os.environ.get("MLFLOW_ARTIFACTS_DESTINATION")
    if env:
        base = env if "://" in env else Path(env).resolve().as_uri()
    elif tracking_uri(root).startswith(("http://", "https://", "databricks")):
        return None
    else:
        base = (project_root(root) / "mlartifacts").as_uri()
    return f"{base.rstrip('/')}/{experiment}" if experiment else base


def tracking_enabled() -> bool:
    """False when `MEMPO_TRACKING=0` (or `false`/`off`)."""
    return os.environ.get(ENV_TRACKING_OFF, "1").strip().lower() not in {"0", "false", "off", "no"}


def configure(root: str | Path | None = None) -> str:
    """Point the mlflow client at `tracking_uri(root)` and return that URI."""
    import mlflow

    uri = tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    return uri


def use_tracking(mlflow_uri: str = "", parent_run_id: str = "") -> None:
    """Send this process's stage runs to `mlflow_uri`, nested under `parent_run_id`.

    For orchestrator steps (the KFP components) that get both as parameters. An empty value
    leaves the environment as it is: the pod's own `MLFLOW_TRACKING_URI`, no parent run.
    """
    if mlflow_uri:
        os.environ["MLFLOW_TRACKING_URI"] = mlflow_uri
    if parent_run_id:
        os.environ[ENV_PARENT_RUN] = parent_run_id


def ensure_experiment(name: str = DEFAULT_EXPERIMENT, root: str | Path | None = None) -> str:
    """The id of experiment `name`, created (with `artifact_root`) if missing. Race-safe."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri(root))
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_root(root, name))
    except MlflowException:
        # Another process created it between our lookup and create.
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id
