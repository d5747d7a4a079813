"""The model registry: register a trained policy with its evidence, promote it through a gate.

    mempo register --model-dir outputs/train/model --metrics outputs/eval/metrics.json
    mempo promote --model mempo-agent            # prints the decision as JSON

Registering logs the model folder as artifacts of a `register` stage run and creates a
model version whose tags hold the eval metrics (`metric.<key>`), the git commit, the data
versions (`data.<name>.*`) and the source training / eval runs.

Promotion (`promote`) takes the newest version (or the one given), points `@challenger`
at it and compares it with `@champion` through `evaluate_gate`:

1. every required metric is present (the primary metric and one per required benchmark);
2. every absolute floor holds;
3. against a champion: the primary metric gains at least `min_gain`, and no guarded
   metric the champion has regresses by more than `tolerance` (or is missing).

The checks are written as `promotion.*` tags on the challenger version whatever the
outcome; `@champion` moves only when all pass. Only aliases are used, never the deprecated
stages. Promotions of one model are serialised by a lock (a registered model named
`<name>.promotion-lock`, created atomically by the store), so two racing promotions cannot
both read the old champion; a second promotion of the same version is a no-op.
Works with any MLflow store: sqlite (default) or an `mlflow server` URI.
"""

from __future__ import annotations

import fnmatch
import json
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

CHAMPION = "champion"
CHALLENGER = "challenger"
METRIC_TAG_PREFIX = "metric."
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
    """

    primary_metric: str = "memory/world/em"
    min_gain: float = 0.0
    tolerance: float = 0.02
    guard_metrics: tuple[str, ...] = ("memory/*/em", "memory/*/f1")
    lower_is_better: tuple[str, ...] = ("*tokens*", "*latency*", "*turns*", "*searches*")
    required_benchmarks: tuple[str, ...] = ("world",)
    benchmark_metric: str = "memory/{benchmark}/em"
    floors: Mapping[str, float] = field(default_factory=dict)

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
    if table is None or key not in table:
        return None
    try:
        v = float(table[key])
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def evaluate_gate(
    challenger: Mapping[str, float],
    champion: Mapping[str, float] | None,
    gate: GateConfig,
) -> GateResult:
    """Decide whether `challenger` may replace `champion` (None: there is no champion yet).

    Both are flat metric tables (`{"memory/world/em": 0.41, ...}`); NaN counts as missing.
    Pure: the same tables and gate always give the same result.
    """
    checks: list[GateCheck] = []

    def better_or_equal(key: str, new: float, old: float, slack: float) -> bool:
        # new is no worse than old by more than `slack` (slack < 0 demands a gain).
        return new <= old + slack if gate.is_lower_better(key) else new >= old - slack

    for key in gate.required_metrics():
        v = _value(challenger, key)
        checks.append(GateCheck(f"required:{key}", v is not None, "missing" if v is None else f"{v:.6g}"))

    for key, floor in sorted(gate.floors.items()):
        v = _value(challenger, key)
        if v is None:
            checks.append(GateCheck(f"floor:{key}", False, f"missing (floor {floor:.6g})"))
            continue
        ok = v <= floor if gate.is_lower_better(key) else v >= floor
        checks.append(GateCheck(f"floor:{key}", ok, f"{v:.6g} vs floor {floor:.6g}"))

    delta: float | None = None
    if champion is not None:
        new, old = _value(challenger, gate.primary_metric), _value(champion, gate.primary_metric)
        if new is None:
            checks.append(GateCheck("gain:" + gate.primary_metric, False, "challenger has no value"))
        elif old is None:
            checks.append(GateCheck("gain:" + gate.primary_metric, True, "champion has no value"))
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
            new = _value(challenger, key)
            if new is None:
                checks.append(GateCheck(f"no-regression:{key}", False, f"missing (champion {old:.6g})"))
                continue
            ok = better_or_equal(key, new, old, gate.tolerance)
            checks.append(GateCheck(
                f"no-regression:{key}", ok,
                f"{new:.6g} vs champion {old:.6g} (tolerance {gate.tolerance:.6g})",
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


def version_metrics(version: Any) -> dict[str, float]:
    """The metric table stored on a model version's `metric.*` tags."""
    out: dict[str, float] = {}
    for k, v in (version.tags or {}).items():
        if k.startswith(METRIC_TAG_PREFIX):
            try:
                out[k[len(METRIC_TAG_PREFIX):]] = float(v)
            except ValueError:
                continue
    return out


def _find_stage_run(client: MlflowClient, stage: str, parent_id: str | None) -> str | None:
    """The newest run tagged `mempo.stage=<stage>` under `parent_id` (or anywhere if None)."""
    filt = f"tags.`mempo.stage` = '{stage}'"
    if parent_id:
        filt += f" and tags.`mlflow.parentRunId` = '{parent_id}'"
    exps = [e.experiment_id for e in client.search_experiments()]
    if not exps:
        return None
    runs = client.search_runs(exps, filt, order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


@dataclass(frozen=True)
class RegisteredVersion:
    """What `register_model` created."""

    name: str
    version: str
    model_uri: str
    run_id: str | None
    source: str


def register_model(
    name: str,
    model_dir: str | Path,
    metrics_path: str | Path,
    *,
    data: Mapping[str, str | Path] | None = None,
    source_run_id: str | None = None,
    eval_run_id: str | None = None,
    params: Any = None,
    out: str | Path | None = None,
) -> RegisteredVersion:
    """Log `model_dir` under a `register` stage run and create a version of model `name`.

    The version's tags: every eval metric (`metric.<key>`), git commit, data versions, the
    training and eval run ids (found under the same pipeline run when not given). Writes
    the result as JSON to `out` when given. Raises `DataError` for a missing model folder
    or metrics file.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    from mempo.io import write_json
    from mempo.tracking import ENV_PARENT_RUN, data_hashes, git_commit, log_metrics, stage_run

    model_dir = Path(model_dir)
    if not model_dir.is_dir() or not any(model_dir.iterdir()):
        raise DataError("model folder is missing or empty (run the train stage first)", path=model_dir)
    metrics = read_metrics_file(metrics_path)
    client = _client()
    parent = os.environ.get(ENV_PARENT_RUN)
    source_run_id = source_run_id or _find_stage_run(client, "train", parent)
    eval_run_id = eval_run_id or _find_stage_run(client, "eval", parent)
    sha, dirty = git_commit()
    lineage = data_hashes(data or {})

    with stage_run("register", params=params, data=data,
                   tags={"mempo.model_name": name}) as run:
        log_metrics(metrics)
        mlflow.log_artifacts(str(model_dir), artifact_path="model")
        mlflow.log_artifact(str(metrics_path), artifact_path="eval")
        source = mlflow.get_artifact_uri("model")
        run_id = run.info.run_id
    try:
        client.create_registered_model(name, description="MemPO search agent (memory-writing policy)")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags: dict[str, str] = {f"{METRIC_TAG_PREFIX}{k}": repr(v) for k, v in metrics.items()}
    tags.update(lineage)
    tags.update({
        "git_commit": sha,
        "git_dirty": str(dirty).lower(),
        "source_run_id": source_run_id or "",
        "eval_run_id": eval_run_id or "",
        "register_run_id": run_id or "",
        "model_dir": model_dir.as_posix(),
    })
    mv = client.create_model_version(
        name, source=source, run_id=run_id, tags=tags,
        description=f"registered from {model_dir.as_posix()} at commit {sha[:12]}",
    )
    result = RegisteredVersion(name, str(mv.version), f"models:/{name}/{mv.version}", run_id, source)
    if out is not None:
        write_json(out, asdict(result))
    return result


# ---------------------------------------------------------------------------- promotion


@contextmanager
def promotion_lock(
    client: MlflowClient, name: str, *, wait_s: float = 120.0, stale_s: float = 900.0
) -> Iterator[str]:
    """Hold the promotion lock of model `name` (a registered model the store creates atomically).

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
            champion_metrics = (
                version_metrics(client.get_model_version(name, champion_v)) if champion_v else None
            )
            result = evaluate_gate(version_metrics(challenger), champion_metrics, gate)
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
