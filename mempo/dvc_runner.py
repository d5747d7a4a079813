"""Driving DVC for `mempo pipeline run`: which stages are stale, the stage graph, `dvc repro`
in its own process group, `dvc push`.

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
import time
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


def repro(root: Path, force: bool, targets: list[str] | None, extra_env: dict[str, str],
           single_item: bool = False, result: PipelineResult | None = None) -> None:
    """`dvc repro` in its own process group, its output passed through; records in `result`
    which stages ran. Interrupted (KeyboardInterrupt, the CLI's SIGTERM exception), it stops
    the whole group before re-raising."""
    cmd = [dvc_executable(), "repro", *(["--force"] if force else []), *(["--single-item"] if single_item else []),
           *(targets or [])]
    proc = subprocess.Popen(cmd, cwd=root, env={**dvc_env(), **extra_env}, stdout=subprocess.PIPE, text=True,
                            bufsize=1, start_new_session=True)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if result is not None and (m := _RAN.match(line)):
                result.ran.append(m.group(1).split(":")[-1])
            elif result is not None and (m := _RESTORED.match(line)):
                result.restored.append(m.group(1).split(":")[-1])
        returncode = proc.wait()
    except BaseException:
        _stop_group(proc)
        raise
    finally:
        proc.stdout.close()
    if returncode != 0:
        raise MempoError(f"`dvc {' '.join(cmd[1:])}` failed (exit {returncode}); see the stage output above")


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
