"""Resumable training checkpoints: model, optimiser, scheduler, every RNG state, data position.

    fp = run_fingerprint({"train": ...}, {"policy": policy_dir, "data": data_dir}, cache)
    state = resume_training("auto", run_dir / "checkpoints", fp, model, optimizer, scheduler)
    save_checkpoint(run_dir / "checkpoints", model, optimizer, scheduler, state)
    retire_checkpoints(run_dir / "checkpoints")         # once the final model is saved

Each checkpoint is one folder `step-NNNNNNN/` written with `atomic_dir`, so a process killed
mid-write leaves the previous checkpoint intact and no partial folder that `latest_checkpoint`
could pick. Its `manifest.json` (size and sha256 of every file) is written last: a folder
whose files do not match it is not a checkpoint (size checked when listing, hash when
loading), and resuming falls back to the previous one. Weights and optimiser moments are
saved with `torch.save` (exact bits), which is what makes a SIGKILL-and-resume run end with
the same weights as an uninterrupted one; the payload holds only tensors and plain data, so
it loads with `weights_only=True` and a planted pickle never runs.

A checkpoint belongs to one run: `run_fingerprint` hashes the training config together with
the *contents* of its inputs (start policy, data, index or world). A checkpoint written under
another fingerprint is never continued; `resume: auto` moves such checkpoints aside to
`<root>.stale-<time>/` (nothing is deleted) and starts afresh. The fingerprint itself is
computed in `mempo.training.fingerprint`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mempo.errors import DataError
from mempo.io import atomic_dir, remove_stale_tmp, sha256_file, write_json

# Re-exported for training/sft.py and training/grpo.py, which import them from here and are
# being restructured on other branches; new code imports from mempo.training.fingerprint.
from mempo.training.fingerprint import HASH_CACHE_FILE, run_fingerprint  # noqa: F401

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{7})$")
STATE_FILE = "state.pt"
META_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"


@dataclass
class TrainerState:
    """What a trainer needs besides tensors to continue exactly where it stopped.

    Attributes:
        step: optimiser steps completed.
        data_position: the data iterator's position (trainer-defined, JSON-serialisable).
        history: per-step metrics so far (for curves that survive a resume).
        extra: anything else JSON-serialisable (e.g. the best validation loss).
    """

    step: int = 0
    data_position: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def rng_states() -> dict[str, Any]:
    """Every RNG a trainer touches: python `random`, numpy, torch CPU and all CUDA devices.

    Plain lists and ints plus torch tensors only, so a checkpoint loads with `weights_only=True`.
    """
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` captured (CUDA states only when CUDA is present)."""
    import numpy as np
    import torch

    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:07d}"


def write_checkpoint_manifest(folder: str | Path) -> Path:
    """Record the size and sha256 of every file in `folder` (call it after the files are written)."""
    folder = Path(folder)
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST_FILE}
    return write_json(folder / MANIFEST_FILE, {"files": files})


def verify_checkpoint(path: str | Path, hashes: bool = False) -> str | None:
    """Why `path` is not a complete checkpoint (None when it is).

    Checks the manifest exists and every file it lists has its size; with `hashes`, also
    its sha256 (reads every byte).
    """
    path = Path(path)
    try:
        listed = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST_FILE}"
    if STATE_FILE not in listed or META_FILE not in listed:
        return f"{MANIFEST_FILE} does not list {STATE_FILE} and {META_FILE}"
    for name, want in listed.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want.get("size"):
            return f"{name} is {f.stat().st_size} bytes, the manifest says {want.get('size')} (truncated?)"
        if hashes and sha256_file(f) != want.get("sha256"):
            return f"{name} does not match its sha256 in {MANIFEST_FILE} (corrupt)"
    return None


def _step_dirs(root: Path) -> list[Path]:
    """Every `step-NNNNNNN` folder under `root`, complete or not, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root` (manifest present, sizes match), oldest first."""
    return [p for p in _step_dirs(Path(root)) if verify_checkpoint(p) is None]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(
    root: str | Path,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    state: TrainerState,
    keep_last: int = 2,
) -> Path:
    """Write checkpoint `root/step-{state.step}` atomically; prune to the newest `keep_last`.

    Returns the checkpoint folder.
    """
    import torch

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(root)
    target = checkpoint_dir(root, state.step)
    payload = {
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_states(),
    }
    with atomic_dir(target) as tmp:
        torch.save(payload, tmp / STATE_FILE)
        write_json(tmp / META_FILE, {
            "step": state.step, "data_position": state.data_position,
            "history": state.history, "extra": state.extra,
        })
        write_checkpoint_manifest(tmp)  # last: its presence says the rest is complete
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def load_checkpoint(path: str | Path, model: Any, optimizer: Any, scheduler: Any) -> TrainerState:
    """Load a checkpoint into `model`, `optimizer`, `scheduler` (in place) and restore the RNGs.

    Every file is checked against the manifest's sha256 first, and `state.pt` is read with
    `weights_only=True`. Raises `DataError` ("cannot load ...") before touching the model when
    the checkpoint is incomplete, corrupt or not plain tensors and data.
    """
    import torch

    path = Path(path)
    if not (path / STATE_FILE).exists():
        raise DataError("not a checkpoint (no state.pt)", path=path)
    problem = verify_checkpoint(path, hashes=True)
    if problem is not None:
        raise DataError(f"cannot load checkpoint: {problem}", path=path)
    try:
        payload = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except Exception as e:  # noqa: BLE001 - any unreadable payload is the same verdict
        raise DataError(f"cannot load checkpoint: {type(e).__name__}: {str(e)[:300]}", path=path) from e
    device = next(model.parameters()).device
    model.load_state_dict({k: v.to(device) for k, v in payload["model"].items()})
    optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    set_rng_states(payload["rng"])
    return TrainerState(
        step=int(meta["step"]), data_position=meta.get("data_position") or {},
        history=meta.get("history") or [], extra=meta.get("extra") or {},
    )



def checkpoint_fingerprint(path: str | Path) -> str | None:
    """The fingerprint a checkpoint was written with (None when it has none or is unreadable)."""
    try:
        meta = json.loads((Path(path) / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (meta.get("extra") or {}).get("fingerprint")


def move_aside(root: str | Path, entries: list[Path], reason: str) -> Path:
    """Move `entries` (inside `root`) into a new sibling `<root>.stale-<UTC time>/`; log where.

    Used instead of deleting: checkpoints of another run may be the only copy of hours of
    training (an exploratory `--set` must not wipe them).
    """
    root = Path(root)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = root.with_name(f"{root.name}.stale-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = root.with_name(f"{root.name}.stale-{stamp}-{n}")
    aside.mkdir(parents=True)
    for p in entries:
        os.replace(p, aside / p.name)
    log.warning("%s: moved %d item(s) from %s aside to %s (nothing deleted; remove it when no longer needed)",
                reason, len(entries), root, aside)
    return aside


RUN_FINGERPRINT_FILE = "mempo_fingerprint.json"


def guard_run_dir(root: str | Path, fingerprint: str) -> Path | None:
    """For a trainer that resumes by itself from whatever is in `root` (verl, `resume_mode:
    auto`): keep `root` only if its recorded fingerprint is `fingerprint`, else move its
    contents aside (`move_aside`; also when nothing was recorded). Then record `fingerprint`.

    Returns the folder things were moved to, or None.
    """
    root = Path(root)
    marker = root / RUN_FINGERPRINT_FILE
    entries = sorted(root.iterdir()) if root.is_dir() else []
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8")).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        recorded = None
    aside = None
    if recorded != fingerprint and any(p != marker for p in entries):
        aside = move_aside(root, entries, "checkpoints were written by a run with another config or other inputs"
                           + ("" if recorded else " (no fingerprint recorded)") + "; starting from scratch")
    root.mkdir(parents=True, exist_ok=True)
    write_json(marker, {"fingerprint": fingerprint})
    return aside


def resolve_resume(resume: str | None, root: str | Path, fingerprint: str | None = None) -> Path | None:
    """`--resume` value -> checkpoint folder: None/"" or "never" -> None; "auto" -> newest
    complete one under `root` (None when there is none); anything else is a checkpoint path.

    With `fingerprint`, "auto" never continues a checkpoint written under another one (a
    changed config or changed input contents, e.g. after `dvc repro` upstream): every
    checkpoint under `root` is moved aside (`move_aside`) and None returned. An explicit path
    with another fingerprint is an error.
    """
    if not resume or resume == "never":
        return None
    if resume == "auto":
        found = latest_checkpoint(root)
        if found is not None and fingerprint is not None and checkpoint_fingerprint(found) != fingerprint:
            move_aside(root, _step_dirs(Path(root)),
                       "checkpoints were written with a different config or different inputs; starting from scratch")
            return None
        return found
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        raise DataError("resume: not a checkpoint folder (no state.pt)", path=path)
    if fingerprint is not None and checkpoint_fingerprint(path) != fingerprint:
        raise DataError("resume: checkpoint was written with a different training config or inputs", path=path)
    return path


def resume_training(resume: str | None, root: str | Path, fingerprint: str | None,
                    model: Any, optimizer: Any, scheduler: Any) -> TrainerState | None:
    """Resolve `resume` (see `resolve_resume`) and load it; None means start from scratch.

    With "auto", a checkpoint that fails to load (corrupt, truncated, not plain tensors) is
    renamed `step-N.corrupt` with a warning and the previous one is tried.
    """
    path = resolve_resume(resume, root, fingerprint)
    while path is not None:
        try:
            state = load_checkpoint(path, model, optimizer, scheduler)
        except DataError as e:
            if resume != "auto":
                raise
            bad = path.with_name(f"{path.name}.corrupt")
            shutil.rmtree(bad, ignore_errors=True)
            os.replace(path, bad)
            log.warning("%s; kept it as %s and trying the previous checkpoint", e.one_line(), bad.name)
            path = resolve_resume(resume, root, fingerprint)
            continue
        log.info("resumed from %s (step %d)", path, state.step)
        return state
    return None


def retire_checkpoints(root: str | Path) -> int:
    """Delete every checkpoint under `root` (call it once the run's final model is saved):
    a finished run is never resumed, and a later run must not find its steps. Returns how many."""
    steps = _step_dirs(Path(root))
    for p in steps + [p for p in Path(root).glob("step-*.corrupt")]:
        shutil.rmtree(p, ignore_errors=True)
    if Path(root).is_dir():
        remove_stale_tmp(root)
    if steps:
        log.info("retired %d checkpoint(s) in %s (the final model is saved)", len(steps), root)
    return len(steps)
