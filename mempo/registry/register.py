"""Register a trained policy as an MLflow logged model and a model version, with its evidence.

    mempo register --model-dir outputs/train/model --metrics outputs/eval/metrics.json

`register_model` logs the model folder as an MLflow 3 logged model (source run: the training
run; its metrics: the full evaluation, each from the eval run and tied to its benchmark as a
dataset whose digest is the eval set's hash) and creates a model version pointing at it. The
version's tags (see `mempo.registry.evidence`) add git commit, data versions (`data.<name>.*`),
the run ids and the `registration_key` (sha256 of model + metrics) that makes a retried
registration return the version it already created.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mempo.errors import DataError, MempoError
from mempo.registry.evidence import (
    DIGEST_CHARS,
    HEADLINE_TAG_PREFIX,
    METRIC_TAG_PREFIX,
    eval_set_fingerprints,
    eval_set_tags,
    logged_model_id,
    read_metrics_file,
)
from mempo.registry.gate import GateConfig, gate_evidence, split_metric_key
from mempo.registry.store import mlflow_client, promotion_lock

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

KEY_TAG = "registration_key"


def _find_stage_run(client: MlflowClient, stage: str, parent_id: str) -> str | None:
    """The newest run of `stage` under pipeline run `parent_id`: the one DVC ran as that stage
    (tags `dvc.stage` and `mempo.stage` both `<stage>`), else the newest tagged
    `mempo.stage=<stage>`. So under DVC not a `train_full` run, which runs the train code
    beside `train` and may start later."""
    try:
        exp = client.get_run(parent_id).info.experiment_id
    except Exception:  # noqa: BLE001 - a stale parent id: no run to find
        return None
    under = f"tags.`mempo.stage` = '{stage}' and tags.`mlflow.parentRunId` = '{parent_id}'"
    for filt in (f"tags.`dvc.stage` = '{stage}' and {under}", under):
        runs = client.search_runs([exp], filt, order_by=["attributes.start_time DESC"], max_results=1)
        if runs:
            return runs[0].info.run_id
    return None


def _recorded_run_id(path: Path) -> str | None:
    """The `mlflow_run_id` a stage wrote into its own output (train metrics.json, eval.json)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("mlflow_run_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def _resolve_run(client: MlflowClient, stage: str, given: str | None, recorded_in: Path | None,
                 parent: str | None) -> str | None:
    """The run of `stage` that produced what is being registered, never a guess: the id given,
    else the one the stage recorded in its output, else the stage's run under this pipeline
    run. An id this store does not know is dropped with a warning."""
    from mlflow.exceptions import MlflowException

    run_id = given or (recorded_in and _recorded_run_id(recorded_in)) or (
        parent and _find_stage_run(client, stage, parent)) or None
    if run_id is None:
        log.warning("register: no %s run id given, recorded in %s or under a pipeline run; the version "
                    "is not linked to a %s run (pass --%s-run-id)", stage, recorded_in, stage,
                    "source" if stage == "train" else stage)
        return None
    try:
        client.get_run(run_id)
    except MlflowException:
        if given:
            raise MempoError(f"{stage} run '{run_id}' not found in the tracking store") from None
        log.warning("register: %s run %s (from %s) is not in this tracking store; not linked",
                    stage, run_id, recorded_in)
        return None
    return run_id


@dataclass(frozen=True)
class RegisteredVersion:
    """What `register_model` created (or found: a retry of the same registration)."""

    name: str
    version: str
    model_uri: str
    run_id: str | None
    source: str
    model_id: str | None = None
    registration_key: str = ""
    source_run_id: str | None = None
    eval_run_id: str | None = None
    created: bool = True


def _existing_version(client: MlflowClient, name: str, key: str) -> Any | None:
    from mlflow.exceptions import MlflowException

    try:
        found = client.search_model_versions(f"name = '{name}' and tags.`{KEY_TAG}` = '{key}'")
    except MlflowException:
        return None
    return min(found, key=lambda v: int(v.version)) if found else None


def _as_registered(mv: Any, created: bool) -> RegisteredVersion:
    tags = mv.tags or {}
    return RegisteredVersion(
        mv.name, str(mv.version), f"models:/{mv.name}/{mv.version}", tags.get("register_run_id") or None,
        mv.source, logged_model_id(mv), tags.get(KEY_TAG, ""),
        tags.get("source_run_id") or None, tags.get("eval_run_id") or None, created,
    )


def register_model(
    name: str,
    model_dir: str | Path,
    metrics_path: str | Path,
    *,
    data: Mapping[str, str | Path] | None = None,
    source_run_id: str | None = None,
    eval_run_id: str | None = None,
    train_metrics_path: str | Path | None = None,
    gate: GateConfig | None = None,
    params: Any = None,
    out: str | Path | None = None,
    headline_out: str | Path | None = None,
) -> RegisteredVersion:
    """Register `model_dir` as a version of model `name`, with its evidence.

    The model becomes an MLflow logged model (its artifacts the HF folder; its source run
    the training run) whose metrics are the full evaluation, linked to the eval run and to
    each benchmark as a dataset; the version points at it. Version tags stay few: the gate's
    evidence (`metric.*`, `eval_set.*`), the headline numbers (`headline.*`), git commit, data
    versions and the run ids.

    Runs are linked only when known: `source_run_id` / `eval_run_id` as given, else the ids
    the stages recorded in their outputs (`mlflow_run_id` in the train metrics.json and the
    eval.json beside `metrics_path`), else the stage runs under this pipeline run
    (`MEMPO_PARENT_RUN_ID`). Never the newest run found elsewhere.

    Idempotent: the sha256 of the model folder and the metrics file is the version's
    `registration_key`; registering the same pair again returns the existing version.
    Writes registered.json to `out` and the headline table to `headline_out` when given.
    Raises `DataError` for a missing model folder or metrics file.
    """
    import mlflow
    from mlflow.entities import LoggedModelInput, LoggedModelOutput, LoggedModelStatus, Metric
    from mlflow.exceptions import MlflowException
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    from mempo.headline import headline_metrics
    from mempo.io import sha256_file, write_json
    from mempo.tracking import ENV_PARENT_RUN, data_hashes, git_commit, path_hash, stage_run

    model_dir, metrics_path = Path(model_dir), Path(metrics_path)
    if not model_dir.is_dir() or not any(model_dir.iterdir()):
        raise DataError("model folder is missing or empty (run the train stage first)", path=model_dir)
    metrics = read_metrics_file(metrics_path)
    gate = gate or GateConfig()
    train_metrics: dict[str, Any] = {}
    if train_metrics_path is not None and Path(train_metrics_path).is_file():
        try:
            train_metrics = json.loads(Path(train_metrics_path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"not valid JSON: {e.msg}", path=train_metrics_path, row=e.lineno) from e
    headline = headline_metrics(metrics, train_metrics)
    samples = metrics_path.parent / "samples.parquet"
    eval_sets = eval_set_fingerprints(samples) if samples.is_file() else None
    if eval_sets is None:
        log.warning("register: no samples.parquet beside %s; the version records no eval set, so the "
                    "gate cannot compare it with a champion", metrics_path)
    model_sha = path_hash(model_dir)
    key = hashlib.sha256(f"{model_sha}\n{sha256_file(metrics_path)}".encode()).hexdigest()

    def finish(result: RegisteredVersion) -> RegisteredVersion:
        if out is not None:
            write_json(out, asdict(result))
        if headline_out is not None:
            write_json(headline_out, headline)
        return result

    client = mlflow_client()
    existing = _existing_version(client, name, key)
    if existing is not None:
        log.info("register: %s v%s already holds this model and evaluation; not registering again",
                 name, existing.version)
        return finish(_as_registered(existing, created=False))

    parent = os.environ.get(ENV_PARENT_RUN)
    source_run_id = _resolve_run(client, "train", source_run_id,
                                 Path(train_metrics_path) if train_metrics_path else None, parent)
    eval_run_id = _resolve_run(client, "eval", eval_run_id, metrics_path.parent / "eval.json", parent)
    sha, dirty = git_commit()
    lineage = data_hashes(data or {})

    with stage_run("register", params=params, data=data, tags={"mempo.model_name": name}) as run:
        run_id = run.info.run_id
        mlflow.log_metrics({f"headline/{k}": v for k, v in headline.items()})
        mlflow.log_artifact(str(metrics_path), artifact_path="eval")
        mlflow.log_dict(headline, "headline.json")
        lm = client.create_logged_model(
            run.info.experiment_id, name=name, source_run_id=source_run_id or run_id, model_type="mempo-agent",
            tags={"git_commit": sha, KEY_TAG: key, "model_sha256": model_sha,
                  "register_run_id": run_id or "", "eval_run_id": eval_run_id or ""},
            params={k: str(v) for k, v in (train_metrics.items()) if k in ("steps", "lambda_mem")},
        )
        try:
            client.log_model_artifacts(lm.model_id, str(model_dir))
        except BaseException:
            client.finalize_logged_model(lm.model_id, LoggedModelStatus.FAILED)
            raise
        client.finalize_logged_model(lm.model_id, LoggedModelStatus.READY)
        # The model's metrics, where MLflow shows them: on the logged model, each from the
        # run that measured it, eval numbers per benchmark (a dataset with the eval set's hash).
        now = int(time.time() * 1000)
        eval_metrics = []
        for k, v in metrics.items():
            bench = (split_metric_key(k) or ("", ""))[1]
            ds = (eval_sets or {}).get(bench)
            eval_metrics.append(Metric(_metric_key(k), v, now, 0, model_id=lm.model_id,
                                       dataset_name=bench if ds else None,
                                       dataset_digest=ds["sha256"][:DIGEST_CHARS] if ds else None))
        client.log_batch(eval_run_id or run_id, metrics=eval_metrics)
        train_numbers = {k: float(v) for k, v in train_metrics.items()
                         if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        if train_numbers:
            client.log_batch(source_run_id or run_id, metrics=[
                Metric(f"train/{_metric_key(k)}", v, now, 0, model_id=lm.model_id) for k, v in train_numbers.items()])
        if source_run_id:
            client.log_outputs(source_run_id, [LoggedModelOutput(lm.model_id, int(train_metrics.get("steps", 0) or 0))])
        if eval_run_id:
            client.log_inputs(eval_run_id, models=[LoggedModelInput(lm.model_id)])
    try:
        client.create_registered_model(name, description="MemPO search agent (memory-writing policy)")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags: dict[str, str] = {f"{METRIC_TAG_PREFIX}{k}": repr(v) for k, v in gate_evidence(metrics, gate).items()}
    tags.update({f"{HEADLINE_TAG_PREFIX}{k}": repr(v) for k, v in headline.items()})
    if eval_sets is not None:
        tags.update(eval_set_tags(eval_sets))
    tags.update(lineage)
    tags.update({
        "git_commit": sha,
        "git_dirty": str(dirty).lower(),
        "source_run_id": source_run_id or "",
        "eval_run_id": eval_run_id or "",
        "register_run_id": run_id or "",
        "model_dir": model_dir.as_posix(),
        "model_sha256": model_sha,
        KEY_TAG: key,
    })
    # Check-then-create under the registry lock: two retries racing cannot both create.
    with promotion_lock(client, name):
        existing = _existing_version(client, name, key)
        if existing is not None:
            return finish(_as_registered(existing, created=False))
        mv = client.create_model_version(
            name, source=f"models:/{lm.model_id}", run_id=source_run_id or run_id, tags=tags,
            description=f"registered from {model_dir.as_posix()} at commit {sha[:12]}", model_id=lm.model_id,
        )
    # The logged model's side of the link (what mlflow.register_model records): its page then
    # lists this version instead of "Not registered".
    client.set_logged_model_tags(lm.model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(
        [{"name": name, "version": str(mv.version)}])})
    return finish(_as_registered(mv, created=True))


def _metric_key(key: str) -> str:
    # MLflow metric names allow alphanumerics, _ - . space / only.
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in key)

def read_registered(path: str | Path) -> tuple[str, str]:
    """(name, version) from a registered.json written by `register_model`."""
    p = Path(path)
    if not p.is_file():
        raise DataError("registered.json not found (run `mempo register` first)", path=p)
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
        return str(d["name"]), str(d["version"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"not a registered.json ({type(e).__name__}: {e})", path=p) from e


def parse_data_args(items: Sequence[str]) -> dict[str, str]:
    """`["train=data/prepared", ...]` -> `{"train": "data/prepared"}`; a bad item is a MempoError."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise MempoError(f"--data '{item}' must look like NAME=PATH")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out
