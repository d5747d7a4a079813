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
from mempo.registry import (
    CHALLENGER,
    CHAMPION,
    GateConfig,
    promote,
    promotion_lock,
    register_model,
    version_metrics,
)

GATE = GateConfig(primary_metric="memory/world/em", min_gain=0.0, tolerance=0.02,
                  required_benchmarks=("world",), floors={"memory/world/em": 0.05})


def _model_dir(tmp: Path) -> Path:
    d = tmp / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"model_type": "qwen2"}')
    return d


def _register(tmp: Path, name: str, metrics: dict[str, float]) -> str:
    m = tmp / f"metrics-{time.monotonic_ns()}.json"
    m.write_text(json.dumps(metrics))
    return register_model(name, _model_dir(tmp), m, data={"metrics": m}).version


def _alias(client: mlflow.MlflowClient, name: str, alias: str) -> str | None:
    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except mlflow.exceptions.MlflowException:
        return None


def test_register_records_metrics_lineage_and_artifacts(mlflow_uri: str, tmp_path: Path) -> None:
    out = tmp_path / "out" / "registered.json"
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"memory/world/em": 0.4, "memory": {"world-k2": {"em": 0.2}}, "note": "x"}))
    with mlflow.start_run() as train_run:
        mlflow.set_tag("mempo.stage", "train")
    r = register_model("agent", _model_dir(tmp_path), metrics, data={"qa": metrics}, out=out,
                       source_run_id=train_run.info.run_id)
    client = mlflow.MlflowClient(mlflow_uri)
    v = client.get_model_version("agent", r.version)
    assert version_metrics(v) == {"memory/world/em": 0.4, "memory/world-k2/em": 0.2}
    assert v.tags["source_run_id"] == train_run.info.run_id
    assert len(v.tags["data.qa.sha256"]) == 64
    assert v.run_id == r.run_id
    assert json.loads(out.read_text())["model_uri"] == "models:/agent/1"
    local = mlflow.artifacts.download_artifacts(f"models:/agent/{r.version}", dst_path=str(tmp_path / "dl"))
    assert (Path(local) / "config.json").read_text() == '{"model_type": "qwen2"}'
    with pytest.raises(DataError, match="model folder"):
        register_model("agent", tmp_path / "nope", metrics)
    with pytest.raises(DataError, match="metrics file not found"):
        register_model("agent", _model_dir(tmp_path), tmp_path / "missing.json")


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


RACER = """
import sys, time
from pathlib import Path
from mempo.registry import GateConfig, promote
gate = GateConfig(primary_metric="memory/world/em", required_benchmarks=())
start = Path(sys.argv[2])
while not start.exists():
    time.sleep(0.01)
d = promote("agent", gate, version=sys.argv[1])
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
    procs = [subprocess.Popen([sys.executable, "-c", RACER, v, str(start)], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in (v2, v3)]
    time.sleep(4)  # both have imported mlflow and wait on the start file
    start.touch()
    outs = [p.communicate(timeout=120) for p in procs]
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
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"memory/world/em": 0.4}))
    bad.write_text(json.dumps({"memory/world/em": 0.1}))
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
