"""The local end-to-end run behind `make run`: `dvc repro` under one MLflow parent run,
with the retrieval service up for the stages that need it, then the promotion gate and a
summary of where everything is.

    mempo pipeline run            # what `make run` calls
    mempo pipeline run --force    # re-run every stage (with targets: every stage they need)
    mempo pipeline run eval       # only up to the eval stage

What happens, in order:

1. `dvc status` says which stages are stale (nothing stale: a no-op, like `dvc repro`).
2. One MLflow parent run opens; its id goes to the stages as `MEMPO_PARENT_RUN_ID`, so
   each stage's own run nests under it (see `mempo.tracking`).
3. If a stale stage is one of `pipeline.retriever_stages`, the index stage is reproduced
   first, `mempo serve retriever` starts on a free loopback port, and its URL is exported
   as `MEMPO_RETRIEVER_URL` (dvc.yaml passes it to those stages with a fallback to the
   in-process index). It is stopped afterwards, also when a stage fails.
4. `dvc repro` runs the rest; DVC decides what is stale. With `--force` every stage runs
   exactly once: the index stage and what it needs first, then the others in dependency
   order (`dvc repro --force --single-item ...`). The stale stages of a group in
   `pipeline.parallel_stages` (the two SFT cold starts, the two GRPO stages) run side by
   side, each in its own `dvc repro --single-item` (`mempo.dvc_runner.reproduce`).
5. `mempo promote` gates the newest registered version (`pipeline.promote: true`);
   promotion reads the live registry, so it is not a DVC stage (it would never be cached).
6. dvc.lock is logged to the parent run, each stage run is tagged with the hashes DVC
   recorded for it, and the summary is printed: the stages whose command ran (read from
   DVC's own "Running stage" lines, not predicted) and those restored from the run cache.
7. `dvc push` sends the outputs to the default DVC remote (`pipeline.push: true`; the
   repository's default is `local`, the ignored folder `.dvc-remote/`).

Stopping: `dvc repro` runs in its own process group. When this process is interrupted
(Ctrl-C, or SIGTERM, which the CLI turns into an exception), the group gets SIGINT (DVC
lets the running stage handle it, records the failure and exits), then SIGTERM and SIGKILL
if it is still there after `mempo.dvc_runner.STOP_GRACE_S`; the retrieval service is stopped
as well, and the parent MLflow run ends FAILED. A SIGKILL of this process cannot be handled: then the
service (its own process group, so a terminal's Ctrl-C does not skip the drain) stays up.

Params profiles: `mempo pipeline run --params params.tiny.yaml` first writes the profile's keys
into params.yaml (`apply_params_profile`; comments kept, validated first), as `dvc exp run -S`
does, so `dvc status`, dvc.lock and MLflow all see the values the stages ran with.

This module is the run itself (`run_pipeline`, `summarize`, the retrieval service's lifecycle,
params profiles); driving DVC (stale stages, the stage graph, repro, push) is in
`mempo.dvc_runner`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mempo.dvc_runner import (
    bin_dir,
    downstream_of,
    dvc_env,
    in_dependency_order,
    push_outputs,
    repro,
    reproduce,
    stale_stages,
    upstream_of,
)
from mempo.errors import MempoError

ENV_RETRIEVER_URL = "MEMPO_RETRIEVER_URL"

# The smallest end-to-end run (every stage, minutes on 2 CPU cores): `mempo pipeline run
# --params params.tiny.yaml`, and what the orchestration tests run through DVC, Kubeflow
# (kfp.local) and Airflow. It proves the wiring, not quality.
TINY_PROFILE = "params.tiny.yaml"


def _round_trip_yaml() -> Any:
    # ruamel.yaml (a dependency of DVC, which this module drives) keeps comments and layout
    from ruamel.yaml import YAML

    y = YAML()
    y.preserve_quotes = True
    y.width = 4096
    y.indent(mapping=2, sequence=4, offset=2)
    y.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return y


def _flow(value: Any) -> Any:
    """Lists and mappings as one-line flow YAML (`[world]`, `{}`), as params.yaml writes them."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    if isinstance(value, dict):
        out: Any = CommentedMap((k, _flow(v)) for k, v in value.items())
    elif isinstance(value, list | tuple):
        out = CommentedSeq(_flow(v) for v in value)
    else:
        return value
    out.fa.set_flow_style()
    return out


def write_params_with(src: str | Path, dst: str | Path, overrides: dict[str, Any]) -> Path:
    """Copy params file `src` to `dst` with dotted-key `overrides` applied (validated first:
    nothing is written when a key is unknown or a value invalid). Comments and layout are kept;
    `src` and `dst` may be the same file.
    """
    import io

    from mempo.config import load_params
    from mempo.errors import ConfigError
    from mempo.io import write_text

    load_params(src, overrides=overrides)  # a bad key fails here, naming it
    y = _round_trip_yaml()
    data = y.load(Path(src).read_text(encoding="utf-8")) or {}
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        cur = data
        for p in parents:
            if cur.get(p) is None:
                cur[p] = {}
            cur = cur[p]
            if not isinstance(cur, dict):
                raise ConfigError(f"cannot set '{key}': '{p}' is not a section", path=src, field=key)
        cur[leaf] = _flow(value)
    buf = io.StringIO()
    y.dump(data, buf)
    return write_text(dst, buf.getvalue())


def apply_params_profile(root: str | Path, profile: str | Path) -> list[str]:
    """Write the keys of a params profile (`params.tiny.yaml`) into `root/params.yaml`, the
    file DVC stages read, as `dvc exp run -S` does: validated first, comments kept. A relative
    `profile` is taken from `root`. Returns the keys whose value changed."""
    from mempo.config import load_params, params_flat, profile_overrides

    root = Path(root)
    path = Path(profile) if Path(profile).is_absolute() else root / profile
    overrides = profile_overrides(path)
    params_file = root / "params.yaml"
    before = params_flat(load_params(params_file))
    write_params_with(params_file, params_file, overrides)
    after = params_flat(load_params(params_file))
    return sorted(k for k in after.keys() | before.keys() if before.get(k) != after.get(k))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def retrieval_service(
    index_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    start_timeout_s: float = 300.0,
    extra_args: list[str] | None = None,
    log_path: str | Path | None = None,
) -> Iterator[str]:
    """Run `mempo serve retriever --index DIR` on a loopback port; yield its base URL.

    Waits until `GET /health` answers 200 (raises `MempoError` if the process exits or
    `start_timeout_s` seconds pass). Always stops the server on exit: SIGTERM (the server
    drains in-flight requests), then SIGKILL after 30 s.
    """
    import httpx

    index_dir = Path(index_dir)
    if not index_dir.exists():
        raise MempoError("retrieval index not found (run the index stage first)", path=index_dir)
    port = port or _free_port(host)
    url = f"http://{host}:{port}"
    cmd = [str(bin_dir() / "mempo"), "serve", "retriever", "--index", str(index_dir),
           "--host", host, "--port", str(port), *(extra_args or [])]
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log_fh = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=dvc_env(), stdout=log_fh, stderr=subprocess.STDOUT if log_path else None,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise MempoError(f"the retrieval service exited with code {proc.returncode} while starting "
                                 f"({' '.join(cmd[1:])})")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise MempoError(f"the retrieval service at {url} was not healthy after {start_timeout_s:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if log_path:
            log_fh.close()  # type: ignore[union-attr]


@dataclass
class PipelineResult:
    """What one `run_pipeline` did.

    Attributes:
        ran: stages whose command ran (from DVC's output), in order.
        planned: the stages expected to run (what `dvc status` and `--force` said).
        restored: stages DVC restored from its run cache instead of running them.
        side_by_side: the groups of stages that ran at once (`pipeline.parallel_stages`).
    """

    seconds: float
    ran: list[str]
    parent_run_id: str | None
    retriever_url: str | None = None
    retriever_stages: list[str] = field(default_factory=list)
    promotion: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    planned: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    side_by_side: list[list[str]] = field(default_factory=list)



def run_pipeline(
    root: str | Path = ".",
    force: bool = False,
    targets: list[str] | None = None,
    *,
    promote: bool | None = None,
    params_profile: str | Path | None = None,
) -> PipelineResult:
    """Reproduce the DVC pipeline in `root` under an MLflow parent run, then gate promotion.

    `promote` overrides `pipeline.promote`. `params_profile` (e.g. `params.tiny.yaml`) is
    first written into `root/params.yaml` (`apply_params_profile`), so DVC sees and records
    the values the stages run with. Returns what ran and where. Raises `MempoError` if a
    stage fails (the parent run then ends FAILED and the retrieval service is stopped).
    """
    from mempo.config import load_params
    from mempo.tracking import pipeline_run, tag_stage_runs_with_dvc_hashes, tracking_uri

    root = Path(root).resolve()
    profile_note = None
    if params_profile is not None:
        changed = apply_params_profile(root, params_profile)
        profile_note = (f"Params:      {params_profile} written into params.yaml ({len(changed)} value(s) changed; "
                        "`git diff params.yaml` shows them, `git checkout params.yaml` undoes it)")
        print(profile_note, flush=True)
    params = load_params(root / "params.yaml")
    pp = params.pipeline
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {})
    t0 = time.perf_counter()
    if force:  # dvc repro --force [targets]: every stage, or every stage the targets need
        will_run = in_dependency_order(stages, upstream_of(stages, targets) if targets else set(stages))
    else:
        stale = stale_stages(root, targets)
        will_run = in_dependency_order(stages, downstream_of(stages, stale)) if stale else []
    result = PipelineResult(0.0, [], None, planned=will_run)
    if profile_note:
        result.notes.append(profile_note)
    env_before = os.environ.get("MEMPO_PROJECT_ROOT")
    os.environ["MEMPO_PROJECT_ROOT"] = str(root)
    try:
        with pipeline_run("pipeline", params=None, experiment=pp.experiment,
                          tags={"mempo.stages_to_run": ",".join(will_run) or "none",
                                "mempo.force": str(force).lower()}) as parent_id:
            result.parent_run_id = parent_id
            need_retriever = pp.serve_retriever and any(s in will_run for s in pp.retriever_stages)
            if need_retriever and pp.index_stage in stages:
                repro(root, force, [pp.index_stage], {}, result=result)
                with retrieval_service(root / pp.index_dir, host=pp.retriever_host,
                                       start_timeout_s=pp.retriever_start_timeout_s,
                                       log_path=root / "outputs" / "retriever.log") as url:
                    result.retriever_url = url
                    result.retriever_stages = [s for s in pp.retriever_stages if s in will_run]
                    print(f"retrieval service up at {url} for {', '.join(result.retriever_stages)}", flush=True)
                    env = {ENV_RETRIEVER_URL: url}
                    if force:  # the index stage and its upstream were forced above; the rest once each
                        done = upstream_of(stages, [pp.index_stage])
                        rest = [s for s in will_run if s not in done]
                        if rest:
                            reproduce(root, True, rest, env, stages, rest, pp.parallel_stages, result,
                                      single_item=True)
                    else:
                        reproduce(root, False, targets, env, stages, will_run, pp.parallel_stages, result)
            else:
                reproduce(root, force, targets, {}, stages, will_run, pp.parallel_stages, result)
            do_promote = pp.promote if promote is None else promote
            registered = root / params.registration.out / "registered.json"
            if do_promote and registered.exists() and (not targets or "register" in targets):
                from mempo.registry.gate import gate_from_params
                from mempo.registry.promote import has_version
                from mempo.registry.promote import promote as promote_version

                reg = json.loads(registered.read_text())
                if not has_version(reg["name"], reg["version"]):
                    # registered.json came with `dvc pull`; the version lives in another store.
                    result.notes.append(f"Promotion:   skipped: {reg['model_uri']} is not in this MLflow store "
                                        "(outputs pulled from another clone?); `dvc repro -f register` registers it here")
                else:
                    decision = promote_version(
                        reg["name"], gate_from_params(params.promote), version=reg["version"],
                        out=root / params.promote.out / "decision.json", lock_wait_s=params.promote.lock_wait_s,
                    )
                    result.promotion = {"promoted": decision.promoted, "summary": decision.summary(),
                                        "already_champion": decision.already_champion}
            if parent_id is not None and (root / "dvc.lock").exists():
                from mlflow import MlflowClient

                MlflowClient(tracking_uri(root)).log_artifact(parent_id, str(root / "dvc.lock"))
                MlflowClient(tracking_uri(root)).set_tag(parent_id, "mempo.stages_ran", ",".join(result.ran) or "none")
                tag_stage_runs_with_dvc_hashes(parent_id, root)
            if parent_id is not None:
                log_pipeline_metrics(parent_id, root, root / (params.registration.headline or Path(
                    params.registration.out) / "headline.json"), time.perf_counter() - t0)
    finally:
        if env_before is None:
            os.environ.pop("MEMPO_PROJECT_ROOT", None)
        else:
            os.environ["MEMPO_PROJECT_ROOT"] = env_before
    if pp.push:
        # After the run: what was reproduced (or restored from the cache) goes to the remote,
        # so `dvc pull` in another clone gets it and `dvc repro` there reruns nothing.
        remote = push_outputs(root)
        result.notes.append(f"DVC remote:  outputs pushed to '{remote}' (dvc pull in another clone)"
                            if remote else "DVC remote:  none configured, nothing pushed (dvc remote add -d ...)")
    result.seconds = time.perf_counter() - t0
    return result


def log_pipeline_metrics(parent_id: str, root: Path, headline: Path, seconds: float) -> dict[str, float]:
    """On the pipeline run itself: its wall time (`pipeline_wall_s`) and the headline numbers
    the outputs now hold (`headline/<key>`, from the register stage's headline.json, also when
    DVC had nothing to rerun), so pipeline runs compare side by side in the MLflow UI's table."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from mempo.tracking import tracking_uri

    metrics = {"pipeline_wall_s": round(seconds, 1)}
    try:
        values = json.loads(headline.read_text())
    except (OSError, ValueError):
        values = {}  # no register stage in this pipeline, or not run yet: the wall time only
    if isinstance(values, dict):
        metrics.update({f"headline/{k}": float(v) for k, v in values.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
    now = int(time.time() * 1000)
    MlflowClient(tracking_uri(root)).log_batch(  # one request, not one per number
        parent_id, metrics=[Metric(key, value, now, 0) for key, value in metrics.items()])
    return metrics


def summarize(root: str | Path = ".", result: PipelineResult | None = None) -> list[str]:
    """Lines saying where each stage's output, the report, the MLflow UI and the model are."""
    from mempo.config import load_params
    from mempo.tracking import tracking_uri

    root = Path(root)
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {})
    lines = ["Outputs:"]
    for name, stage in stages.items():
        for out in stage.get("outs", []):
            path = out if isinstance(out, str) else next(iter(out))
            status = "ok" if (root / path).exists() else "missing"
            lines.append(f"  {name:<16} {path}  [{status}]")
    params = load_params(root / "params.yaml")
    report = root / "outputs" / "eval" / "report.md"
    if report.exists():
        lines.append(f"Report:      {report.relative_to(root)} (and report.html beside it)")
    uri = tracking_uri(root)
    if uri.startswith("sqlite:///"):
        lines.append("MLflow UI:   mlflow ui --backend-store-uri sqlite:///mlflow.db "
                     "--default-artifact-root ./mlartifacts --host 127.0.0.1")
        page = _run_page(uri, result.parent_run_id) if result is not None and result.parent_run_id else None
        if page:
            lines.append(f"             then {page}")
    else:
        lines.append(f"MLflow:      {uri}")
    registered = root / params.registration.out / "registered.json"
    if registered.exists():
        reg = json.loads(registered.read_text())
        lines.append(f"Registered:  {reg['model_uri']} (MLflow run {reg['run_id']})")
    if result is not None and result.promotion is not None:
        lines.append(f"Promotion:   {result.promotion['summary']}")
    if result is not None and result.retriever_url:
        lines.append(f"Retriever:   the retrieval service at {result.retriever_url} served "
                     f"{', '.join(result.retriever_stages)} and was stopped")
    if result is not None and result.parent_run_id:
        lines.append(f"Parent run:  {result.parent_run_id}")
    if result is not None:
        lines.extend(result.notes)
    if result is not None and result.parent_run_id:
        lines.extend(_stage_time_lines(root, result.parent_run_id, result.seconds, result.side_by_side))
    return lines


def _run_page(uri: str, run_id: str, ui: str = "http://127.0.0.1:5000") -> str | None:
    """The MLflow UI's page of a run, in its Model training view (MLflow 3's UI opens in the
    GenAI view otherwise, which lists traces, not these runs). None if the run is not found."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        exp_id = MlflowClient(uri).get_run(run_id).info.experiment_id
    except MlflowException:
        return None
    return f"{ui}/#/experiments/{exp_id}/runs/{run_id}?workflowType=machine_learning"


def _stage_time_lines(root: Path, parent_run_id: str, total_s: float,
                      side_by_side: list[list[str]] | None = None) -> list[str]:
    """Each stage run's wall time (its `stage_wall_s` metric, named by its DVC stage), then the
    rest of `total_s`: stages without an MLflow run (world, validation, index, policy) and DVC.
    Stages that ran side by side count once in the rest, as the longest of them."""
    from mempo.tracking import stage_wall_times

    try:
        times = stage_wall_times(parent_run_id, root)
    except Exception as e:  # noqa: BLE001 - the summary must not fail the finished run
        return [f"Stage times: not available ({e})"]
    if not times:
        return []
    overlap = 0.0
    for group in side_by_side or []:
        ts = [times[s] for s in group if s in times]
        overlap += sum(ts) - max(ts, default=0.0)
    rest = max(total_s - sum(times.values()) + overlap, 0.0)
    beside = {s: g for g in side_by_side or [] for s in g}
    return (["Stage times (wall):"]
            + [f"  {name:<16} {seconds:8.1f} s" + (f"  (side by side with {', '.join(x for x in beside[name] if x != name)})"
                                                   if name in beside else "") for name, seconds in times.items()]
            + [f"  {'other':<16} {rest:8.1f} s  (world, validation, index, policy: no MLflow run; dvc)"])
