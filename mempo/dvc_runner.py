"""Driving DVC for `mempo pipeline run`: which stages are stale, the stage graph, `dvc repro`
in its own process group, stages side by side (`reproduce`), `dvc push`.

    from mempo.dvc_runner import repro, stale_stages
    stale_stages(".")                      # ["sft", "train", ...]: what `dvc repro` would run
    repro(Path("."), False, ["eval"], {})  # dvc repro eval, output passed through

The dvc executable is the one beside this Python (the project venv), else the one on PATH.
`repro` starts `dvc repro` in its own process group; interrupted (Ctrl-C, or SIGTERM, which
the CLI turns into an exception) it sends the group SIGINT (DVC lets the running stage
handle it, records the failure and exits), then SIGTERM and SIGKILL if it is still there
after `STOP_GRACE_S`, and re-raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mempo.errors import MempoError

if TYPE_CHECKING:
    from mempo.pipeline import PipelineResult

# Seconds an interrupted `dvc repro` gets to stop its stage after SIGINT, before SIGTERM.
STOP_GRACE_S = 30.0


def bin_dir() -> Path:
    """The folder of this Python's executables (the project venv's bin/)."""
    return Path(sys.executable).parent


def dvc_executable() -> str:
    """The dvc beside this Python, else the one on PATH; MempoError when neither exists."""
    exe = bin_dir() / "dvc"
    if exe.exists():
        return str(exe)
    found = shutil.which("dvc")
    if not found:
        raise MempoError("dvc is not installed in this environment; run `make setup`")
    return found


def dvc_env() -> dict[str, str]:
    """This environment with the venv's bin/ first on PATH (DVC stages call `mempo`)."""
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir()}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("DVC_NO_ANALYTICS", "1")
    return env


def stale_stages(root: str | Path = ".", targets: list[str] | None = None) -> list[str]:
    """Names of the stages `dvc repro` would run (changed ones; downstream ones follow them)."""
    proc = subprocess.run(
        [dvc_executable(), "status", "--json", *(targets or [])],
        cwd=root, env=dvc_env(), capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise MempoError(f"`dvc status` failed: {proc.stderr.strip()[-500:]}")
    status = json.loads(proc.stdout or "{}")
    # Keys are stage names, or "dvc.yaml:name" for stages outside the root dvc.yaml.
    return [k.split(":")[-1] for k in status]


def _edges(stages: dict[str, Any]) -> set[tuple[str, str]]:
    """(src, dst) pairs where stage `dst` depends on an output of stage `src`."""
    outs_of = {
        name: [o if isinstance(o, str) else next(iter(o)) for o in s.get("outs", []) + s.get("metrics", [])]
        for name, s in stages.items()
    }
    deps_of = {name: [d if isinstance(d, str) else next(iter(d)) for d in s.get("deps", [])] for name, s in stages.items()}

    def feeds(src: str, dst: str) -> bool:
        return any(
            d == o or d.startswith(o.rstrip("/") + "/") or o.startswith(d.rstrip("/") + "/")
            for o in outs_of[src] for d in deps_of[dst]
        )

    return {(a, b) for a in stages for b in stages if a != b and feeds(a, b)}


def _closure(edges: set[tuple[str, str]], start: list[str], upstream: bool) -> set[str]:
    out = set(start)
    grew = True
    while grew:
        grew = False
        for a, b in edges:
            src, dst = (b, a) if upstream else (a, b)
            if src in out and dst not in out:
                out.add(dst)
                grew = True
    return out


def downstream_of(stages: dict[str, Any], changed: list[str]) -> set[str]:
    """`changed` plus every stage that (transitively) depends on one of their outs."""
    return _closure(_edges(stages), [c for c in changed if c in stages], upstream=False) | set(changed)


def upstream_of(stages: dict[str, Any], targets: list[str]) -> set[str]:
    """`targets` plus every stage whose outs they (transitively) depend on."""
    return _closure(_edges(stages), [t for t in targets if t in stages], upstream=True) | set(targets)


def in_dependency_order(stages: dict[str, Any], names: set[str] | list[str]) -> list[str]:
    """`names` sorted so each stage comes after the stages it depends on (dvc.yaml order on ties)."""
    edges = {(a, b) for a, b in _edges(stages) if a in names and b in names}
    todo = [n for n in stages if n in names]
    done: list[str] = []
    while todo:
        ready = next(n for n in todo if not any(b == n and a not in done for a, b in edges))
        done.append(ready)
        todo.remove(ready)
    return done


_RAN = re.compile(r"^Running stage '([^']+)'")
_RESTORED = re.compile(r"^Stage '([^']+)' is cached")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_group(proc: subprocess.Popen[Any], grace_s: float = STOP_GRACE_S) -> None:
    """Stop the process group led by `proc`: SIGINT, then SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap dvc itself, so a zombie does not keep the group "alive"
            if not _group_alive(proc.pid):
                return
            time.sleep(0.1)


def _repro_cmd(force: bool, single_item: bool, targets: list[str] | None, wait_for_lock: bool) -> list[str]:
    return [dvc_executable(), *(["--wait-for-lock"] if wait_for_lock else []), "repro",
            *(["--force"] if force else []), *(["--single-item"] if single_item else []), *(targets or [])]


def _record(line: str, result: PipelineResult | None) -> None:
    """Note in `result` a stage that `dvc repro`'s output line says ran or was restored."""
    if result is not None and (m := _RAN.match(line)):
        result.ran.append(m.group(1).split(":")[-1])
    elif result is not None and (m := _RESTORED.match(line)):
        result.restored.append(m.group(1).split(":")[-1])


def repro(root: Path, force: bool, targets: list[str] | None, extra_env: dict[str, str],
          single_item: bool = False, result: PipelineResult | None = None, wait_for_lock: bool = False,
          on_start: Callable[[subprocess.Popen[str]], None] | None = None) -> None:
    """`dvc repro` in its own process group, its output passed through; records in `result`
    which stages ran. Interrupted (KeyboardInterrupt, the CLI's SIGTERM exception), it stops
    the whole group before re-raising. `wait_for_lock`: wait while another `dvc` holds the
    repository lock; `on_start` gets the process (to stop it from elsewhere)."""
    cmd = _repro_cmd(force, single_item, targets, wait_for_lock)
    proc = subprocess.Popen(cmd, cwd=root, env={**dvc_env(), **extra_env}, stdout=subprocess.PIPE, text=True,
                            bufsize=1, start_new_session=True)
    assert proc.stdout is not None
    if on_start is not None:
        on_start(proc)
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            _record(line, result)
        returncode = proc.wait()
    except BaseException:
        _stop_group(proc)
        raise
    finally:
        proc.stdout.close()
    if returncode != 0:
        raise MempoError(f"`dvc {' '.join(cmd[1:])}` failed (exit {returncode}); see the stage output above")


class RelayLines:
    """What a stage running beside another prints of its output (`start_beside`): DVC's lines
    saying a stage runs, was restored or failed, each once and at once, prefixed `[NAME]`; of
    the rest only the newest line, at most every `every_s` seconds, and the last one at the end.
    Lines end at \\n or \\r (progress bars redraw with \\r); a chunk may end mid-line."""

    def __init__(self, name: str, result: PipelineResult | None, every_s: float,
                 out: Callable[[str], None] = lambda s: print(s, flush=True)) -> None:
        self.name, self.result, self.every_s, self.out = name, result, every_s, out
        self.carry, self.pending, self.last_print = "", "", -float("inf")

    def feed(self, chunk: bytes) -> None:
        *lines, self.carry = re.split(r"[\r\n]", self.carry + chunk.decode("utf-8", "replace"))
        for line in lines:
            self._line(line)
        if self.pending and time.monotonic() - self.last_print >= self.every_s:
            self._print_pending()
            self.last_print = time.monotonic()

    def _print_pending(self) -> None:
        self.out(f"[{self.name}] {self.pending.strip()[-160:]}")
        self.pending = ""

    def _line(self, line: str) -> None:
        _record(line, self.result)
        if _RAN.match(line) or _RESTORED.match(line) or line.startswith("ERROR"):
            self.out(f"[{self.name}] {line.strip()[-300:]}")  # what happened: always, once
            self.pending = ""
        elif line.strip():
            self.pending = line

    def close(self) -> None:
        if self.carry:
            self._line(self.carry)
            self.carry = ""
        if self.pending:
            self._print_pending()


@dataclass
class BesideStage:
    """A `dvc repro --single-item` of one stage running beside another (see `start_beside`)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    relay: threading.Thread

    def wait(self) -> int:
        rc = self.proc.wait()
        self.relay.join()
        return rc

    def stop(self) -> None:
        _stop_group(self.proc)  # type: ignore[arg-type]
        self.relay.join(timeout=10)


def start_beside(root: Path, name: str, force: bool, extra_env: dict[str, str], log: Path,
                 result: PipelineResult | None = None, progress_every_s: float = 60.0) -> BesideStage:
    """`dvc --wait-for-lock repro --single-item NAME` in its own process group, for a stage that
    runs beside the `dvc repro` of another. DVC releases the repository lock while a stage's
    command runs and takes it back to record the result, so two of them interleave, each
    waiting for the other's bookkeeping; their deps and outs must not overlap (DVC's per-path
    locks refuse that). Its output (stage output included) goes to `log`; DVC's lines saying a
    stage runs, was restored or failed are printed, prefixed with the stage's name, and its
    newest other line at most every `progress_every_s` seconds (two progress bars in one
    terminal would garble each other)."""
    cmd = _repro_cmd(force, True, [name], True)
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"Reproducing '{name}' beside it (output: {log}):\n> {' '.join(['dvc', *cmd[1:]])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=root, env={**dvc_env(), **extra_env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)

    def relay() -> None:
        assert proc.stdout is not None
        lines = RelayLines(name, result, progress_every_s)
        with open(log, "wb") as fh:
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):  # type: ignore[union-attr]
                fh.write(chunk)
                fh.flush()
                lines.feed(chunk)
        lines.close()

    thread = threading.Thread(target=relay, name=f"relay-{name}", daemon=True)
    thread.start()
    return BesideStage(name, proc, log, thread)


def reproduce(root: Path, force: bool, targets: list[str] | None, env: dict[str, str], stages: dict[str, Any],
              todo: list[str], groups: list[list[str]], result: PipelineResult, single_item: bool = False) -> None:
    """`dvc repro` of `targets` (`todo`: the stages that will run, in dependency order), except
    that the stages of a group in `groups` (`pipeline.parallel_stages`) that are all in `todo` run
    side by side: what they need first, then the group (`run_side_by_side`), then the rest.
    With `single_item` (or `force`), each stage of `todo` runs once, as `targets` of
    `dvc repro --single-item`."""
    if targets:  # `dvc repro TARGETS` runs what they need, not everything downstream of a change
        wanted = upstream_of(stages, targets)
        todo = [s for s in todo if s in wanted]
    for i, group in enumerate(groups):
        members = [s for s in group if s in todo]
        if len(members) < 2:
            continue
        need = upstream_of(stages, members) - set(members)
        before = [s for s in todo if s in need]
        if before:
            repro(root, force, before, env, single_item=force or single_item, result=result)
        run_side_by_side(root, force, members, env, result)
        rest = [s for s in todo if s not in need and s not in members]
        if rest:
            reproduce(root, force, rest if (force or single_item) else targets, env, stages, rest,
                      groups[i + 1:], result, single_item=force or single_item)
        return
    repro(root, force, targets, env, single_item=single_item, result=result)


def run_side_by_side(root: Path, force: bool, members: list[str], env: dict[str, str],
                     result: PipelineResult) -> None:
    """Stages that need nothing of each other, each through its own `dvc repro --single-item`,
    at once: the first's output passed through, the others' in outputs/logs/STAGE.log
    (`start_beside`). DVC does the rest as always (run cache, dvc.lock). When one fails, the
    others are stopped (SIGINT first: a stage's MLflow run ends FAILED, nothing is recorded)."""
    lead, others = members[0], members[1:]
    result.side_by_side.append(list(members))
    beside: list[BesideStage] = []
    failed: list[tuple[BesideStage, int]] = []
    lead_proc: list[subprocess.Popen[str]] = []

    def stop_lead() -> None:
        if lead_proc:
            threading.Thread(target=_stop_group, args=(lead_proc[0],), daemon=True).start()

    def watch(b: BesideStage) -> None:
        rc = b.wait()
        if rc != 0:
            failed.append((b, rc))
            stop_lead()  # the run has failed: do not train the other stage for an hour first

    def started(proc: subprocess.Popen[str]) -> None:
        lead_proc.append(proc)
        if failed:
            stop_lead()

    watchers: list[threading.Thread] = []
    try:
        for name in others:
            beside.append(start_beside(root, name, force, env, root / "outputs" / "logs" / f"{name}.log", result))
            watchers.append(threading.Thread(target=watch, args=(beside[-1],), daemon=True))
            watchers[-1].start()
        try:
            repro(root, force, [lead], env, single_item=True, result=result, wait_for_lock=True, on_start=started)
        except MempoError:
            if not failed:
                raise
        for w in watchers:
            while w.is_alive():
                w.join(timeout=1.0)
    except BaseException:
        for b in beside:
            b.stop()
        raise
    if failed:
        b, rc = failed[0]
        raise MempoError(f"`dvc repro {b.name}` failed (exit {rc}) beside '{lead}', which was stopped; "
                         f"its output: {b.log}")


def push_outputs(root: str | Path = ".") -> str | None:
    """`dvc push` every stage output to the default DVC remote; the remote's name, or None
    when no default remote is configured (nothing pushed). Raises `MempoError` on failure."""
    proc = subprocess.run([dvc_executable(), "remote", "default"], cwd=root, env=dvc_env(), capture_output=True, text=True)
    remote = proc.stdout.strip() if proc.returncode == 0 else ""
    if not remote:
        return None
    proc = subprocess.run([dvc_executable(), "push", "--quiet"], cwd=root, env=dvc_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise MempoError(f"`dvc push` to remote '{remote}' failed (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return remote
