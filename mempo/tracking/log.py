"""Logging into the active run: metrics (nested dicts flattened), JSON, plots, files.

    from mempo.tracking.log import log_json, log_metrics, log_plot
    log_metrics({"loss": 0.3, "eval": {"em": 0.4}}, step=10)   # logs loss, eval/em
    log_json({"eval_em": 0.41}, "metrics.json")
    log_plot("outputs/train/plots/reward.png")

Each is a no-op without an active run or with tracking off, so a stage calls them
unconditionally.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mempo.errors import MempoError
from mempo.io import flatten_numbers
from mempo.tracking.runs import active_run_id


def log_metrics(metrics: Mapping[str, Any], step: int | None = None, prefix: str = "") -> dict[str, float]:
    """Log every numeric entry of `metrics` (nested dicts flattened with "/"); skips the rest.

    Returns what was logged. A no-op without an active run or with tracking off.
    """
    flat = flatten_numbers(metrics, prefix.rstrip("/"))
    if not flat or active_run_id() is None:
        return flat
    import mlflow

    # Metric keys allow alphanumerics, _ - . space / only.
    safe = {"".join(c if c.isalnum() or c in "_-. /" else "_" for c in k): v for k, v in flat.items()}
    mlflow.log_metrics(safe, step=step)
    return safe


def log_json(obj_or_path: Any, artifact_file: str | None = None) -> None:
    """Log a JSON artifact: a path to an existing .json file, or an object to serialise.

    `artifact_file` is the name inside the run's artifacts (default: the file's name).
    """
    if active_run_id() is None:
        return
    import mlflow

    if isinstance(obj_or_path, str | Path) and Path(obj_or_path).is_file():
        p = Path(obj_or_path)
        if artifact_file is None or artifact_file == p.name:
            mlflow.log_artifact(str(p))
        else:
            folder = str(Path(artifact_file).parent) if Path(artifact_file).parent != Path(".") else None
            with tempfile.TemporaryDirectory() as tmp:
                dst = Path(tmp) / Path(artifact_file).name
                dst.write_bytes(p.read_bytes())
                mlflow.log_artifact(str(dst), artifact_path=folder)
        return
    mlflow.log_dict(obj_or_path, artifact_file or "data.json")


def log_plot(path: str | Path, artifact_path: str = "plots") -> None:
    """Log a PNG (or every PNG in a folder) under `artifact_path`."""
    if active_run_id() is None:
        return
    import mlflow

    p = Path(path)
    if p.is_dir():
        for png in sorted(p.glob("*.png")):
            mlflow.log_artifact(str(png), artifact_path=artifact_path)
    elif p.is_file():
        mlflow.log_artifact(str(p), artifact_path=artifact_path)
    else:
        raise MempoError("plot not found", path=p)


def log_file(path: str | Path, artifact_path: str | None = None) -> None:
    """Log any file or folder as an artifact (folders recursively)."""
    if active_run_id() is None:
        return
    import mlflow

    p = Path(path)
    if p.is_dir():
        mlflow.log_artifacts(str(p), artifact_path=artifact_path)
    else:
        mlflow.log_artifact(str(p), artifact_path=artifact_path)
