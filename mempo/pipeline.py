"""The local end-to-end run behind `make run`: `dvc repro`, then a summary of where things are.

    mempo pipeline run            # what `make run` calls
    mempo pipeline run --force    # re-run every stage

DVC decides what is stale; this module only runs it with the project venv on PATH and
prints where each stage's output went.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from mempo.errors import MempoError


def _dvc() -> str:
    exe = Path(sys.executable).parent / "dvc"
    if exe.exists():
        return str(exe)
    found = shutil.which("dvc")
    if not found:
        raise MempoError("dvc is not installed in this environment; run `make setup`")
    return found


def run_pipeline(root: str | Path = ".", force: bool = False, targets: list[str] | None = None) -> float:
    """Run `dvc repro` in `root` with this interpreter's bin folder first on PATH.

    Returns the wall time in seconds. Raises `MempoError` if a stage fails.
    """
    root = Path(root)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [_dvc(), "repro", *(["--force"] if force else []), *(targets or [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise MempoError(f"`{' '.join(cmd[1:])}` failed (exit {proc.returncode}); see the stage output above")
    return elapsed


def summarize(root: str | Path = ".") -> list[str]:
    """Lines saying where each declared stage output is."""
    root = Path(root)
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {})
    lines = []
    for name, stage in stages.items():
        for out in stage.get("outs", []):
            path = out if isinstance(out, str) else next(iter(out))
            status = "ok" if (root / path).exists() else "missing"
            lines.append(f"  {name:<12} {path}  [{status}]")
    return lines
