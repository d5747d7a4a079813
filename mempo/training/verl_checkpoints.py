"""verl's checkpoints around a launch: this run's or moved aside before, merged and retired after.

    from mempo.training.verl_checkpoints import guard_verl_checkpoints, merge_checkpoint
    guard_verl_checkpoints(plan, params)        # another run's checkpoints -> checkpoints.stale-<time>/
    merge_checkpoint(plan.checkpoint_dir / "global_step_100", plan.model_dir)

verl runs with `resume_mode: auto` and continues whatever is in its checkpoint folder, so the
launcher fingerprints the run (params + the contents of the policy, data and Hydra overlay;
`mempo.training.fingerprint`) and moves checkpoints of another run aside, never resumes them.
After training, `merge_checkpoint` turns the newest FSDP checkpoint into an HF folder with
`python -m verl.model_merger merge --backend fsdp`, and `retire_verl_checkpoints` deletes the
step folders so no later launch resumes a finished run.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mempo.errors import DataError, MempoError
from mempo.io import atomic_dir

if TYPE_CHECKING:
    from mempo.training.verl_launch import VerlRunPlan

log = logging.getLogger(__name__)


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The newest `global_step_N` folder per verl's tracker file (None when there is none)."""
    tracker = checkpoint_dir / "latest_checkpointed_iteration.txt"
    if not tracker.exists():
        return None
    step = int(tracker.read_text().strip())
    path = checkpoint_dir / f"global_step_{step}"
    return path if path.exists() else None


def retire_verl_checkpoints(checkpoint_dir: Path) -> None:
    """After a successful merge the run is finished: delete verl's step folders and tracker,
    so no later launch resumes it (the merged model is the output)."""
    import shutil

    for p in checkpoint_dir.glob("global_step_*"):
        shutil.rmtree(p, ignore_errors=True)
    (checkpoint_dir / "latest_checkpointed_iteration.txt").unlink(missing_ok=True)
    log.info("retired verl checkpoints in %s (merged into the final model)", checkpoint_dir)


def merge_checkpoint(step_dir: Path, target: Path, python: str | None = None) -> Path:
    """Merge `step_dir/actor` (FSDP shards) into an HF folder `target` with verl.model_merger (atomic)."""
    actor = step_dir / "actor"
    if not actor.is_dir():
        raise DataError("no actor/ folder in the checkpoint", path=step_dir)
    with atomic_dir(target) as tmp:
        cmd = [python or sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
               "--local_dir", str(actor), "--target_dir", str(tmp)]
        log.info("merging %s -> %s", actor, target)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise MempoError(f"verl.model_merger failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}",
                             path=actor)
        tok_src = actor / "huggingface"
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (tok_src / name).exists() and not (tmp / name).exists():
                (tmp / name).write_bytes((tok_src / name).read_bytes())
    return target


# verl params that may change between a run and its resumption (the step budget, where the
# cluster is, whether to merge, the MLflow experiment name).
_VERL_RESUME_SAFE = frozenset({"total_epochs", "total_training_steps", "ray_address", "merge", "experiment_name",
                               # launch checks and rollout-health limits: they stop a run, never change it
                               "shared_dir", "preflight_timeout_s", "max_tool_failure_rate",
                               "max_failed_session_rate", "min_health_samples"})


def guard_verl_checkpoints(plan: VerlRunPlan, params: Any) -> Path | None:
    """verl resumes (`resume_mode: auto`) from whatever is in `plan.checkpoint_dir`: make
    sure that is this run's. The fingerprint covers the `verl`, `mempo`, `rollout` params,
    lambda_mem and the contents of the start policy, the data folder and the Hydra overlay;
    the retriever counts by its URL (the launcher may not reach the service). A mismatch
    moves verl's checkpoints aside (see `checkpoint.guard_run_dir`). Returns where, or None.
    """
    from mempo.training.checkpoint import guard_run_dir
    from mempo.training.fingerprint import HASH_CACHE_FILE, run_fingerprint

    vp = params.verl
    lambda_mem = vp.lambda_mem if vp.lambda_mem is not None else params.mempo.lambda_mem
    cmd = plan.command
    overlay = Path(cmd[cmd.index("--config-path") + 1]) / f"{cmd[cmd.index('--config-name') + 1]}.yaml"
    fingerprint = run_fingerprint(
        {"verl": vp.model_dump(), "mempo": params.mempo.model_dump(), "rollout": params.rollout.model_dump(),
         "lambda_mem": float(lambda_mem)},
        {"policy": vp.policy, "data": vp.data, "config": overlay, "retriever": vp.retriever},
        plan.out / "verl" / HASH_CACHE_FILE, probe_services=False, ignore=_VERL_RESUME_SAFE)
    return guard_run_dir(plan.checkpoint_dir, fingerprint)
