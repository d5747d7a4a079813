"""SIGTERM (an Airflow timeout, a pod eviction, `kill PID`) unwinds the CLI like Ctrl-C: the
stage's MLflow run ends FAILED and the process exits 143; `mempo pipeline run` stops the
`dvc repro` it started (and its stage) and the retrieval service, orphaning nothing.
`--force` re-runs every stage, and the summary lists the stages that really ran.
Real processes, real signals, real DVC and a real retrieval service on loopback."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlflow
import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MEMPO_PARENT_RUN_ID", "DVC_ROOT", "MEMPO_PROJECT_ROOT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env["MLFLOW_ARTIFACTS_DESTINATION"] = str(tmp_path / "mlartifacts")
    env.update(extra)
    return env


def _read_until(proc: subprocess.Popen[str], needle: str, timeout_s: float = 300) -> str:
    """stdout lines until one contains `needle` (fails with what was read on timeout or exit)."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            if needle in line:
                return line
        elif proc.poll() is not None:
            break
    raise AssertionError(f"never saw {needle!r}; output:\n{''.join(seen)[-3000:]}")


def _runs(tmp_path: Path, stage: str) -> list[str]:
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("mempo")
    assert exp is not None
    return [r.info.status for r in client.search_runs([exp.experiment_id], f"tags.`mempo.stage` = '{stage}'")]


SLEEPY_STAGE = """
import sys, time
import mempo.training.grpo as grpo

def sleepy(params):
    print("inside the stage", flush=True)
    time.sleep(300)

grpo._run_grpo = sleepy  # the real CLI, the real stage_run around a stage that takes long
from mempo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_ends_the_stage_run_failed_and_exits_143(tmp_path: Path) -> None:
    policy, data = tmp_path / "policy", tmp_path / "data"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    data.mkdir()
    (data / "train.parquet").write_bytes(b"PAR1")
    cmd = [sys.executable, "-c", SLEEPY_STAGE, "--params", str(tmp_path / "none.yaml"),
           "--set", f"train.policy={policy}", "--set", f"train.data={data}", "train", "grpo"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _read_until(proc, "inside the stage", timeout_s=120)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert "terminated" in err
    assert _runs(tmp_path, "train") == ["FAILED"]


CONSUME = """
import os, time
import httpx
url = os.environ["MEMPO_RETRIEVER_URL"]
body = httpx.post(url + "/retrieve", json={"queries": ["alpha"], "topk": 1}, timeout=30).json()
assert body["result"][0], body
if os.environ.get("BLOCK_STAGE"):
    print("stage running", flush=True)
    time.sleep(300)
with open("runs.log", "a") as fh:
    fh.write("consume\\n")
with open("c.txt", "w") as fh:
    fh.write("ok")
"""


def _project(root: Path) -> Path:
    """A DVC project: an index stage, a stage the retrieval service serves, and one unrelated."""
    root.mkdir()
    (root / "corpus.jsonl").write_text("".join(
        f'{{"id": "{i}", "contents": "Doc {i}\\nalpha beta {i}"}}\n' for i in range(20)))
    (root / "consume.py").write_text(textwrap.dedent(CONSUME))
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "index": {"cmd": "mempo index build --corpus corpus.jsonl --out idx --method bm25 && echo index >> runs.log",
                  "deps": ["corpus.jsonl"], "outs": ["idx"]},
        "unrelated": {"cmd": "echo unrelated >> runs.log && echo u > u.txt", "outs": ["u.txt"]},
        "consume": {"cmd": "python consume.py", "deps": ["idx", "u.txt", "consume.py"], "outs": ["c.txt"]},
    }}))
    (root / "params.yaml").write_text(yaml.safe_dump({"pipeline": {
        "serve_retriever": True, "retriever_stages": ["consume"], "index_stage": "index", "index_dir": "idx",
        "promote": False, "retriever_start_timeout_s": 120}}))
    (root / ".gitignore").write_text("mlflow.db\nmlartifacts/\noutputs/\n")
    for cmd in (["git", "init", "-q"], [str(Path(sys.executable).parent / "dvc"), "init", "-q"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    return root


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_sigterm_to_pipeline_run_stops_dvc_its_stage_and_the_retriever(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")
    proc = subprocess.Popen([sys.executable, "-m", "mempo", "pipeline", "run"], cwd=root,
                            env=_env(tmp_path, BLOCK_STAGE="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    started: list[psutil.Process] = []
    try:
        url_line = _read_until(proc, "retrieval service up at")
        port = int(url_line.split("http://127.0.0.1:")[1].split()[0])
        _read_until(proc, "stage running")
        started = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert "serve retriever" in names and "consume.py" in names and "repro" in names
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 143, out[-3000:]
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        assert _port_closed(port)
        assert _runs(tmp_path, "pipeline") == ["FAILED"]
    finally:
        for p in started:
            if p.is_running():
                p.kill()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_force_reruns_every_stage_and_the_summary_says_what_ran(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from mempo.pipeline import run_pipeline

    root = _project(tmp_path / "proj")
    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    first = run_pipeline(root)
    assert sorted(first.ran) == ["consume", "index", "unrelated"]
    (root / "runs.log").unlink()

    again = run_pipeline(root)
    assert again.ran == [] and not (root / "runs.log").exists()

    forced = run_pipeline(root, force=True)
    log = (root / "runs.log").read_text().split()
    assert sorted(log) == ["consume", "index", "unrelated"]  # each stage once
    assert sorted(forced.ran) == sorted(log)
