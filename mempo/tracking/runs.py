"""Run lifecycle: the pipeline's parent run and each stage's nested run, ended FAILED on error.

    from mempo.tracking.runs import pipeline_run, stage_run
    with pipeline_run("pipe") as parent_id:      # exports MEMPO_PARENT_RUN_ID meanwhile
        with stage_run("train", params=params, data={"train_data": "data/prepared"}) as run:
            ...

Nesting: `mempo pipeline run` opens one parent run and exports its id as
`MEMPO_PARENT_RUN_ID`; every stage run started in a child process (DVC, KFP, Airflow) is
created as a nested run of it, in the parent's experiment. Inside one process a stage run
started while another run is active nests under that run instead. Each stage run is tagged
with `mempo.stage`, `dvc.stage` (from `DVC_STAGE`), the git commit and the hashes of its named
inputs (`mempo.tracking.lineage`), and logs its params flattened and its wall time as the
metric `stage_wall_s` (also a failed one); `stage_wall_times` reads them back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mempo.io import flatten
from mempo.tracking.lineage import (
    MAX_PARAM_CHARS,
    MAX_TAG_CHARS,
    clip_text,
    data_hashes,
    git_commit,
    numerics_tags,
)
from mempo.tracking.where import (
    DEFAULT_EXPERIMENT,
    ENV_PARENT_RUN,
    configure,
    ensure_experiment,
    tracking_enabled,
    tracking_uri,
)

if TYPE_CHECKING:  # mlflow is imported lazily: `mempo --help` must not pay for it
    import mlflow

log = logging.getLogger(__name__)

STAGE_WALL_METRIC = "stage_wall_s"


def _flat_params(params: Any) -> dict[str, Any]:
    """`{"section.key": value}` of a pydantic model or a mapping (the walk is `io.flatten`)."""
    if params is None:
        return {}
    if hasattr(params, "model_dump"):
        return flatten(params.model_dump(mode="json"))
    if isinstance(params, Mapping):
        return flatten(params)
    raise TypeError(f"params must be a pydantic model or a mapping, got {type(params).__name__}")


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
        stage: the stage name (`train`, `eval`, ...); also the run name unless `run_name`, or,
            under DVC, the DVC stage's (so `sft_full` runs the `sft` code in a run named `sft_full`).
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
        **numerics_tags(),
    }
    if os.environ.get("DVC_STAGE"):
        all_tags["dvc.stage"] = os.environ["DVC_STAGE"]
    if data:
        all_tags.update(data_hashes(data, root))
    all_tags.update(tags or {})
    all_tags = {k: clip_text(v, MAX_TAG_CHARS) for k, v in all_tags.items()}

    # When nesting across processes there is no active parent in this process: passing
    # parent_run_id sets the mlflow.parentRunId tag, which is what the UI nests by.
    run = mlflow.start_run(
        experiment_id=exp_id,
        run_name=run_name or os.environ.get("DVC_STAGE") or stage,
        nested=active is not None,
        parent_run_id=None if active is not None else parent_id,
        tags=all_tags,
    )
    t0 = time.perf_counter()
    try:
        flat = _flat_params(params)
        if flat:
            mlflow.log_params({k: clip_text(v, MAX_PARAM_CHARS) for k, v in flat.items()})
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
    """`{stage: wall seconds}` of the stage runs nested under `parent_run_id`, in start order
    (runs without the `stage_wall_s` metric are left out). A run is named by its DVC stage
    (the `dvc.stage` tag: `sft_full` runs the `sft` code), else by its run name; a name seen
    before gets `#2`, `#3`, so no run's time is lost."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri(root))
    parent = client.get_run(parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
        order_by=["attributes.start_time ASC"], max_results=1000,
    )
    times: dict[str, float] = {}
    for r in children:
        if STAGE_WALL_METRIC not in r.data.metrics:
            continue
        name = r.data.tags.get("dvc.stage") or r.info.run_name
        key, n = name, 1
        while key in times:
            n += 1
            key = f"{name}#{n}"
        times[key] = r.data.metrics[STAGE_WALL_METRIC]
    return times


def active_run_id() -> str | None:
    """The id of the active MLflow run in this process, or None (also when tracking is off)."""
    if not tracking_enabled():
        return None
    import mlflow

    run = mlflow.active_run()
    return run.info.run_id if run else None
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
        **numerics_tags(),
        **{k: clip_text(v, MAX_TAG_CHARS) for k, v in (tags or {}).items()},
    }
    # Created through the client, not mlflow.start_run: the parent must not become the
    # active run of this process (stage runs here would nest twice).
    run = client.create_run(exp_id, run_name=name, tags=all_tags)
    run_id = run.info.run_id
    for k, v in _flat_params(params).items():
        client.log_param(run_id, k, clip_text(v, MAX_PARAM_CHARS))
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
