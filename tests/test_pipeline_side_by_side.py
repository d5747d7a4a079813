"""`mempo pipeline run` trains stages that need nothing of each other side by side
(`pipeline.parallel_stages`), each through its own `dvc repro --single-item` (DVC releases its
repository lock while a stage's command runs). Real DVC, real processes. The two stages of the toy project wait for each other
to start, so a run that did them one after the other fails instead of passing slowly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

STAGE = """
import os, pathlib, sys, time
me = sys.argv[1]
other = {"a": "b", "b": "a"}[me]
pathlib.Path(f"started_{me}").write_text(os.environ.get("DVC_STAGE", ""))
with open("runs.log", "a") as fh:
    fh.write(me + "\\n")
print(f"{me}: 50%|#####     | 1/2", flush=True)
if os.environ.get("FAIL") == me:
    sys.exit(3)
if os.environ.get("HANG") == me:
    time.sleep(600)
if os.environ.get("WAIT_FOR_PEER") == "1":
    deadline = time.time() + float(os.environ.get("PEER_WAIT_S", "120"))
    while not pathlib.Path(f"started_{other}").exists():
        if time.time() > deadline:
            sys.exit(f"{me}: {other} never started beside me")
        time.sleep(0.05)
pathlib.Path(f"{me}.txt").write_text(me + pathlib.Path("prep.txt").read_text())
"""


def _project(root: Path, parallel: list[list[str]]) -> Path:
    root.mkdir()
    (root / "stage.py").write_text(textwrap.dedent(STAGE))
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "prep": {"cmd": "echo p > prep.txt", "deps": ["stage.py"], "outs": ["prep.txt"]},
        "a": {"cmd": "python stage.py a", "deps": ["prep.txt", "stage.py"], "outs": ["a.txt"]},
        "b": {"cmd": "python stage.py b", "deps": ["prep.txt", "stage.py"], "outs": ["b.txt"]},
        "join": {"cmd": "cat a.txt b.txt > j.txt", "deps": ["a.txt", "b.txt"], "outs": ["j.txt"]},
    }}))
    (root / "params.yaml").write_text(yaml.safe_dump({"pipeline": {
        "serve_retriever": False, "promote": False, "parallel_stages": parallel}}))
    (root / ".gitignore").write_text("mlflow.db\nmlartifacts/\noutputs/\nstarted_*\nruns.log\n")
    for cmd in (["git", "init", "-q"], [str(Path(sys.executable).parent / "dvc"), "init", "-q"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    return root


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("MEMPO_PARENT_RUN_ID", "DVC_ROOT", "MEMPO_PROJECT_ROOT", "FAIL", "HANG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_ARTIFACTS_DESTINATION", str(tmp_path / "mlartifacts"))
    monkeypatch.setenv("WAIT_FOR_PEER", "1")


def _runs(root: Path) -> list[str]:
    return (root / "runs.log").read_text().split() if (root / "runs.log").exists() else []


def _clear(root: Path) -> None:
    for f in ("started_a", "started_b", "runs.log"):
        (root / f).unlink(missing_ok=True)


def _stage_procs() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(c == "stage.py" for c in cmd):
            out.append(p)
    return out


@pytest.mark.slow
def test_a_stale_group_runs_side_by_side_and_is_committed(tmp_path: Path, env: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from mempo.dvc_runner import stale_stages
    from mempo.pipeline import run_pipeline

    root = _project(tmp_path / "proj", [["a", "b"]])
    result = run_pipeline(root)
    assert sorted(result.ran) == ["a", "b", "join", "prep"] and result.side_by_side == [["a", "b"]]
    assert (root / "j.txt").read_text() == "ap\nbp\n"  # both waited for the other: they overlapped
    assert (root / "started_b").read_text() == "b"  # DVC_STAGE, as DVC sets it
    assert "b: 50%" in (root / "outputs" / "logs" / "b.log").read_text()
    out = capsys.readouterr().out
    assert "Reproducing 'b' beside" in out and "[b] Running stage 'b'" in out  # its output relayed, prefixed
    assert stale_stages(root) == []  # both DVC processes recorded their stage in dvc.lock
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert lock["b"]["outs"][0]["path"] == "b.txt" and lock["b"]["cmd"] == "python stage.py b"

    _clear(root)
    assert run_pipeline(root).ran == [] and _runs(root) == []

    # a change both depend on makes both stale again; reverting it, the run cache has both
    stage = (root / "stage.py").read_text()
    (root / "stage.py").write_text(stage + "\n# changed\n")
    assert sorted(run_pipeline(root).ran) == ["a", "b", "prep"]  # the same a.txt, b.txt: join is not stale
    _clear(root)
    (root / "stage.py").write_text(stage)
    again = run_pipeline(root)
    assert _runs(root) == [] and again.ran == []  # restored from the run cache by both DVC processes
    assert {"a", "b"} <= set(again.restored) and stale_stages(root) == []

    _clear(root)
    forced = run_pipeline(root, force=True)
    assert sorted(_runs(root)) == ["a", "b"] and sorted(forced.ran) == ["a", "b", "join", "prep"]


@pytest.mark.slow
def test_a_failing_stage_stops_its_sibling_and_records_neither(tmp_path: Path, env: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from mempo.dvc_runner import stale_stages
    from mempo.errors import MempoError
    from mempo.pipeline import run_pipeline

    root = _project(tmp_path / "proj", [["a", "b"]])
    monkeypatch.setenv("FAIL", "b")
    monkeypatch.setenv("HANG", "a")  # a would run for 10 minutes unless stopped
    with pytest.raises(MempoError, match=r"`dvc repro b` failed \(exit \d+\) beside 'a'.*logs/b\.log"):
        run_pipeline(root)
    assert not (root / "a.txt").exists() and not (root / "b.txt").exists()
    assert _stage_procs() == []
    assert {"a", "b", "join"} <= set(stale_stages(root))

    monkeypatch.delenv("FAIL")
    monkeypatch.delenv("HANG")
    _clear(root)
    assert sorted(run_pipeline(root).ran) == ["a", "b", "join"]  # prep was committed before the group


@pytest.mark.slow
def test_without_a_group_the_stages_run_one_after_the_other(tmp_path: Path, env: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from mempo.errors import MempoError
    from mempo.pipeline import run_pipeline

    root = _project(tmp_path / "proj", [])
    monkeypatch.setenv("PEER_WAIT_S", "3")
    with pytest.raises(MempoError, match="dvc repro"):  # the first waits for a peer DVC runs only after it
        run_pipeline(root)
    assert len(_runs(root)) == 1


def test_a_target_runs_only_what_it_needs_not_its_sibling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mempo pipeline run a`: b is stale too, but `a` does not need it (the plan, not DVC)."""
    from mempo.dvc_runner import reproduce
    from mempo.pipeline import PipelineResult

    calls: list[tuple] = []
    monkeypatch.setattr("mempo.dvc_runner.repro", lambda root, force, targets, env, **kw: calls.append(
        (force, targets, kw.get("single_item", False))))
    monkeypatch.setattr("mempo.dvc_runner.run_side_by_side", lambda *a: calls.append(("side", a[2])))
    stages = yaml.safe_load(_project(tmp_path / "p", [["a", "b"]]).joinpath("dvc.yaml").read_text())["stages"]
    todo = ["prep", "a", "b", "join"]
    reproduce(tmp_path, False, ["a"], {}, stages, todo, [["a", "b"]], PipelineResult(0.0, [], None))
    assert calls == [(False, ["a"], False)]  # one plain `dvc repro a`
    calls.clear()
    reproduce(tmp_path, False, None, {}, stages, todo, [["a", "b"]], PipelineResult(0.0, [], None))
    assert calls == [(False, ["prep"], False), ("side", ["a", "b"]), (False, None, False)]
    calls.clear()
    reproduce(tmp_path, True, todo, {}, stages, todo, [["a", "b"]], PipelineResult(0.0, [], None), single_item=True)
    assert calls == [(True, ["prep"], True), ("side", ["a", "b"]), (True, ["join"], True)]


def test_groups_run_in_turn_each_after_what_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two groups (as [[sft, sft_full], [train, train_full]] would be): the second pair runs
    side by side after the first, then the rest (the plan, not DVC)."""
    from mempo.dvc_runner import reproduce
    from mempo.pipeline import PipelineResult

    calls: list[tuple] = []
    monkeypatch.setattr("mempo.dvc_runner.repro", lambda root, force, targets, env, **kw: calls.append(
        (force, targets, kw.get("single_item", False))))
    monkeypatch.setattr("mempo.dvc_runner.run_side_by_side", lambda *a: calls.append(("side", a[2])))
    stages = {"prep": {"cmd": "x", "outs": ["p"]}, "a": {"cmd": "x", "deps": ["p"], "outs": ["a"]},
              "b": {"cmd": "x", "deps": ["p"], "outs": ["b"]}, "c": {"cmd": "x", "deps": ["a"], "outs": ["c"]},
              "d": {"cmd": "x", "deps": ["b"], "outs": ["d"]}, "join": {"cmd": "x", "deps": ["c", "d"], "outs": ["j"]}}
    todo = ["prep", "a", "b", "c", "d", "join"]
    reproduce(tmp_path, False, None, {}, stages, todo, [["a", "b"], ["c", "d"]], PipelineResult(0.0, [], None))
    assert calls == [(False, ["prep"], False), ("side", ["a", "b"]), ("side", ["c", "d"]), (False, None, False)]
    calls.clear()
    # only c and d stale (a changed parameter of both): the second group alone, then join
    reproduce(tmp_path, False, None, {}, stages, ["c", "d", "join"], [["a", "b"], ["c", "d"]],
              PipelineResult(0.0, [], None))
    assert calls == [("side", ["c", "d"]), (False, None, False)]


def test_relayed_output_prints_what_happened_once_and_progress_throttled() -> None:
    from mempo.dvc_runner import RelayLines
    from mempo.pipeline import PipelineResult

    out: list[str] = []
    result = PipelineResult(0.0, [], None)
    relay = RelayLines("b", result, every_s=1000.0, out=out.append)
    relay.feed(b"Running st")  # a chunk may end mid-line
    relay.feed(b"age 'b':\n")
    assert out == ["[b] Running stage 'b':"] and result.ran == ["b"]
    relay.feed(b"> python stage.py b\n10%\r20%\r")
    assert out[1:] == ["[b] 20%"]  # the newest line, the first time at once
    relay.feed(b"30%\r40%\r")
    assert len(out) == 2  # then at most every `every_s`
    relay.feed(b"ERROR: failed to reproduce 'b'\n")
    relay.feed(b"Stage 'c' is cached - skipping run\nlast words")
    relay.close()
    assert out[2:] == ["[b] ERROR: failed to reproduce 'b'", "[b] Stage 'c' is cached - skipping run",
                       "[b] last words"]
    assert result.restored == ["c"] and sum("Running stage" in x for x in out) == 1
