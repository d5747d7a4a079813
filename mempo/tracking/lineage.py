"""Lineage facts a run is tagged with: the git commit, input hashes, DVC's recorded hashes.

    from mempo.tracking.lineage import data_hashes, git_commit, numerics_tags
    git_commit()                               # ("3f2a...", False): sha, dirty
    numerics_tags()                            # {"mempo.numerics.cpu_capability": "AVX512", ...}
    data_hashes({"train": "data/prepared"})    # {"data.train.path": ..., "data.train.md5": ...}

A path DVC already hashed (in dvc.lock) reuses DVC's md5 instead of rereading the bytes. DVC
records a stage's own hashes only after the stage ends, so `mempo pipeline run` adds them
(`dvc.deps.*`, `dvc.outs.*`, `dvc.params.sha256`) to each stage run after `dvc repro`
(`tag_stage_runs_with_dvc_hashes`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mempo.errors import MempoError
from mempo.tracking.where import project_root, tracking_uri

# MLflow's limits: param values <= 6000 chars, tag values <= 8000 chars.
MAX_PARAM_CHARS = 6000
MAX_TAG_CHARS = 8000


def git_commit(root: str | Path | None = None) -> tuple[str, bool]:
    """(commit sha, dirty) of the project checkout; ("unknown", False) outside git.

    `MEMPO_GIT_COMMIT` wins (containers have no .git; the image label sets it).
    """
    if os.environ.get("MEMPO_GIT_COMMIT"):
        return os.environ["MEMPO_GIT_COMMIT"], False
    cwd = project_root(root)
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=cwd, capture_output=True, text=True, check=True,
            ).stdout.strip()
        )
        return sha, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


# Environment variables that choose the CPU kernels (and so the rounding) of torch's maths.
NUMERICS_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def numerics_tags() -> dict[str, str]:
    """What besides code, params and inputs decides a CPU run's floating-point results: torch's
    version and the instruction set its kernels use (`mempo.numerics.*` tags). The same commit
    and inputs give bit-identical weights run after run on one machine, and different ones on a
    machine whose kernels round differently (docs/training.md, "Reproducibility")."""
    import torch

    tags = {"mempo.numerics.torch": torch.__version__,
            "mempo.numerics.cpu_capability": str(torch.backends.cpu.get_cpu_capability())}
    tags.update({f"mempo.numerics.{k}": os.environ[k] for k in NUMERICS_ENV if os.environ.get(k)})
    return tags


def _dvc_lock(root: Path) -> dict[str, Any]:
    import yaml

    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    try:
        return yaml.safe_load(lock.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError:
        return {}


def dvc_recorded_hashes(root: str | Path | None = None) -> dict[str, str]:
    """`{path: md5}` for every dep and out DVC recorded in dvc.lock (paths relative to root)."""
    out: dict[str, str] = {}
    for stage in (_dvc_lock(project_root(root)).get("stages") or {}).values():
        for entry in [*(stage.get("deps") or []), *(stage.get("outs") or [])]:
            if isinstance(entry, dict) and "path" in entry and "md5" in entry:
                out[str(entry["path"])] = str(entry["md5"])
    return out


def dvc_stage_hashes(stage: str, root: str | Path | None = None) -> dict[str, str]:
    """The hashes dvc.lock holds for `stage` (its deps, outs and params digest); {} if none yet."""
    entry = (_dvc_lock(project_root(root)).get("stages") or {}).get(stage) or {}
    out: dict[str, str] = {}
    for kind in ("deps", "outs"):
        for item in entry.get(kind) or []:
            if isinstance(item, dict) and "md5" in item:
                out[f"dvc.{kind}.{item['path']}"] = str(item["md5"])
    if entry.get("params"):
        blob = json.dumps(entry["params"], sort_keys=True, default=str)
        out["dvc.params.sha256"] = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return out


def tag_stage_runs_with_dvc_hashes(parent_run_id: str, root: str | Path | None = None) -> int:
    """Tag every stage run under `parent_run_id` that ran as a DVC stage with the hashes
    dvc.lock now holds for that stage. Returns how many runs were tagged."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri(root))
    parent = client.get_run(parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'", max_results=1000
    )
    n = 0
    for run in children:
        stage = run.data.tags.get("dvc.stage")
        hashes = dvc_stage_hashes(stage, root) if stage else {}
        for key, value in hashes.items():
            client.set_tag(run.info.run_id, key, clip_text(value, MAX_TAG_CHARS))
        n += bool(hashes)
    return n


def path_hash(path: str | Path) -> str:
    """sha256 of a file, or of a folder (sorted relative paths + each file's sha256)."""
    from mempo.io import sha256_file

    p = Path(path)
    if not p.exists():
        raise MempoError("cannot hash a missing input", path=p)
    if p.is_file():
        return sha256_file(p)
    h = hashlib.sha256()
    for f in sorted(q for q in p.rglob("*") if q.is_file()):
        h.update(f.relative_to(p).as_posix().encode())
        h.update(b"\0")
        h.update(sha256_file(f).encode())
        h.update(b"\n")
    return h.hexdigest()


def data_hashes(data: Mapping[str, str | Path], root: str | Path | None = None) -> dict[str, str]:
    """`{"data.<name>.sha256" or "data.<name>.md5": hash, "data.<name>.path": path}` per input.

    A path DVC already hashed (in dvc.lock) reuses DVC's md5 instead of rereading the bytes.
    """
    base = project_root(root)
    recorded = dvc_recorded_hashes(base)
    tags: dict[str, str] = {}
    for name, path in data.items():
        p = Path(path)
        rel = p.resolve().relative_to(base).as_posix() if p.resolve().is_relative_to(base) else str(p)
        tags[f"data.{name}.path"] = rel
        if rel in recorded:
            tags[f"data.{name}.md5"] = recorded[rel]
        else:
            tags[f"data.{name}.sha256"] = path_hash(p)
    return tags
def clip_text(value: Any, limit: int) -> str:
    """`value` as text (JSON unless a string), cut to `limit` characters with a trailing "..."."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
