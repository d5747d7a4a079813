"""The whole pipeline on the tiny profile, from a copy of the checkout:

- `mempo pipeline run` (what `make run` calls: dvc repro under an MLflow parent run, the
  retrieval service for the stages that need it, the promotion gate) ends with a registered
  champion and the report; a second run is a DVC no-op; changing `mempo.lambda_mem` makes
  DVC re-run exactly train -> eval -> register;
- `airflow dags test mempo_retrain` on the same tiny inputs (local mode: the same CLI);
  opt-in with MEMPO_AIRFLOW_E2E=1 (see its skip reason).

Both are slow (minutes); they share one project built once per module.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "DVC_", "MEMPO_", "AIRFLOW"))}
    env.update({"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "MLFLOW_ENABLE_ASYNC_LOGGING": "false",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "DVC_NO_ANALYTICS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(cwd), **env}  # the project's own code, not whatever mempo is installed
    proc = subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def tiny_project(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A fresh clone of the committed tree after one `mempo pipeline run --params params.tiny.yaml`.

    Commit your work first: like a user's clone, this sees only what git has. Its stages run
    the clone's own code (PYTHONPATH).
    """
    root = tmp_path_factory.mktemp("project") / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(root)], check=True, capture_output=True)
    t0 = time.perf_counter()
    first = _run([str(BIN / "mempo"), "pipeline", "run", "--params", "params.tiny.yaml"], root)
    seconds = time.perf_counter() - t0
    _git(root, "commit", "-qm", "tiny profile", "params.yaml")  # what --params wrote; dvc.lock stays uncommitted
    return {"root": root, "first": first, "first_seconds": seconds}


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=root,
                          check=True, capture_output=True, text=True).stdout


def _ran(proc: subprocess.CompletedProcess) -> list[str]:
    return re.findall(r"Running stage '([\w-]+)'", proc.stdout + proc.stderr)


def test_make_run_ends_with_a_registered_champion_and_the_report(tiny_project: dict) -> None:
    root, out = tiny_project["root"], tiny_project["first"].stdout
    stages = list(yaml.safe_load((root / "dvc.yaml").read_text())["stages"])
    assert sorted(_ran(tiny_project["first"])) == sorted(stages)
    assert (root / "outputs" / "eval" / "report.md").is_file()
    assert "Report:" in out and "MLflow UI:" in out and "Registered:  models:/mempo-agent/1" in out
    assert "Promotion:   mempo-agent v1 vs no champion: PROMOTED" in out
    # The default store is the project's sqlite file; stage runs nest under the parent run.
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    assert client.get_model_version_by_alias("mempo-agent", "champion").version in (1, "1")
    exp = client.get_experiment_by_name("mempo")
    parents = client.search_runs([exp.experiment_id], "tags.`mempo.stage` = 'pipeline'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    # keyed by DVC stage: `train` and `train_full` both run `mempo train grpo`
    by_stage = {r.data.tags.get("dvc.stage", r.data.tags["mempo.stage"]): r for r in children}
    assert {"sft", "train", "eval", "register", "promote"} <= set(by_stage)
    for run in by_stage.values():
        assert run.data.tags["mlflow.source.git.commit"] != "unknown"
        assert run.info.status == "FINISHED"
    train_tags = by_stage["train"].data.tags
    assert train_tags["dvc.stage"] == "train"
    assert "dvc.deps.outputs/sft/model" in train_tags and "dvc.params.sha256" in train_tags
    assert "dvc.outs.outputs/train/model" in train_tags
    assert [a.path for a in client.list_artifacts(parents[0].info.run_id)] == ["dvc.lock"]
    # The retrieval service was started for the stages that need it, and stopped.
    match = re.search(r"retrieval service at (http://127\.0\.0\.1:(\d+))", out)
    assert match, out[-3000:]
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(match.group(2)))) != 0, "the retrieval service is still up"
    # The version: a logged model linked to the train and eval runs, and few tags.
    version = client.get_model_version("mempo-agent", "1")
    assert version.tags["source_run_id"] == by_stage["train"].info.run_id
    assert version.tags["eval_run_id"] == by_stage["eval"].info.run_id
    assert version.tags["eval_set.world"].startswith("n=2 ")
    assert len(version.tags) < 45, sorted(version.tags)
    model = client.get_logged_model(version.source.removeprefix("models:/"))
    assert model.source_run_id == by_stage["train"].info.run_id
    assert {m.run_id for m in model.metrics} >= {by_stage["eval"].info.run_id}
    print(f"\nmake run (tiny) wall time: {tiny_project['first_seconds']:.0f} s")


def test_a_fresh_clone_run_leaves_dvc_and_git_clean(tiny_project: dict) -> None:
    root = tiny_project["root"]
    assert json.loads(_run([str(BIN / "dvc"), "status", "--json"], root).stdout) == {}
    # No untracked DVC file (a .gitignore DVC had to add, a stray lock): only dvc.lock changed.
    changed = _git(root, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert [line for line in changed if not line.endswith(" dvc.lock")] == [], changed
    # `dvc metrics show`: one file, one row, the headline numbers only.
    shown = _run([str(BIN / "dvc"), "metrics", "show"], root).stdout.strip().splitlines()
    assert len(shown) == 2 and shown[1].startswith("outputs/register/headline.json"), shown
    headline = json.loads((root / "outputs" / "register" / "headline.json").read_text())
    assert set(headline) == {"em.world", "tok.memory", "reward", "kl"}
    assert headline["em.world"] == json.loads((root / "outputs" / "eval" / "metrics.json").read_text())[
        "memory/world/em"]


def test_second_run_is_a_noop(tiny_project: dict) -> None:
    root = tiny_project["root"]
    lock = (root / "dvc.lock").read_text()
    second = _run([str(BIN / "mempo"), "pipeline", "run"], root)
    assert _ran(second) == []
    assert "stages run: nothing (up to date)" in second.stdout
    assert (root / "dvc.lock").read_text() == lock
    status = _run([str(BIN / "dvc"), "status", "--json"], root)
    assert json.loads(status.stdout) == {}


def test_a_clone_with_dvc_pull_reproduces_nothing(tiny_project: dict, tmp_path: Path) -> None:
    root = tiny_project["root"]
    _git(root, "add", "dvc.lock")
    _git(root, "commit", "-qm", "dvc.lock of the tiny run")
    clone = tmp_path / "second"
    _git(tmp_path, "clone", "-q", str(root), str(clone))
    # The default remote is the ignored folder .dvc-remote/ of each clone; this one reads
    # the first clone's, where `mempo pipeline run` pushed.
    _run([str(BIN / "dvc"), "remote", "modify", "--local", "local", "url", str(root / ".dvc-remote")], clone)
    _run([str(BIN / "dvc"), "pull"], clone)
    assert json.loads(_run([str(BIN / "dvc"), "status", "--json"], clone).stdout) == {}
    repro = _run([str(BIN / "dvc"), "repro"], clone)
    assert _ran(repro) == [], repro.stdout[-2000:]
    for rel in ("outputs/train/model", "outputs/eval/metrics.json", "outputs/register/headline.json", "data/world"):
        assert (clone / rel).exists(), rel
    assert (clone / "outputs/eval/metrics.json").read_bytes() == (root / "outputs/eval/metrics.json").read_bytes()
    # `make run` there: nothing to do; the registered version lives in the first clone's
    # MLflow store, so the gate is skipped with a note rather than failing.
    run = _run([str(BIN / "mempo"), "pipeline", "run"], clone)
    assert "stages run: nothing (up to date)" in run.stdout
    assert "Promotion:   skipped: models:/mempo-agent/1 is not in this MLflow store" in run.stdout


def test_lambda_mem_change_reruns_only_train_eval_register(tiny_project: dict) -> None:
    root = tiny_project["root"]
    params = yaml.safe_load((root / "params.yaml").read_text())
    before = params["mempo"]["lambda_mem"]
    params["mempo"]["lambda_mem"] = 0.25
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        status = json.loads(_run([str(BIN / "dvc"), "status", "--json"], root).stdout)
        # train_full pins lambda_mem to 0 and does not list it among its params
        assert sorted(status) == ["train"]
        dry = _run([str(BIN / "dvc"), "repro", "--dry", "--force-downstream"], root)
        assert sorted(_ran(dry)) == ["eval", "register", "train"]
    finally:
        params["mempo"]["lambda_mem"] = before
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_ablations_run_as_dvc_experiments_and_compare_in_dvc_exp_show(tiny_project: dict) -> None:
    root = tiny_project["root"]
    proc = _run([sys.executable, "-m", "mempo.ablation", "--only", "mempo", "no-mem-adv"], root, timeout=1500)
    table = proc.stdout
    assert "[mempo]" in table and "[no-mem-adv]" in table, table
    exps = json.loads(_run([str(BIN / "dvc"), "exp", "show", "--json"], root).stdout)
    found = {}
    for rev in exps:
        for exp in rev.get("experiments") or []:
            for run in exp.get("revs") or []:
                if run.get("name") in ("mempo", "no-mem-adv"):
                    params = run["data"]["params"]["params.yaml"]["data"]
                    metrics = run["data"]["metrics"]["outputs/register/headline.json"]["data"]
                    found[run["name"]] = (params["mempo"]["lambda_mem"], params["world"]["size"], metrics)
    assert set(found) == {"mempo", "no-mem-adv"}, json.dumps(exps)[:3000]
    assert found["no-mem-adv"][0] == 0 and found["mempo"][0] == 0.5
    assert {f[1] for f in found.values()} == {"tiny"}
    assert all("em.world" in f[2] and "kl" in f[2] for f in found.values())
    # Their runs went to the project's store, their models to the ablation model, not the production one.
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    assert client.get_experiment_by_name("mempo-ablations") is not None
    assert len(client.search_model_versions("name = 'mempo-agent-ablation'")) == 2
    assert len(client.search_model_versions("name = 'mempo-agent'")) == 1


@pytest.mark.skipif(
    os.environ.get("MEMPO_AIRFLOW_E2E") != "1",
    reason="about 3 min (db migrate ~20 s + the DAG run ~160 s on 2 cores) repeating stage runs the "
    "DVC and kfp.local tests already cover; CI leaves it to MEMPO_AIRFLOW_E2E=1. The DAG-integrity "
    "tests parse every task's CLI arguments with the real parser on every run.",
)
def test_airflow_dags_test_mempo_retrain_on_the_tiny_world(tiny_project: dict, tmp_path: Path) -> None:
    root = tiny_project["root"]
    home = tmp_path / "airflow_home"
    env = {
        "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "MEMPO_AIRFLOW_MODE": "local",
        "MEMPO_CLI": str(BIN / "mempo"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "MLFLOW_ARTIFACTS_DESTINATION": str(tmp_path / "mlartifacts"), "PYTHONPATH": str(root),
    }
    _run([str(BIN / "airflow"), "db", "migrate"], tmp_path, **env)
    conf = {
        "workdir": str(tmp_path / "runs"), "project_dir": str(root), "params_file": "params.yaml",
        "qa_dir": str(root / "data" / "world" / "qa"), "init_model": str(root / "outputs" / "sft" / "model"),
        "retriever": str(root / "outputs" / "index"), "eval_limit": 2,
    }
    t0 = time.perf_counter()
    proc = _run([str(BIN / "airflow"), "dags", "test", "mempo_retrain", "-c", json.dumps(conf)], tmp_path,
                timeout=1200, **env)
    print(f"\nairflow dags test mempo_retrain (tiny): {time.perf_counter() - t0:.0f} s")
    text = proc.stdout + proc.stderr
    assert "failed" not in re.findall(r"state=(\w+)", text)
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    decision = json.loads((runs[0] / "promote" / "decision.json").read_text())
    assert decision["promoted"] is True and decision["champion_version"] is None
    registered = json.loads((runs[0] / "register" / "registered.json").read_text())
    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert str(client.get_model_version_by_alias("mempo-agent", "champion").version) == registered["version"]
    assert (runs[0] / "eval" / "metrics.json").is_file() and (runs[0] / "train" / "model").is_dir()
