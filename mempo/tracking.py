"""MLflow lineage for every stage: where runs go, how a stage run nests, what it is tagged with.

    from mempo.tracking import stage_run, log_metrics, log_json, log_plot

    with stage_run("train", params=params, data={"train_data": "data/prepared"}) as run:
        log_metrics({"loss": 0.3}, step=10)
        log_json({"eval_em": 0.41}, "metrics.json")
        log_plot("outputs/train/plots/reward.png")

Where runs go: `MLFLOW_TRACKING_URI` if set, else `sqlite:///<project>/mlflow.db` with
artifacts under `<project>/mlartifacts` (`MLFLOW_ARTIFACTS_DESTINATION` overrides the
artifact folder for new experiments). The project folder is `MEMPO_PROJECT_ROOT`, else
`DVC_ROOT` (set by `dvc repro`), else the nearest parent of the working directory holding
`dvc.yaml`, else the working directory.

Nesting: `mempo pipeline run` opens one parent run and exports its id as
`MEMPO_PARENT_RUN_ID`; every stage run started in a child process (DVC, KFP, Airflow) is
created as a nested run of it, in the parent's experiment. Inside one process a stage run
started while another run is active nests under that run instead.

Tags on every stage run: `mempo.stage`, `dvc.stage` (from `DVC_STAGE`), the git commit
(`mlflow.source.git.commit`, plus `mempo.git_dirty`), the stage's params flattened, the
sha256 of each named input (`data.<name>.sha256`, or DVC's md5 from dvc.lock when an upstream
stage already hashed that path). DVC records a stage's own hashes only after the stage ends,
so `mempo pipeline run` adds them (`dvc.deps.*`, `dvc.outs.*`, `dvc.params.sha256`) to each
stage run after `dvc repro` (`tag_stage_runs_with_dvc_hashes`).
A stage run that raises ends FAILED and the exception propagates. Every stage run gets its
wall time as the metric `stage_wall_s` (also a failed one); `stage_wall_times` reads them
back for the pipeline summary.

Set `MEMPO_TRACKING=0` to turn tracking off entirely (stage runs become no-ops).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mempo.errors import MempoError

if TYPE_CHECKING:  # mlflow is imported lazily: `mempo --help` must not pay for it
    import mlflow

log = logging.getLogger(__name__)

ENV_PARENT_RUN = "MEMPO_PARENT_RUN_ID"
ENV_PROJECT_ROOT = "MEMPO_PROJECT_ROOT"
ENV_TRACKING_OFF = "MEMPO_TRACKING"
DEFAULT_EXPERIMENT = "mempo"
STAGE_WALL_METRIC = "stage_wall_s"
# MLflow's limits: param values <= 6000 chars, tag values <= 8000 chars.
_MAX_PARAM_CHARS = 6000
_MAX_TAG_CHARS = 8000


# ---------------------------------------------------------------------------- where


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


# ---------------------------------------------------------------------------- lineage facts


def git_commit(root: str | Path | None = None) -> tuple[str, bool]:
    """(commit sha, dirty) of the project checkout; ("unknown", False) outside git.

    `MEMPO_GIT_COMMIT` wins (containers have no .git; the image label sets it).
    """
    if os.environ.get("MEMPO_GIT_COMMIT"):
        return os.environ["MEMPO_GIT_COMMIT"], False
    cwd = project_root(root)
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=cwd, capture_output=True, text=True, check=True,
            ).stdout.strip()
        )
        return sha, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def _dvc_lock(root: Path) -> dict[str, Any]:
    import yaml

    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    try:
        return yaml.safe_load(lock.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError:
        return {}


def dvc_recorded_hashes(root: str | Path | None = None) -> dict[str, str]:
    """`{path: md5}` for every dep and out DVC recorded in dvc.lock (paths relative to root)."""
    out: dict[str, str] = {}
    for stage in (_dvc_lock(project_root(root)).get("stages") or {}).values():
        for entry in [*(stage.get("deps") or []), *(stage.get("outs") or [])]:
            if isinstance(entry, dict) and "path" in entry and "md5" in entry:
                out[str(entry["path"])] = str(entry["md5"])
    return out


def dvc_stage_hashes(stage: str, root: str | Path | None = None) -> dict[str, str]:
    """The hashes dvc.lock holds for `stage` (its deps, outs and params digest); {} if none yet."""
    entry = (_dvc_lock(project_root(root)).get("stages") or {}).get(stage) or {}
    out: dict[str, str] = {}
    for kind in ("deps", "outs"):
        for item in entry.get(kind) or []:
            if isinstance(item, dict) and "md5" in item:
                out[f"dvc.{kind}.{item['path']}"] = str(item["md5"])
    if entry.get("params"):
        blob = json.dumps(entry["params"], sort_keys=True, default=str)
        out["dvc.params.sha256"] = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return out


def tag_stage_runs_with_dvc_hashes(parent_run_id: str, root: str | Path | None = None) -> int:
    """Tag every stage run under `parent_run_id` that ran as a DVC stage with the hashes
    dvc.lock now holds for that stage. Returns how many runs were tagged."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri(root))
    parent = client.get_run(parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'", max_results=1000
    )
    n = 0
    for run in children:
        stage = run.data.tags.get("dvc.stage")
        hashes = dvc_stage_hashes(stage, root) if stage else {}
        for key, value in hashes.items():
            client.set_tag(run.info.run_id, key, _clip(value, _MAX_TAG_CHARS))
        n += bool(hashes)
    return n


def path_hash(path: str | Path) -> str:
    """sha256 of a file, or of a folder (sorted relative paths + each file's sha256)."""
    from mempo.io import sha256_file

    p = Path(path)
    if not p.exists():
        raise MempoError("cannot hash a missing input", path=p)
    if p.is_file():
        return sha256_file(p)
    h = hashlib.sha256()
    for f in sorted(q for q in p.rglob("*") if q.is_file()):
        h.update(f.relative_to(p).as_posix().encode())
        h.update(b"\0")
        h.update(sha256_file(f).encode())
        h.update(b"\n")
    return h.hexdigest()


def data_hashes(data: Mapping[str, str | Path], root: str | Path | None = None) -> dict[str, str]:
    """`{"data.<name>.sha256" or "data.<name>.md5": hash, "data.<name>.path": path}` per input.

    A path DVC already hashed (in dvc.lock) reuses DVC's md5 instead of rereading the bytes.
    """
    base = project_root(root)
    recorded = dvc_recorded_hashes(base)
    tags: dict[str, str] = {}
    for name, path in data.items():
        p = Path(path)
        rel = p.resolve().relative_to(base).as_posix() if p.resolve().is_relative_to(base) else str(p)
        tags[f"data.{name}.path"] = rel
        if rel in recorded:
            tags[f"data.{name}.md5"] = recorded[rel]
        else:
            tags[f"data.{name}.sha256"] = path_hash(p)
    return tags


def _flat_params(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if hasattr(params, "model_dump"):
        dumped = params.model_dump(mode="json")
    elif isinstance(params, Mapping):
        dumped = dict(params)
    else:
        raise TypeError(f"params must be a pydantic model or a mapping, got {type(params).__name__}")
    out: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = obj

    walk("", dumped)
    return out


def _clip(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------- runs


class _NoRun:
    """Stands in for an MLflow run when tracking is off; `info.run_id` is None."""

    class info:  # noqa: N801 - mirrors mlflow.ActiveRun.info
        run_id = None
        experiment_id = None


@contextlib.contextmanager
def stage_run(
    stage: str,
    *,
    params: Any = None,
    data: Mapping[str, str | Path] | None = None,
    tags: Mapping[str, Any] | None = None,
    experiment: str | None = None,
    run_name: str | None = None,
    root: str | Path | None = None,
) -> Iterator[mlflow.ActiveRun | _NoRun]:
    """Open an MLflow run for one stage, tagged with its lineage, nested under the pipeline run.

    Args:
        stage: the stage name (`train`, `eval`, ...); also the run name unless `run_name`.
        params: the stage's params section (pydantic) or a mapping; logged as params, flattened.
        data: named input paths to hash into `data.<name>.*` tags.
        tags: extra tags.
        experiment: experiment name; default: the parent run's experiment, else `MLFLOW_EXPERIMENT_NAME`, else "mempo".
        root: the project folder (default: `project_root()`).

    Yields the active run. On an exception the run ends FAILED and the exception propagates.
    The block's wall time is logged as the metric `stage_wall_s` (seconds) either way.
    """
    if not tracking_enabled():
        yield _NoRun()
        return
    import mlflow

    configure(root)
    client = mlflow.MlflowClient()
    parent_id: str | None = None
    active = mlflow.active_run()
    if active is not None:
        parent_id = active.info.run_id
    elif os.environ.get(ENV_PARENT_RUN):
        parent_id = os.environ[ENV_PARENT_RUN]
    if parent_id is not None and experiment is None:
        try:
            exp_id = client.get_run(parent_id).info.experiment_id
        except Exception as e:  # noqa: BLE001 - a stale parent id must not stop the stage
            log.warning("parent run %s not found (%s); starting a top-level run", parent_id, e)
            parent_id = None
            exp_id = ensure_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT), root)
    else:
        exp_id = ensure_experiment(experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT), root)

    sha, dirty = git_commit(root)
    all_tags: dict[str, Any] = {
        "mempo.stage": stage,
        "mlflow.source.git.commit": sha,
        "mempo.git_commit": sha,
        "mempo.git_dirty": str(dirty).lower(),
    }
    if os.environ.get("DVC_STAGE"):
        all_tags["dvc.stage"] = os.environ["DVC_STAGE"]
    if data:
        all_tags.update(data_hashes(data, root))
    all_tags.update(tags or {})
    all_tags = {k: _clip(v, _MAX_TAG_CHARS) for k, v in all_tags.items()}

    # When nesting across processes there is no active parent in this process: passing
    # parent_run_id sets the mlflow.parentRunId tag, which is what the UI nests by.
    run = mlflow.start_run(
        experiment_id=exp_id,
        run_name=run_name or stage,
        nested=active is not None,
        parent_run_id=None if active is not None else parent_id,
        tags=all_tags,
    )
    t0 = time.perf_counter()
    try:
        flat = _flat_params(params)
        if flat:
            mlflow.log_params({k: _clip(v, _MAX_PARAM_CHARS) for k, v in flat.items()})
        yield run
    except BaseException:
        _log_wall_time(client, run.info.run_id, t0)
        mlflow.end_run(status="FAILED")
        raise
    else:
        _log_wall_time(client, run.info.run_id, t0)
        mlflow.end_run(status="FINISHED")


def _log_wall_time(client: Any, run_id: str, t0: float) -> None:
    # Through the client with an explicit run id: the block may have ended or switched the
    # active run (nested runs), and a failure to log must not mask the stage's own outcome.
    try:
        client.log_metric(run_id, STAGE_WALL_METRIC, round(time.perf_counter() - t0, 3))
    except Exception as e:  # noqa: BLE001
        log.warning("could not log %s to run %s: %s", STAGE_WALL_METRIC, run_id, e)


def stage_wall_times(parent_run_id: str, root: str | Path | None = None) -> dict[str, float]:
    """`{stage run name: wall seconds}` of the stage runs nested under `parent_run_id`, in
    start order (runs without the `stage_wall_s` metric are left out)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri(root))
    parent = client.get_run(parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
        order_by=["attributes.start_time ASC"], max_results=1000,
    )
    return {r.info.run_name: r.data.metrics[STAGE_WALL_METRIC] for r in children
            if STAGE_WALL_METRIC in r.data.metrics}


def active_run_id() -> str | None:
    """The id of the active MLflow run in this process, or None (also when tracking is off)."""
    if not tracking_enabled():
        return None
    import mlflow

    run = mlflow.active_run()
    return run.info.run_id if run else None


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, prefix: str = "") -> dict[str, float]:
    """Log every numeric entry of `metrics` (nested dicts flattened with "/"); skips the rest.

    Returns what was logged. A no-op without an active run or with tracking off.
    """
    flat: dict[str, float] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{key}/{k}" if key else str(k), v)
        elif isinstance(value, bool):
            flat[key] = float(value)
        elif isinstance(value, int | float):
            flat[key] = float(value)

    walk(prefix.rstrip("/"), metrics)
    if not flat or active_run_id() is None:
        return flat
    import mlflow

    # Metric keys allow alphanumerics, _ - . space / only.
    safe = {"".join(c if c.isalnum() or c in "_-. /" else "_" for c in k): v for k, v in flat.items()}
    mlflow.log_metrics(safe, step=step)
    return safe


def log_json(obj_or_path: Any, artifact_file: str | None = None) -> None:
    """Log a JSON artifact: a path to an existing .json file, or an object to serialise.

    `artifact_file` is the name inside the run's artifacts (default: the file's name).
    """
    if active_run_id() is None:
        return
    import mlflow

    if isinstance(obj_or_path, str | Path) and Path(obj_or_path).is_file():
        p = Path(obj_or_path)
        if artifact_file is None or artifact_file == p.name:
            mlflow.log_artifact(str(p))
        else:
            folder = str(Path(artifact_file).parent) if Path(artifact_file).parent != Path(".") else None
            with tempfile.TemporaryDirectory() as tmp:
                dst = Path(tmp) / Path(artifact_file).name
                dst.write_bytes(p.read_bytes())
                mlflow.log_artifact(str(dst), artifact_path=folder)
        return
    mlflow.log_dict(obj_or_path, artifact_file or "data.json")


def log_plot(path: str | Path, artifact_path: str = "plots") -> None:
    """Log a PNG (or every PNG in a folder) under `artifact_path`."""
    if active_run_id() is None:
        return
    import mlflow

    p = Path(path)
    if p.is_dir():
        for png in sorted(p.glob("*.png")):
            mlflow.log_artifact(str(png), artifact_path=artifact_path)
    elif p.is_file():
        mlflow.log_artifact(str(p), artifact_path=artifact_path)
    else:
        raise MempoError("plot not found", path=p)


def log_file(path: str | Path, artifact_path: str | None = None) -> None:
    """Log any file or folder as an artifact (folders recursively)."""
    if active_run_id() is None:
        return
    import mlflow

    p = Path(path)
    if p.is_dir():
        mlflow.log_artifacts(str(p), artifact_path=artifact_path)
    else:
        mlflow.log_artifact(str(p), artifact_path=artifact_path)


@contextlib.contextmanager
def pipeline_run(
    name: str = "pipeline",
    *,
    params: Any = None,
    experiment: str | None = None,
    tags: Mapping[str, Any] | None = None,
    root: str | Path | None = None,
) -> Iterator[str | None]:
    """The parent run of one pipeline execution; exports `MEMPO_PARENT_RUN_ID` meanwhile.

    Yields the run id (None when tracking is off). Child processes started inside the block
    (dvc repro's stages) nest their stage runs under it. Ends FAILED on an exception.
    """
    if not tracking_enabled():
        yield None
        return
    from mlflow import MlflowClient

    configure(root)
    client = MlflowClient()
    exp_id = ensure_experiment(experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT), root)
    sha, dirty = git_commit(root)
    all_tags = {
        "mempo.stage": "pipeline",
        "mlflow.source.git.commit": sha,
        "mempo.git_commit": sha,
        "mempo.git_dirty": str(dirty).lower(),
        **{k: _clip(v, _MAX_TAG_CHARS) for k, v in (tags or {}).items()},
    }
    # Created through the client, not mlflow.start_run: the parent must not become the
    # active run of this process (stage runs here would nest twice).
    run = client.create_run(exp_id, run_name=name, tags=all_tags)
    run_id = run.info.run_id
    for k, v in _flat_params(params).items():
        client.log_param(run_id, k, _clip(v, _MAX_PARAM_CHARS))
    previous = os.environ.get(ENV_PARENT_RUN)
    os.environ[ENV_PARENT_RUN] = run_id
    try:
        yield run_id
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    else:
        client.set_terminated(run_id, status="FINISHED")
    finally:
        if previous is None:
            os.environ.pop(ENV_PARENT_RUN, None)
        else:
            os.environ[ENV_PARENT_RUN] = previous
