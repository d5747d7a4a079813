"""mempo.training.checkpoint: exact round trip, atomicity, pruning, resume resolution."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mempo.errors import DataError


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(16, 4)  # draws from the torch RNG, so RNG state matters
        loss = (model(x) - x.sum(-1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def test_resume_from_checkpoint_gives_identical_weights(tmp_path: Path) -> None:
    from mempo.training.checkpoint import (
        TrainerState,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )

    model, opt, sched = _setup()
    _train(model, opt, sched, 3)
    save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=3, data_position={"i": 3}))
    random.random(), np.random.rand()
    _train(model, opt, sched, 4)
    straight = [p.detach().clone() for p in model.parameters()]

    model2, opt2, sched2 = _setup(seed=99)  # different init: everything must come from the checkpoint
    state = load_checkpoint(latest_checkpoint(tmp_path), model2, opt2, sched2)
    assert state.step == 3 and state.data_position == {"i": 3}
    _train(model2, opt2, sched2, 4)
    for a, b in zip(straight, model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_latest_ignores_partial_folders_and_prunes_old(tmp_path: Path) -> None:
    from mempo.training.checkpoint import (
        TrainerState,
        latest_checkpoint,
        list_checkpoints,
        save_checkpoint,
    )

    model, opt, sched = _setup()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=step), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000002", "step-0000003"]
    (tmp_path / "step-0000009").mkdir()  # a folder without state.pt is not a checkpoint
    (tmp_path / ".tmp-step-0000010.123.abcd").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-0000003"


def test_resolve_resume(tmp_path: Path) -> None:
    from mempo.training.checkpoint import resolve_resume

    assert resolve_resume("auto", tmp_path / "none") is None
    assert resolve_resume("never", tmp_path) is None
    with pytest.raises(DataError, match="not a checkpoint"):
        resolve_resume(str(tmp_path), tmp_path)


def test_auto_resume_skips_checkpoints_of_another_config(tmp_path: Path) -> None:
    from mempo.training.checkpoint import (
        TrainerState,
        config_fingerprint,
        list_checkpoints,
        resolve_resume,
        save_checkpoint,
    )

    model, opt, sched = _setup()
    fp = config_fingerprint({"train": {"lr": 1e-3, "steps": 10, "resume": "auto"}})
    # steps / resume may change between a run and its resumption
    assert fp == config_fingerprint({"train": {"lr": 1e-3, "steps": 50, "resume": "never"}})
    save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=2, extra={"fingerprint": fp}))
    assert resolve_resume("auto", tmp_path, fp) is not None
    other = config_fingerprint({"train": {"lr": 5e-4, "steps": 10}})
    with pytest.raises(DataError, match="different training config"):
        resolve_resume(str(list_checkpoints(tmp_path)[0]), tmp_path, other)
    assert resolve_resume("auto", tmp_path, other) is None
    assert list_checkpoints(tmp_path) == []
