"""SFT starts saved to be shared: the checkpoints a learning study's RL starts from, with what
identifies them, so that studies on other machines start from the same weights.

Retraining the SFT start does not give the same weights on another CPU (other kernels, other
float sums), and results from different starts cannot be pooled. A saved start is a folder

    <dir>/start.json           formats, each checkpoint's weights sha256 and SFT metrics,
                               the world it was trained on (its manifest's file hashes)
    <dir>/<format>/model/      the Hugging Face checkpoint (format: memory, full)
    <dir>/<format>/metrics.json  the SFT stage's metrics

`save_start` writes one atomically; `load_start` checks it (every checkpoint's weights against
the recorded hash, the world against the one the study built) before anything trains on it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mempo.errors import DataError
from mempo.io import atomic_dir, weights_sha256, write_json

START_FILE = "start.json"
FORMATS = ("memory", "full")


def world_identity(world: str | Path) -> dict[str, str]:
    """The world's file hashes as its generator recorded them (`manifest.json`'s `sha256`)."""
    path = Path(world) / "manifest.json"
    try:
        hashes = json.loads(path.read_text(encoding="utf-8"))["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"no world manifest with file hashes: {e}", path=str(path)) from e
    if not isinstance(hashes, dict) or not hashes:
        raise DataError("the world manifest's 'sha256' is not a non-empty mapping", path=str(path))
    return {str(k): str(v) for k, v in hashes.items()}


def save_start(dest: str | Path, checkpoints: dict[str, tuple[Path, Path]], world: str | Path,
               note: dict[str, Any] | None = None) -> dict[str, Any]:
    """Save `checkpoints` (format -> (model folder, SFT metrics.json)) as a start in `dest`,
    replacing it whole or not at all. Returns the start.json written."""
    unknown = sorted(set(checkpoints) - set(FORMATS))
    if unknown or not checkpoints:
        raise DataError(f"start formats must be among {FORMATS}, got {sorted(checkpoints)}", path=str(dest))
    record: dict[str, Any] = {"world": world_identity(world), "formats": {}, **(note or {})}
    with atomic_dir(dest) as tmp:
        for fmt, (model, metrics) in sorted(checkpoints.items()):
            for p in (model, metrics):
                if not Path(p).exists():
                    raise DataError(f"{fmt} start: missing", path=str(p))
            shutil.copytree(model, tmp / fmt / "model")
            shutil.copy2(metrics, tmp / fmt / "metrics.json")
            record["formats"][fmt] = {"weights_sha256": weights_sha256(tmp / fmt / "model"),
                                      "sft": json.loads(Path(metrics).read_text(encoding="utf-8"))}
        write_json(tmp / START_FILE, record)
    return record


def load_start(folder: str | Path, formats: list[str] | tuple[str, ...],
               world: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """The checkpoints of `formats` in the saved start `folder`: format -> {"model": folder,
    "metrics": metrics.json, "weights_sha256": hash}. DataError, naming the file and what
    differs, when the start lacks a format, a checkpoint's weights are not the recorded ones,
    or `world` (given) is not the world the start was trained on."""
    folder = Path(folder)
    path = folder / START_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        recorded = record["formats"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"not a saved SFT start (save one with benchmarks/learning.py --save-start): {e}",
                        path=str(path)) from e
    if world is not None:
        mine, theirs = world_identity(world), record.get("world") or {}
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if differ:
            raise DataError(f"the start was trained on another world: {', '.join(differ)} differ from "
                            f"{Path(world) / 'manifest.json'}", path=str(path))
    out: dict[str, dict[str, Any]] = {}
    for fmt in formats:
        if fmt not in recorded:
            raise DataError(f"the start has no '{fmt}' checkpoint (it has: {', '.join(sorted(recorded))})",
                            path=str(path))
        model, metrics = folder / fmt / "model", folder / fmt / "metrics.json"
        if not metrics.exists():
            raise DataError(f"{fmt} start: missing", path=str(metrics))
        got, want = weights_sha256(model), recorded[fmt].get("weights_sha256")
        if got != want:
            raise DataError(f"{fmt} start: weights sha256 {got[:12]}... is not the recorded {str(want)[:12]}...",
                            path=str(model))
        out[fmt] = {"model": model, "metrics": metrics, "weights_sha256": got}
    return out
