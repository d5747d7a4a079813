"""Register and promote against real MLflow stores: sqlite, and an `mlflow server` on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlflow
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mempo.errors import DataError, MempoError
from mempo.registry.evidence import version_metrics
from mempo.registry.gate import GateConfig
from mempo.registry.promote import CHALLENGER, CHAMPION, promote
from mempo.registry.register import register_model
from mempo.registry.store import promotion_lock

GATE = GateConfig(primary_metric="memory/world/em", min_gain=0.0, tolerance=0.02,
                  required_benchmarks=("world",), floors={"memory/world/em": 0.05}, min_eval_n=16)
N = 16  # questions per benchmark in these evaluations


def _model_dir(tmp: Path, content: str = "") -> Path:
    d = tmp / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"model_type": "qwen2"}')
    if content:
        (d / "weights.txt").write_text(content)
    return d


def _eval_dir(tmp: Path, metrics: dict, n: int = N, benchmarks: tuple[str, ...] = ("world",)) -> Path:
    """An eval stage's output: metrics.json and the samples.parquet of `n` questions per benchmark."""
    import pandas as pd

    d = tmp / f"eval-{time.monotonic_ns()}"
    d.mkdir()
    (d / "metrics.json").write_text(json.dumps({**{f"memory/{b}/n": n for b in benchmarks}, **metrics}))
    pd.DataFrame([{"agent": "memory", "benchmark": b, "id": f"{b}-{i}", "question": f"q {i}?",
                   "golden_answers": [f"a{i}"]} for b in benchmarks for i in range(n)]).to_parquet(d / "samples.parquet")
    return d


def _register(tmp: Path, name: str, metrics: dict[str, float], **kw) -> str:
    m = _eval_dir(tmp, metrics) / "metrics.json"
    return register_model(name, _model_dir(tmp, json.dumps(metrics, sort_keys=True)), m,
                          data={"metrics": m}, **kw).version


def _alias(client: mlflow.MlflowClient, name: str, alias: str) -> str | None:
    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except mlflow.exceptions.MlflowException:
        return None


def test_register_logs_a_logged_model_with_its_evidence_and_few_tags(mlflow_uri: str, tmp_path: Path) -> None:
    out = tmp_path / "out" / "registered.json"
    full = {f"{a}/{b}/{m}": 0.1 for a in ("memory", "full_context", "rag", "direct", "external_memory")
            for b in ("world", "world-k2", "world-k4", "world-k8")
            for m in ("em", "f1", "substring_em", "format_valid", "turns", "searches", "latency_s",
                      "peak_prompt_tokens", "total_prompt_tokens", "generated_tokens", "truncated", "memory_probe")}
    full.update({"memory/world/em": 0.4, "memory/world-k2/em": 0.2, "full_context/world-k8/peak_prompt_tokens": 2000.0})
    ev = _eval_dir(tmp_path, full, benchmarks=("world", "world-k2", "world-k4", "world-k8"))
    train_metrics = tmp_path / "train" / "metrics.json"
    train_metrics.parent.mkdir()
    mlflow.set_tracking_uri(mlflow_uri)  # an earlier test may have pointed the fluent API elsewhere
    with mlflow.start_run() as train_run:
        mlflow.set_tag("mempo.stage", "train")
    train_metrics.write_text(json.dumps({"final_reward_mean": 0.3, "final_kl": 0.02, "steps": 20,
                                         "mlflow_run_id": train_run.info.run_id}))
    r = register_model("agent", _model_dir(tmp_path), ev / "metrics.json", data={"qa": ev / "metrics.json"},
                       out=out, train_metrics_path=train_metrics, gate=GATE, headline_out=tmp_path / "headline.json")
    client = mlflow.MlflowClient(mlflow_uri)
    v = client.get_model_version("agent", r.version)
    # The version's tags: the gate's evidence, the headline, lineage; not the ~300 metrics.
    assert len(v.tags) < 40, sorted(v.tags)
    assert version_metrics(v) == {f"memory/{b}/{m}": full[f"memory/{b}/{m}"] if m != "n" else N
                                  for b in ("world", "world-k2", "world-k4", "world-k8") for m in ("em", "f1", "n")}
    assert v.tags["eval_set.world"].startswith(f"n={N} sha256=")
    assert v.tags["headline.em.world"] == "0.4" and v.tags["headline.kl"] == "0.02"
    assert json.loads((tmp_path / "headline.json").read_text())["tok.full"] == 2000.0
    assert v.tags["source_run_id"] == train_run.info.run_id and v.run_id == train_run.info.run_id
    assert len(v.tags["data.qa.sha256"]) == 64
    assert json.loads(out.read_text())["model_uri"] == "models:/agent/1"
    # The logged model: source run = training, every eval metric linked per benchmark.
    lm = client.get_logged_model(r.model_id)
    assert lm.source_run_id == train_run.info.run_id and lm.status == "READY"
    linked = {(m.key, m.dataset_name) for m in lm.metrics}
    assert ("memory/world-k8/latency_s", "world-k8") in linked and len(linked) == len(full) + 4 + 3
    assert json.loads(lm.tags["mlflow.modelVersions"]) == [{"name": "agent", "version": "1"}]
    assert version_metrics(v, client)["rag/world-k4/turns"] == 0.1  # the gate can read the full table
    assert [o.model_id for o in client.get_run(train_run.info.run_id).outputs.model_outputs] == [r.model_id]
    local = mlflow.artifacts.download_artifacts(f"models:/agent/{r.version}", dst_path=str(tmp_path / "dl"))
    assert (Path(local) / "config.json").read_text() == '{"model_type": "qwen2"}'
    with pytest.raises(DataError, match="model folder"):
        register_model("agent", tmp_path / "nope", ev / "metrics.json")
    with pytest.raises(DataError, match="metrics file not found"):
        register_model("agent", _model_dir(tmp_path), tmp_path / "missing.json")


# ---- issue 18.10: register guessed its source runs and duplicated versions on retries


def test_register_links_only_runs_it_can_prove(mlflow_uri: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMPO_PARENT_RUN_ID", raising=False)
    client = mlflow.MlflowClient(mlflow_uri)
    for stage in ("train", "eval"):  # someone else's newest runs, in another experiment
        client.create_run(client.create_experiment(f"other-{stage}"), tags={"mempo.stage": stage})
    ev = _eval_dir(tmp_path, {"memory/world/em": 0.4})
    r = register_model("agent", _model_dir(tmp_path, "a"), ev / "metrics.json")
    tags = client.get_model_version("agent", r.version).tags
    assert (tags["source_run_id"], tags["eval_run_id"]) == ("", "")
    assert r.source_run_id is None and r.eval_run_id is None

    # The ids the stages recorded in their own outputs are used ...
    mlflow.set_tracking_uri(mlflow_uri)  # an earlier test may have pointed the fluent API elsewhere
    with mlflow.start_run() as train_run, mlflow.start_run(nested=True) as eval_run:
        pass
    (ev / "eval.json").write_text(json.dumps({"mlflow_run_id": eval_run.info.run_id}))
    (tmp_path / "train.json").write_text(json.dumps({"mlflow_run_id": train_run.info.run_id}))
    r = register_model("agent", _model_dir(tmp_path, "b"), ev / "metrics.json", train_metrics_path=tmp_path / "train.json")
    assert (r.source_run_id, r.eval_run_id) == (train_run.info.run_id, eval_run.info.run_id)
    # ... an id this store does not know is not linked, and a given one must exist.
    (ev / "eval.json").write_text(json.dumps({"mlflow_run_id": "0" * 32}))
    r = register_model("agent", _model_dir(tmp_path, "c"), ev / "metrics.json")
    assert r.eval_run_id is None
    with pytest.raises(MempoError, match="not found in the tracking store"):
        register_model("agent", _model_dir(tmp_path, "d"), ev / "metrics.json", eval_run_id="f" * 32)
    # Under a pipeline run, its own stage runs are found.
    parent = client.create_run(client.get_experiment_by_name("other-train").experiment_id)
    child = client.create_run(parent.info.experiment_id,
                              tags={"mempo.stage": "train", "mlflow.parentRunId": parent.info.run_id})
    monkeypatch.setenv("MEMPO_PARENT_RUN_ID", parent.info.run_id)
    (ev / "eval.json").unlink()
    r = register_model("agent", _model_dir(tmp_path, "e"), ev / "metrics.json")
    assert (r.source_run_id, r.eval_run_id) == (child.info.run_id, None)
    # Under DVC: the train stage's run, not the full-history train_full run (the same code,
    # mempo.stage "train") that ran beside it and started later.
    dvc_parent = client.create_run(parent.info.experiment_id)
    pid = dvc_parent.info.run_id
    train = client.create_run(parent.info.experiment_id, tags={
        "mempo.stage": "train", "dvc.stage": "train", "mlflow.parentRunId": pid})
    client.create_run(parent.info.experiment_id, start_time=train.info.start_time + 1000, tags={
        "mempo.stage": "train", "dvc.stage": "train_full", "mlflow.parentRunId": pid})
    monkeypatch.setenv("MEMPO_PARENT_RUN_ID", pid)
    r = register_model("agent", _model_dir(tmp_path, "f"), ev / "metrics.json")
    assert r.source_run_id == train.info.run_id


def test_a_retried_registration_returns_the_version_it_created(mlflow_uri: str, tmp_path: Path) -> None:
    client = mlflow.MlflowClient(mlflow_uri)
    ev = _eval_dir(tmp_path, {"memory/world/em": 0.4})
    first = register_model("agent", _model_dir(tmp_path, "w1"), ev / "metrics.json", out=tmp_path / "r1.json")
    again = register_model("agent", _model_dir(tmp_path, "w1"), ev / "metrics.json", out=tmp_path / "r2.json")
    assert first.created and not again.created
    assert (again.version, again.model_id, again.registration_key) == (first.version, first.model_id,
                                                                      first.registration_key)
    assert json.loads((tmp_path / "r2.json").read_text())["version"] == first.version
    assert len(client.search_model_versions("name = 'agent'")) == 1
    # Another model (or another evaluation of it) is a new version.
    other = register_model("agent", _model_dir(tmp_path, "w2"), ev / "metrics.json")
    assert other.created and other.version == "2"


def _start_race(procs: list[subprocess.Popen], ready: list[Path], start: Path) -> None:
    """Touch `start` once every racer has imported mlflow (however slow the machine is)."""
    deadline = time.monotonic() + 600
    while not all(r.exists() for r in ready):
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        assert time.monotonic() < deadline, "racers did not start"
        time.sleep(0.05)
    start.touch()


REGISTER_RACER = """
import sys, time
from pathlib import Path
from mempo.registry.register import register_model
start = Path(sys.argv[3])
Path(sys.argv[4]).touch()  # imported: ready to race
while not start.exists():
    time.sleep(0.01)
print(register_model("agent", sys.argv[1], sys.argv[2]).version)
"""


def test_two_racing_retries_of_one_registration_create_one_version(mlflow_uri: str, tmp_path: Path) -> None:
    ev = _eval_dir(tmp_path, {"memory/world/em": 0.4})
    model, start = _model_dir(tmp_path, "race"), tmp_path / "go"
    mlflow.MlflowClient(mlflow_uri).search_experiments()  # create the store's tables before the race
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri, "MEMPO_PROJECT_ROOT": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", REGISTER_RACER, str(model), str(ev / "metrics.json"), str(start),
                               str(tmp_path / f"ready-{i}")],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    _start_race(procs, [tmp_path / f"ready-{i}" for i in range(2)], start)
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert [o[0].strip().splitlines()[-1] for o in outs] == ["1", "1"]
    assert len(mlflow.MlflowClient(mlflow_uri).search_model_versions("name = 'agent'")) == 1


def test_promotion_lifecycle_is_gated_and_idempotent(mlflow_uri: str, tmp_path: Path) -> None:
    client = mlflow.MlflowClient(mlflow_uri)
    v1 = _register(tmp_path, "agent", {"memory/world/em": 0.30, "memory/world/f1": 0.5})
    d1 = promote("agent", GATE, out=tmp_path / "d1.json")
    assert d1.promoted and d1.champion_version is None and _alias(client, "agent", CHAMPION) == v1
    again = promote("agent", GATE)
    assert again.promoted and again.already_champion and _alias(client, "agent", CHAMPION) == v1

    v2 = _register(tmp_path, "agent", {"memory/world/em": 0.25, "memory/world/f1": 0.5})
    d2 = promote("agent", GATE)
    assert not d2.promoted and d2.champion_version == v1
    assert _alias(client, "agent", CHAMPION) == v1 and _alias(client, "agent", CHALLENGER) == v2
    tags = client.get_model_version("agent", v2).tags
    assert tags["promotion.decision"] == "rejected"
    assert any(c["name"] == "gain:memory/world/em" and not c["passed"] for c in json.loads(tags["promotion.checks"]))
    assert promote("agent", GATE).promoted is False  # the same decision again

    v3 = _register(tmp_path, "agent", {"memory/world/em": 0.35, "memory/world/f1": 0.49})
    d3 = promote("agent", GATE)
    assert d3.promoted and _alias(client, "agent", CHAMPION) == v3
    assert _alias(client, "agent", CHALLENGER) is None
    assert client.get_model_version("agent", v1).tags["promotion.superseded_by"] == v3
    assert json.loads((tmp_path / "d1.json").read_text())["promoted"] is True
    # Aliases only: no version was ever moved to a deprecated stage.
    assert {v.current_stage for v in client.search_model_versions("name = 'agent'")} <= {"None", None}
    with pytest.raises(MempoError, match="no registered versions"):
        promote("ghost", GATE)


metric_tables = st.fixed_dictionaries(
    {}, optional={"memory/world/em": st.floats(0, 1), "memory/world/f1": st.floats(0, 1)}
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(champion=metric_tables, challenger=metric_tables)
def test_evidence_is_always_written_and_aliases_follow_the_gate(
    mlflow_uri: str, tmp_path: Path, champion: dict, challenger: dict
) -> None:
    client = mlflow.MlflowClient(mlflow_uri)
    name = f"m{time.monotonic_ns()}"
    v1 = _register(tmp_path, name, {**champion, "seed": 1.0})
    client.set_registered_model_alias(name, CHAMPION, v1)  # installed by hand, whatever its numbers
    v2 = _register(tmp_path, name, {**challenger, "seed": 2.0})
    d = promote(name, GATE)
    tags = client.get_model_version(name, v2).tags
    assert tags["promotion.decision"] == ("promoted" if d.promoted else "rejected")
    assert tags["promotion.champion_version"] == v1
    assert json.loads(tags["promotion.gate"])["primary_metric"] == "memory/world/em"
    assert _alias(client, name, CHAMPION) == (v2 if d.promoted else v1)
    if d.promoted:
        assert challenger["memory/world/em"] >= 0.05
        if "memory/world/em" in champion:
            assert challenger["memory/world/em"] >= champion["memory/world/em"]


def test_lock_excludes_a_second_holder_and_breaks_stale_locks(mlflow_uri: str) -> None:
    client = mlflow.MlflowClient(mlflow_uri)
    with promotion_lock(client, "agent"):
        with pytest.raises(MempoError, match="locked by another process"):
            with promotion_lock(client, "agent", wait_s=0.3):
                pass
    # A crashed holder's lock is broken once stale.
    client.create_registered_model("agent.promotion-lock", tags={"owner": "dead", "acquired_at": "0"})
    with promotion_lock(client, "agent", wait_s=5, stale_s=60) as token:
        assert client.get_registered_model("agent.promotion-lock").tags["owner"] == token
    assert not client.search_registered_models("name = 'agent.promotion-lock'")


def test_lock_is_taken_when_the_holder_releases_inside_the_stores_create(mlflow_uri: str, monkeypatch) -> None:
    # The race CI hit: the sqlite store answers a duplicate create (IntegrityError) by reading the
    # existing model back for its message; when the holder deletes the lock in between, the
    # create fails with RESOURCE_DOES_NOT_EXIST instead of RESOURCE_ALREADY_EXISTS. The real
    # store, with that interleaving forced: the other holder releases at the store's read-back.
    client = mlflow.MlflowClient(mlflow_uri)
    client.create_registered_model("agent.promotion-lock", tags={"owner": "other", "acquired_at": f"{time.time()}"})
    store = client._get_registry_client().store
    real_get, released = store.get_registered_model, []

    def get_after_release(name):
        if not released:
            released.append(name)
            store.delete_registered_model(name)
        return real_get(name)

    monkeypatch.setattr(store, "get_registered_model", get_after_release)
    with promotion_lock(client, "agent", wait_s=5) as token:
        assert released == ["agent.promotion-lock"]
        assert client.get_registered_model("agent.promotion-lock").tags["owner"] == token
    assert not client.search_registered_models("name = 'agent.promotion-lock'")


RACER = """
import sys, time
from pathlib import Path
from mempo.registry.gate import GateConfig
from mempo.registry.promote import promote
gate = GateConfig(primary_metric="memory/world/em", required_benchmarks=())
start = Path(sys.argv[2])
Path(sys.argv[3]).touch()  # imported: ready to race
while not start.exists():
    time.sleep(0.01)
d = promote("agent", gate, version=sys.argv[1], lock_wait_s=600)
print("PROMOTED" if d.promoted else "REJECTED")
"""


def test_two_racing_promotions_end_with_the_best_champion(mlflow_uri: str, tmp_path: Path) -> None:
    client = mlflow.MlflowClient(mlflow_uri)
    v1 = _register(tmp_path, "agent", {"memory/world/em": 0.30})
    client.set_registered_model_alias("agent", CHAMPION, v1)
    v2 = _register(tmp_path, "agent", {"memory/world/em": 0.50})
    v3 = _register(tmp_path, "agent", {"memory/world/em": 0.40})
    start = tmp_path / "go"
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, v, str(start), str(tmp_path / f"ready-{v}")],
                              env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in (v2, v3)]
    _start_race(procs, [tmp_path / f"ready-{v}" for v in (v2, v3)], start)
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    # Either order, serialised: v2 (0.50) must end as champion. Without the lock both could
    # compare against v1 and the later writer (possibly v3) would win.
    assert _alias(client, "agent", CHAMPION) == v2
    assert outs[0][0].strip().endswith("PROMOTED")
    t3 = client.get_model_version("agent", v3).tags
    if outs[1][0].strip().endswith("PROMOTED"):
        assert t3["promotion.champion_version"] == v1 and t3["promotion.superseded_by"] == v2
    else:
        assert t3["promotion.champion_version"] == v2
    assert not client.search_registered_models("name = 'agent.promotion-lock'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_register_and_promote_against_an_mlflow_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server-artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "mlflow server did not come up"
            time.sleep(0.5)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.delenv("MLFLOW_ARTIFACTS_DESTINATION", raising=False)
        v1 = _register(tmp_path, "agent", {"memory/world/em": 0.3})
        assert promote("agent", GATE).promoted
        v2 = _register(tmp_path, "agent", {"memory/world/em": 0.2})
        assert not promote("agent", GATE).promoted
        client = mlflow.MlflowClient(uri)
        assert _alias(client, "agent", CHAMPION) == v1
        assert client.get_model_version("agent", v2).tags["promotion.decision"] == "rejected"
        local = mlflow.artifacts.download_artifacts(f"models:/agent@{CHAMPION}", dst_path=str(tmp_path / "dl"))
        assert (Path(local) / "config.json").exists()
        assert (tmp_path / "server-artifacts").is_dir()  # artifacts went through the server
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_cli_register_and_promote(mlflow_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mempo.cli import main

    model = _model_dir(tmp_path)
    good = _eval_dir(tmp_path, {"memory/world/em": 0.4}) / "metrics.json"
    bad = _eval_dir(tmp_path, {"memory/world/em": 0.1}) / "metrics.json"
    common = ["--params", str(tmp_path / "none.yaml"), "--set", "register.data={}"]
    assert main([*common, "register", "--name", "cli", "--model-dir", str(model), "--metrics", str(good),
                 "--out", str(tmp_path / "reg")]) == 0
    assert main([*common, "promote", "--registered", str(tmp_path / "reg" / "registered.json"),
                 "--out", str(tmp_path / "pro")]) == 0
    assert json.loads((tmp_path / "pro" / "decision.json").read_text())["promoted"] is True
    assert main([*common, "register", "--name", "cli", "--model-dir", str(model), "--metrics", str(bad),
                 "--out", str(tmp_path / "reg")]) == 0
    assert main([*common, "promote", "--model", "cli", "--fail-if-rejected", "--out", str(tmp_path / "pro")]) == 4
    out = capsys.readouterr().out
    assert "cli v2 vs champion v1: REJECTED" in out
    assert main([*common, "promote", "--registered", str(tmp_path / "missing.json")]) == 2
