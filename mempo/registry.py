"""The model registry: register a trained policy with its evidence, promote it through a gate.

    mempo register --model-dir outputs/train/model --metrics outputs/eval/metrics.json
    mempo promote --model mempo-agent            # prints the decision as JSON

Registering (`register_model`) logs the model folder as an MLflow 3 logged model (source
run: the training run; its metrics: the full evaluation, each from the eval run and tied to
its benchmark as a dataset whose digest is the eval set's hash) and creates a model version
pointing at it. The version's tags are kept to what a reader and the gate need: the gate's
evidence (`metric.<key>` for the required, floor and guarded metrics and their question
counts `<agent>/<benchmark>/n`; `eval_set.<benchmark>`, the question count and sha256 of
each benchmark's questions), the headline numbers (`headline.<key>`), git commit, data versions
(`data.<name>.*`), the run ids and the `registration_key` (sha256 of model + metrics) that
makes a retried registration return the version it already created.

Promotion (`promote`) takes the newest version (or the one given), points `@challenger`
at it and compares it with `@champion` through `evaluate_gate`:

1. every required metric is present and finite (the primary metric and one per required
   benchmark), on at least `min_eval_n` questions;
2. every absolute floor holds;
3. against a champion: both were evaluated on the same questions (`same_eval_set`), the
   champion has the primary metric, the challenger gains at least `min_gain` on it, and
   no guarded metric the champion has regresses by more than `tolerance` (or is missing).

The checks are written as `promotion.*` tags on the challenger version whatever the
outcome; `@champion` moves only when all pass. Only aliases are used, never the deprecated
stages. Promotions of one model are serialised by a lock (a registered model named
`<name>.promotion-lock`, created atomically by the store), so two racing promotions cannot
both read the old champion; a second promotion of the same version is a no-op.
Works with any MLflow store: sqlite (default) or an `mlflow server` URI.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mempo.errors import DataError, MempoError

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
METRIC_TAG_PREFIX = "metric."
HEADLINE_TAG_PREFIX = "headline."
EVAL_SET_TAG_PREFIX = "eval_set."
DIGEST_CHARS = 16
KEY_TAG = "registration_key"
LOCK_SUFFIX = ".promotion-lock"


# ---------------------------------------------------------------------------- the gate


@dataclass(frozen=True)
class GateConfig:
    """What a challenger must show to replace the champion.

    Attributes:
        primary_metric: the metric that decides (e.g. `memory/world/em`).
        min_gain: challenger - champion on the primary metric must be >= this (in the
            metric's units; direction-aware for lower-is-better metrics).
        tolerance: allowed regression on each guarded metric (absolute, metric units).
        guard_metrics: glob patterns of metrics that must not regress beyond `tolerance`.
        lower_is_better: glob patterns of metrics where smaller is better (tokens, latency).
        required_benchmarks: benchmark names that must have a value ...
        benchmark_metric: ... under this key template (`{benchmark}` is replaced).
        floors: absolute minimums per metric (maximums for lower-is-better metrics).
        min_eval_n: each required metric must rest on at least this many questions (its
            `<agent>/<benchmark>/n`): one lucky answer is not evidence.
        same_eval_set: against a champion, every benchmark compared must have been evaluated
            on the same questions (equal eval-set sha256) by both versions.
    """

    primary_metric: str = "memory/world/em"
    min_gain: float = 0.0
    tolerance: float = 0.02
    guard_metrics: tuple[str, ...] = ("memory/*/em", "memory/*/f1")
    lower_is_better: tuple[str, ...] = ("*tokens*", "*latency*", "*turns*", "*searches*")
    required_benchmarks: tuple[str, ...] = ("world",)
    benchmark_metric: str = "memory/{benchmark}/em"
    floors: Mapping[str, float] = field(default_factory=dict)
    min_eval_n: int = 1
    same_eval_set: bool = True

    def is_lower_better(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, p) for p in self.lower_is_better)

    def required_metrics(self) -> list[str]:
        keys = [self.primary_metric]
        keys += [self.benchmark_metric.format(benchmark=b) for b in self.required_benchmarks]
        return list(dict.fromkeys(keys))

    def to_json(self) -> str:
        d = asdict(self)
        d["floors"] = dict(self.floors)
        return json.dumps(d, sort_keys=True)


@dataclass(frozen=True)
class GateCheck:
    """One check of the gate: its name, whether it passed, and the numbers behind it."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class GateResult:
    """The outcome of `evaluate_gate`: passed only if every check passed."""

    passed: bool
    checks: tuple[GateCheck, ...]
    primary_delta: float | None

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]


def _value(table: Mapping[str, float] | None, key: str) -> float | None:
    """The finite number under `key`, else None (missing, not a number, NaN or +-inf)."""
    if table is None or key not in table:
        return None
    try:
        v = float(table[key])
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _pair(key: str) -> tuple[str, str] | None:
    """(agent, benchmark) of an `agent/benchmark/metric` key, else None."""
    parts = key.split("/")
    return (parts[0], parts[1]) if len(parts) == 3 else None


def evaluate_gate(
    challenger: Mapping[str, float],
    champion: Mapping[str, float] | None,
    gate: GateConfig,
    *,
    challenger_sets: Mapping[str, Mapping[str, Any]] | None = None,
    champion_sets: Mapping[str, Mapping[str, Any]] | None = None,
) -> GateResult:
    """Decide whether `challenger` may replace `champion` (None: there is no champion yet).

    Both are flat metric tables (`{"memory/world/em": 0.41, "memory/world/n": 200, ...}`);
    NaN and +-inf count as missing. `*_sets` are the eval sets behind each table,
    `{benchmark: {"n": questions, "sha256": ...}}` (see `eval_set_fingerprints`); None when
    unknown, which fails the same-eval-set check against a champion.
    Pure: the same inputs always give the same result.
    """
    checks: list[GateCheck] = []

    def better_or_equal(key: str, new: float, old: float, slack: float) -> bool:
        # new is no worse than old by more than `slack` (slack < 0 demands a gain).
        return new <= old + slack if gate.is_lower_better(key) else new >= old - slack

    required = gate.required_metrics()
    for key in required:
        v = _value(challenger, key)
        checks.append(GateCheck(f"required:{key}", v is not None, "missing" if v is None else f"{v:.6g}"))

    for agent, bench in dict.fromkeys(p for p in map(_pair, required) if p):
        n = _value(challenger, f"{agent}/{bench}/n")
        checks.append(GateCheck(
            f"eval-size:{agent}/{bench}", n is not None and n >= gate.min_eval_n,
            "question count missing" if n is None else f"n={n:.0f} (min {gate.min_eval_n})",
        ))

    for key, floor in sorted(gate.floors.items()):
        v = _value(challenger, key)
        if v is None:
            checks.append(GateCheck(f"floor:{key}", False, f"missing (floor {floor:.6g})"))
            continue
        ok = v <= floor if gate.is_lower_better(key) else v >= floor
        checks.append(GateCheck(f"floor:{key}", ok, f"{v:.6g} vs floor {floor:.6g}"))

    delta: float | None = None
    if champion is not None:
        compared = [gate.primary_metric]
        new, old = _value(challenger, gate.primary_metric), _value(champion, gate.primary_metric)
        if new is None:
            checks.append(GateCheck("gain:" + gate.primary_metric, False, "challenger has no value"))
        elif old is None:
            # Nothing to beat is not a win: the champion's evidence is broken, so a person decides
            # (re-register the champion with its evaluation, or move @champion by hand).
            checks.append(GateCheck("gain:" + gate.primary_metric, False,
                                    "champion has no value: the two cannot be compared"))
        else:
            delta = new - old
            ok = better_or_equal(gate.primary_metric, new, old, -gate.min_gain)
            checks.append(GateCheck(
                "gain:" + gate.primary_metric, ok,
                f"{new:.6g} vs champion {old:.6g} (delta {delta:+.6g}, min gain {gate.min_gain:.6g})",
            ))
        guarded = sorted(
            k for k in champion
            if k != gate.primary_metric and any(fnmatch.fnmatchcase(k, p) for p in gate.guard_metrics)
        )
        for key in guarded:
            old = _value(champion, key)
            if old is None:
                continue
            compared.append(key)
            new = _value(challenger, key)
            if new is None:
                checks.append(GateCheck(f"no-regression:{key}", False, f"missing (champion {old:.6g})"))
                continue
            ok = better_or_equal(key, new, old, gate.tolerance)
            checks.append(GateCheck(
                f"no-regression:{key}", ok,
                f"{new:.6g} vs champion {old:.6g} (tolerance {gate.tolerance:.6g})",
            ))
        if gate.same_eval_set:
            for bench in dict.fromkeys(p[1] for p in map(_pair, compared) if p):
                mine, theirs = (challenger_sets or {}).get(bench), (champion_sets or {}).get(bench)
                if not mine or not theirs:
                    checks.append(GateCheck(f"same-eval-set:{bench}", False,
                                            f"eval set unknown for the {'challenger' if not mine else 'champion'}"))
                    continue
                same = mine.get("sha256") == theirs.get("sha256") and mine.get("n") == theirs.get("n")
                checks.append(GateCheck(
                    f"same-eval-set:{bench}", same,
                    f"n={mine.get('n')} sha256 {str(mine.get('sha256'))[:12]} vs champion "
                    f"n={theirs.get('n')} sha256 {str(theirs.get('sha256'))[:12]}",
                ))
    else:
        checks.append(GateCheck("champion", True, "no champion yet: floors and required metrics decide"))

    return GateResult(all(c.passed for c in checks), tuple(checks), delta)


# ---------------------------------------------------------------------------- registry I/O


def _client() -> MlflowClient:
    from mlflow import MlflowClient

    from mempo.tracking import configure

    return MlflowClient(configure())


def read_metrics_file(path: str | Path) -> dict[str, float]:
    """A flat `{key: number}` table from an eval metrics.json (nested dicts joined with "/")."""
    p = Path(path)
    if not p.is_file():
        raise DataError("metrics file not found (run the eval stage first)", path=p)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"not valid JSON: {e.msg}", path=p, row=e.lineno) from e
    if not isinstance(raw, dict):
        raise DataError("expected a JSON object of metrics", path=p)
    flat: dict[str, float] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(obj, bool):
            flat[prefix] = float(obj)
        elif isinstance(obj, int | float):
            flat[prefix] = float(obj)

    walk("", raw)
    if not flat:
        raise DataError("no numeric metrics in the file", path=p)
    return flat


def version_metrics(version: Any, client: MlflowClient | None = None) -> dict[str, float]:
    """The metric table of a model version: its `metric.*` tags (the gate's evidence), then,
    with a `client`, any other metric linked to its logged model (the full evaluation)."""
    out: dict[str, float] = {}
    model_id = logged_model_id(version)
    if client is not None and model_id:
        from mlflow.exceptions import MlflowException

        try:
            for m in client.get_logged_model(model_id).metrics or []:
                out[m.key] = float(m.value)
        except MlflowException as e:
            log.warning("logged model %s of %s v%s not readable (%s); using its tags only",
                        model_id, version.name, version.version, e)
    for k, v in (version.tags or {}).items():
        if k.startswith(METRIC_TAG_PREFIX):
            try:
                out[k[len(METRIC_TAG_PREFIX):]] = float(v)
            except ValueError:
                continue
    return out


def logged_model_id(version: Any) -> str | None:
    """The id of the logged model a version points at (`models:/m-...` source), or None.

    The sqlite store does not keep `ModelVersion.model_id`; the source URI always has it.
    """
    model_id = getattr(version, "model_id", None)
    if model_id:
        return str(model_id)
    source = str(getattr(version, "source", "") or "")
    rest = source.removeprefix("models:/")
    return rest if rest != source and rest.startswith("m-") and "/" not in rest else None


def eval_set_tags(sets: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """`{"eval_set.<benchmark>": "n=16 sha256=98c9d493013eb104"}`: short enough to read in
    the MLflow UI; 16 hex digits of the hash are plenty to tell two question sets apart."""
    return {f"{EVAL_SET_TAG_PREFIX}{b}": f"n={s['n']} sha256={str(s['sha256'])[:DIGEST_CHARS]}"
            for b, s in sorted(sets.items())}


def version_eval_sets(version: Any) -> dict[str, dict[str, Any]] | None:
    """The eval sets recorded on a version (`eval_set.*` tags), or None when it has none."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in (version.tags or {}).items():
        if not k.startswith(EVAL_SET_TAG_PREFIX):
            continue
        fields = dict(part.split("=", 1) for part in str(v).split() if "=" in part)
        try:
            out[k[len(EVAL_SET_TAG_PREFIX):]] = {"n": int(fields["n"]), "sha256": fields["sha256"]}
        except (KeyError, ValueError):
            continue
    return out or None


def eval_set_fingerprints(samples_path: str | Path) -> dict[str, dict[str, Any]]:
    """`{benchmark: {"n": questions, "sha256": ...}}` of an eval stage's samples.parquet.

    The hash covers each question's id, text and gold answers (sorted by id), so two
    evaluations compare only if they asked exactly the same questions.
    """
    import pyarrow.parquet as pq

    p = Path(samples_path)
    if not p.is_file():
        raise DataError("samples.parquet not found (run the eval stage first)", path=p)
    cols = ["benchmark", "id", "question", "golden_answers"]
    try:
        rows = pq.read_table(p, columns=cols).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"not a samples.parquet with columns {cols} ({type(e).__name__}: {e})", path=p) from e
    per: dict[str, dict[str, str]] = {}
    for r in rows:
        line = json.dumps([str(r["id"]), str(r["question"]), [str(a) for a in r["golden_answers"] or []]],
                          ensure_ascii=False)
        per.setdefault(str(r["benchmark"]), {})[str(r["id"])] = line
    out: dict[str, dict[str, Any]] = {}
    for bench, items in sorted(per.items()):
        h = hashlib.sha256()
        for _, line in sorted(items.items()):
            h.update(line.encode())
            h.update(b"\n")
        out[bench] = {"n": len(items), "sha256": h.hexdigest()}
    return out


def gate_evidence(metrics: Mapping[str, float], gate: GateConfig) -> dict[str, float]:
    """The part of `metrics` the gate reads: required, floor and guarded metrics, and the
    question count (`<agent>/<benchmark>/n`) behind each. These become `metric.*` tags."""
    keys = {*gate.required_metrics(), *gate.floors}
    keys |= {k for k in metrics if any(fnmatch.fnmatchcase(k, p) for p in gate.guard_metrics)}
    keys |= {f"{a}/{b}/n" for a, b in filter(None, map(_pair, list(keys)))}
    return {k: metrics[k] for k in sorted(keys) if k in metrics}


def _find_stage_run(client: MlflowClient, stage: str, parent_id: str) -> str | None:
    """The newest run tagged `mempo.stage=<stage>` under pipeline run `parent_id`."""
    filt = f"tags.`mempo.stage` = '{stage}' and tags.`mlflow.parentRunId` = '{parent_id}'"
    try:
        exp = client.get_run(parent_id).info.experiment_id
    except Exception:  # noqa: BLE001 - a stale parent id: no run to find
        return None
    runs = client.search_runs([exp], filt, order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


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

    client = _client()
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
            bench = (_pair(k) or ("", ""))[1]
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


# ---------------------------------------------------------------------------- promotion


@contextmanager
def promotion_lock(
    client: MlflowClient, name: str, *, wait_s: float = 120.0, stale_s: float = 900.0
) -> Iterator[str]:
    """Hold the registry lock of model `name` (a registered model the store creates atomically):
    promotions, and the check-then-create of a registration, of one model run one at a time.

    Waits up to `wait_s` seconds for a holder to finish; a lock older than `stale_s` seconds
    (its holder crashed) is broken. Raises `MempoError` when it cannot be acquired.
    """
    from mlflow.exceptions import MlflowException

    lock_name = name + LOCK_SUFFIX
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + wait_s
    delay = 0.05
    while True:
        try:
            client.create_registered_model(
                lock_name, tags={"owner": token, "acquired_at": f"{time.time():.3f}"},
                description=f"lock held while promoting '{name}'; safe to delete if stale",
            )
            break
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        try:
            held = client.get_registered_model(lock_name)
            age = time.time() - float(held.tags.get("acquired_at", "0"))
            if age > stale_s:
                # Re-read right before deleting so we break only the lock we judged stale.
                again = client.get_registered_model(lock_name)
                if again.tags.get("owner") == held.tags.get("owner"):
                    client.delete_registered_model(lock_name)
                continue
        except MlflowException:
            continue  # released between our create and get: try again at once
        if time.monotonic() > deadline:
            raise MempoError(
                f"promotion of '{name}' is locked by another process for over {wait_s:.0f} s "
                f"(delete registered model '{lock_name}' if its holder died)"
            )
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
    try:
        yield token
    finally:
        try:
            held = client.get_registered_model(lock_name)
            if held.tags.get("owner") == token:
                client.delete_registered_model(lock_name)
        except MlflowException:
            pass


@dataclass(frozen=True)
class PromotionDecision:
    """What `promote` decided and why (also written as `promotion.*` version tags)."""

    model: str
    challenger_version: str
    champion_version: str | None
    promoted: bool
    already_champion: bool
    checks: list[dict[str, Any]]
    primary_metric: str
    primary_delta: float | None
    decided_at: str

    def summary(self) -> str:
        verdict = "PROMOTED" if self.promoted else "REJECTED"
        if self.already_champion:
            verdict = "ALREADY CHAMPION"
        vs = f"champion v{self.champion_version}" if self.champion_version else "no champion"
        fails = [f"{c['name']} ({c['detail']})" for c in self.checks if not c["passed"]]
        why = "; failed: " + "; ".join(fails) if fails else ""
        return f"{self.model} v{self.challenger_version} vs {vs}: {verdict}{why}"


def has_version(name: str, version: str | int) -> bool:
    """Whether this tracking store has version `version` of model `name`."""
    from mlflow.exceptions import MlflowException

    try:
        _client().get_model_version(name, str(version))
    except MlflowException:
        return False
    return True


def _newest_version(client: MlflowClient, name: str) -> str:
    versions = client.search_model_versions(f"name = '{name}'")
    if not versions:
        raise MempoError(f"model '{name}' has no registered versions (run `mempo register` first)")
    return str(max(int(v.version) for v in versions))


def _alias_version(client: MlflowClient, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def promote(
    name: str,
    gate: GateConfig,
    *,
    version: str | int | None = None,
    out: str | Path | None = None,
    lock_wait_s: float = 120.0,
) -> PromotionDecision:
    """Gate version `version` (default: the newest) of model `name` against `@champion`.

    Sets `@challenger`, writes the evidence as `promotion.*` tags on that version, and moves
    `@champion` only when `evaluate_gate` passes. Idempotent: if the version already is the
    champion nothing changes. Writes the decision JSON to `out` when given.
    """
    from mempo.io import write_json
    from mempo.tracking import log_json, stage_run

    client = _client()
    with promotion_lock(client, name, wait_s=lock_wait_s):
        challenger_v = str(version) if version is not None else _newest_version(client, name)
        challenger = client.get_model_version(name, challenger_v)
        champion_v = _alias_version(client, name, CHAMPION)
        now = datetime.now(UTC).isoformat(timespec="seconds")
        if champion_v == challenger_v:
            decision = PromotionDecision(
                name, challenger_v, champion_v, True, True,
                json.loads(challenger.tags.get("promotion.checks", "[]")), gate.primary_metric,
                None, challenger.tags.get("promotion.decided_at", now),
            )
        else:
            client.set_registered_model_alias(name, CHALLENGER, challenger_v)
            champion = client.get_model_version(name, champion_v) if champion_v else None
            result = evaluate_gate(
                version_metrics(challenger, client),
                version_metrics(champion, client) if champion is not None else None, gate,
                challenger_sets=version_eval_sets(challenger),
                champion_sets=version_eval_sets(champion) if champion is not None else None,
            )
            checks = [asdict(c) for c in result.checks]
            evidence = {
                "promotion.decision": "promoted" if result.passed else "rejected",
                "promotion.champion_version": champion_v or "none",
                "promotion.primary_metric": gate.primary_metric,
                "promotion.primary_delta": "none" if result.primary_delta is None else repr(result.primary_delta),
                "promotion.checks": json.dumps(checks, sort_keys=True),
                "promotion.gate": gate.to_json(),
                "promotion.decided_at": now,
            }
            # Evidence first: a crash after this still leaves the reasons on the version.
            for k, v in evidence.items():
                client.set_model_version_tag(name, challenger_v, k, v[:5000])
            if result.passed:
                client.set_registered_model_alias(name, CHAMPION, challenger_v)
                client.delete_registered_model_alias(name, CHALLENGER)
                if champion_v:
                    client.set_model_version_tag(name, champion_v, "promotion.superseded_by", challenger_v)
            decision = PromotionDecision(
                name, challenger_v, champion_v, result.passed, False, checks,
                gate.primary_metric, result.primary_delta, now,
            )
    with stage_run("promote", tags={"mempo.model_name": name,
                                     "promotion.decision": "promoted" if decision.promoted else "rejected",
                                     "promotion.challenger_version": challenger_v}):
        log_json(asdict(decision), "promotion.json")
    if out is not None:
        write_json(out, asdict(decision))
    return decision


def gate_from_params(p: Any) -> GateConfig:
    """A `GateConfig` from the `promote:` params section (a pydantic model or mapping)."""
    d = p.model_dump() if hasattr(p, "model_dump") else dict(p)
    keys = {f for f in GateConfig.__dataclass_fields__}
    d = {k: v for k, v in d.items() if k in keys}
    for k in ("guard_metrics", "lower_is_better", "required_benchmarks"):
        if k in d:
            d[k] = tuple(d[k])
    return GateConfig(**d)


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
