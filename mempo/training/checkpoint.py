"""Resumable training checkpoints: model, optimiser, scheduler, every RNG state, data position.

    save_checkpoint(run_dir / "checkpoints", step, model, optimizer, scheduler, state)
    ckpt = latest_checkpoint(run_dir / "checkpoints")      # newest complete one, or None
    state = load_checkpoint(ckpt, model, optimizer, scheduler)   # restores RNGs too

Each checkpoint is one folder `step-NNNNNNN/` written with `atomic_dir`, so a process killed
mid-write leaves the previous checkpoint intact and no partial folder that `latest_checkpoint`
could pick. Weights and optimiser moments are saved with `torch.save` (exact bits), which is
what makes a SIGKILL-and-resume run end with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mempo.errors import DataError
from mempo.io import atomic_dir, remove_stale_tmp, write_json

_STEP_DIR = re.compile(r"^step-(\d{7})$")
STATE_FILE = "state.pt"
META_FILE = "trainer_state.json"


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
    """Every RNG a trainer touches: python `random`, numpy, torch CPU and all CUDA devices."""
    import numpy as np
    import torch

    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` captured (CUDA states only when CUDA is present)."""
    import numpy as np
    import torch

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:07d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (half-written temp folders ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / STATE_FILE).exists()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


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
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def load_checkpoint(path: str | Path, model: Any, optimizer: Any, scheduler: Any) -> TrainerState:
    """Load a checkpoint into `model`, `optimizer`, `scheduler` (in place) and restore the RNGs."""
    import torch

    path = Path(path)
    if not (path / STATE_FILE).exists():
        raise DataError("not a checkpoint (no state.pt)", path=path)
    device = next(model.parameters()).device
    payload = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    model.load_state_dict({k: v.to(device) for k, v in payload["model"].items()})
    optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    set_rng_states(payload["rng"])
    meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    return TrainerState(
        step=int(meta["step"]), data_position=meta.get("data_position") or {},
        history=meta.get("history") or [], extra=meta.get("extra") or {},
    )


# Keys that may change between a run and its resumption without changing what is trained.
RESUME_SAFE_KEYS = frozenset({"resume", "steps", "max_steps", "checkpoint_every", "keep_checkpoints",
                              "threads", "device", "eval_every", "val_every", "out"})


def config_fingerprint(config: dict[str, Any]) -> str:
    """sha256 of the training config (JSON, sorted), ignoring `RESUME_SAFE_KEYS` at any depth."""
    import hashlib

    def strip(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in RESUME_SAFE_KEYS}
        return obj

    return hashlib.sha256(json.dumps(strip(config), sort_keys=True, default=str).encode()).hexdigest()


def checkpoint_fingerprint(path: str | Path) -> str | None:
    """The config fingerprint a checkpoint was written with (None when it has none)."""
    meta = json.loads((Path(path) / META_FILE).read_text(encoding="utf-8"))
    return (meta.get("extra") or {}).get("fingerprint")


def resolve_resume(resume: str | None, root: str | Path, fingerprint: str | None = None) -> Path | None:
    """`--resume` value -> checkpoint folder: None/"" or "never" -> None; "auto" -> newest
    under `root` (None when there is none); anything else is a checkpoint path.

    With `fingerprint`, "auto" ignores checkpoints written under a different training config
    (they are deleted with a warning, so a changed config never continues an old run, e.g.
    after `dvc repro` with new params); an explicit path with a different config is an error.
    """
    import logging

    if not resume or resume == "never":
        return None
    if resume == "auto":
        found = latest_checkpoint(root)
        if found is not None and fingerprint is not None and checkpoint_fingerprint(found) != fingerprint:
            logging.getLogger(__name__).warning(
                "checkpoints in %s were written with a different config; starting from scratch", root)
            for old in list_checkpoints(root):
                shutil.rmtree(old, ignore_errors=True)
            return None
        return found
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        raise DataError("resume: not a checkpoint folder (no state.pt)", path=path)
    if fingerprint is not None and checkpoint_fingerprint(path) != fingerprint:
        raise DataError("resume: checkpoint was written with a different training config", path=path)
    return path


def write_trainer_state(path: str | Path, state: TrainerState) -> None:
    """The trainer state as JSON (for the final output folder)."""
    write_json(path, {"step": state.step, "history": state.history, "extra": state.extra})
