"""`mempo train verl` runs verl with `resume_mode: auto`, which continues whatever checkpoint
sits in `trainer.default_local_dir`: the launcher fingerprints the run (params + input
contents) beside verl's checkpoints and moves a foreign run's checkpoints aside first."""

from __future__ import annotations

import json
from pathlib import Path

from mempo.config import load_params
from mempo.training.verl_checkpoints import guard_verl_checkpoints
from mempo.training.verl_launch import plan_verl_run


def _inputs(tmp_path: Path) -> tuple[Path, Path]:
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text('{"hidden_size": 8}')
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        (data / f"{split}.parquet").write_bytes(b"PAR1")
    return policy, data


def _params(tmp_path: Path, policy: Path, data: Path, **extra: object):
    return load_params(None, overrides={"verl.policy": str(policy), "verl.data": str(data),
                                        "verl.out": str(tmp_path / "train"),
                                        "verl.retriever": "http://127.0.0.1:9", **extra})


def _verl_checkpoint(root: Path, step: int) -> None:
    (root / f"global_step_{step}" / "actor").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))


def test_a_foreign_or_unfingerprinted_verl_checkpoint_is_moved_aside(tmp_path: Path) -> None:
    policy, data = _inputs(tmp_path)
    params = _params(tmp_path, policy, data)
    plan = plan_verl_run(params)
    _verl_checkpoint(plan.checkpoint_dir, 3)  # written before fingerprints existed

    aside = guard_verl_checkpoints(plan, params)
    assert aside is not None and (aside / "global_step_3").is_dir()
    assert not (plan.checkpoint_dir / "global_step_3").exists()
    recorded = json.loads((plan.checkpoint_dir / "mempo_fingerprint.json").read_text())
    assert len(recorded["fingerprint"]) == 64

    # the same run again (only the step budget grew): its checkpoints are continued
    _verl_checkpoint(plan.checkpoint_dir, 5)
    again = _params(tmp_path, policy, data, **{"verl.total_training_steps": 50})
    assert guard_verl_checkpoints(plan_verl_run(again), again) is None
    assert (plan.checkpoint_dir / "global_step_5").is_dir()

    # a new start policy (same size, same name) is another run
    (policy / "config.json").write_text('{"hidden_size": 9}')
    aside2 = guard_verl_checkpoints(plan, params)
    assert aside2 is not None and (aside2 / "global_step_5").is_dir()
    assert not (plan.checkpoint_dir / "latest_checkpointed_iteration.txt").exists()

    # so is another learning rate
    _verl_checkpoint(plan.checkpoint_dir, 6)
    other = _params(tmp_path, policy, data, **{"verl.lr": 3e-6})
    assert guard_verl_checkpoints(plan_verl_run(other), other) is not None
