"""`trainer.v1.trainer_mode=mempo_sync`: verl's synchronous V1 trainer with MemPO's advantage.

`MempoTrainerSync` subclasses verl 0.9.1's `PPOTrainerSync` and replaces one step,
`_compute_advantage`: with `algorithm.adv_estimator=mempo` it computes GRPO per EPISODE
(one outcome score per multi-turn trajectory, grouped by prompt uid) and adds
lambda_mem * A^M on each turn's `<mem>` tokens, reading the per-turn memory mask and memory
score that `MemAgentLoop` stored in `extra_fields`. Everything else (rollout, old/ref
log-probs, KL, the clipped loss, checkpoints, validation) is verl's.

verl's base class branches on `trainer_mode == "sync"` in several places (replay buffer,
data loader refill, checkpointed TransferQueue state). The registered name must differ
from "sync", so `trainer_mode` is a property that reads "sync" for those branches while
the registered name stays available as `registered_mode`.

Two more duties, both cheap:
- rollout health (`mempo.verl_plugin.health`): every step logs the retrieval failure rate,
  the missing sessions and the turns per episode as `mempo/*` metrics, and stops the run
  when a failure rate passes its `mempo:` limit;
- progress: after every step, `<trainer.default_local_dir>/../progress.json` holds the step,
  the total and the health numbers (the RayJob step reports it while it waits).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import transfer_queue as tq
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import apply_kl_penalty
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from mempo.verl_plugin import ADV_ESTIMATOR_NAME, TRAINER_NAME
from mempo.verl_plugin.advantage import (
    MempoAdvantageConfig,
    mem_tensors_from_extra_fields,
    mempo_advantages,
)
from mempo.verl_plugin.health import HealthLimits, check_rollout_health, rollout_health
from mempo.verl_plugin.reward import FINAL_ANSWER_KEY

log = logging.getLogger(__name__)


def mempo_advantage_step(
    data: DataProto,
    batch_keys: Sequence[str],
    extra_fields: Sequence[Mapping[str, Any] | None],
    config: MempoAdvantageConfig,
    is_padding: Sequence[bool] | None = None,
) -> tuple[DataProto, dict[str, float]]:
    """Set `advantages` and `returns` ([B, L]) on a padded verl batch of turn rows.

    `data.batch` needs `token_level_rewards` and `response_mask` ([B, L], right-padded),
    `data.non_tensor_batch["uid"]` the prompt uids; `extra_fields` are the rows' agent-loop
    extra fields (see `mem_tensors_from_extra_fields`). This is exactly what
    `MempoTrainerSync._compute_advantage` runs between the TransferQueue get and put.
    """
    response_mask = data.batch["response_mask"]
    mem_mask, mem_scores, turn_index, full = mem_tensors_from_extra_fields(
        extra_fields, response_mask.shape[1], config.form)
    adv, metrics = mempo_advantages(
        batch_keys=list(batch_keys),
        uids=list(data.non_tensor_batch["uid"]),
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=response_mask,
        mem_mask=mem_mask,
        mem_scores=mem_scores,
        turn_index=turn_index,
        config=config,
        full_context_scores=full,
        is_padding=is_padding,
        answered=[(ef or {}).get(FINAL_ANSWER_KEY) is not None for ef in extra_fields],
    )
    adv = adv.to(data.batch["token_level_rewards"].dtype)
    data.batch["advantages"] = adv
    data.batch["returns"] = adv
    return data, metrics


def write_progress(path: Path, step: int, total: int, health: Mapping[str, float] | None) -> None:
    """Write `{"step", "total", "time", "health"}` atomically; a failure is logged, never raised."""
    from mempo.io import write_json

    try:
        write_json(path, {"step": step, "total": total, "time": time.time(), "health": dict(health or {})})
    except OSError as e:  # progress is for people watching; training goes on without it
        log.warning("could not write %s: %s", path, e)


@register_trainer(TRAINER_NAME)
class MempoTrainerSync(PPOTrainerSync):
    """PPOTrainerSync whose advantage step is MemPO's (see module docstring)."""

    @property  # type: ignore[override]
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        self.registered_mode = value

    def _mempo_config(self) -> MempoAdvantageConfig:
        return MempoAdvantageConfig.from_mapping(self.config.get("mempo"))

    def _check_health(self, keys: Sequence[str], extra_fields: Sequence[Any], is_padding: Sequence[bool],
                      metrics: dict) -> None:
        """Log the batch's rollout health and stop the run when it is too broken (see module docstring)."""
        sync_steps = max(1, int(getattr(self, "parameter_sync_step", 1) or 1))
        health = rollout_health(keys, extra_fields, int(self.config.actor_rollout_ref.rollout.n), is_padding,
                                n_prompts=int(self.config.data.train_batch_size) // sync_steps)
        metrics.update(health)
        self._mempo_health = health
        check_rollout_health(health, HealthLimits.from_mapping(self.config.get("mempo")))

    def on_step_end(self) -> None:
        super().on_step_end()
        write_progress(Path(str(self.config.trainer.default_local_dir)).parent / "progress.json",
                       int(self.global_steps), int(getattr(self, "total_training_steps", 0) or 0),
                       getattr(self, "_mempo_health", None))

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        """verl's `_compute_advantage` with the advantage maths replaced by MemPO's."""
        if self.config.algorithm.adv_estimator != ADV_ESTIMATOR_NAME:
            return super()._compute_advantage(batch, metrics)
        fields = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        extra = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
        extra_fields = extra.pop("extra_fields").tolist()
        is_padding = [bool(tag.get("is_padding", False)) for tag in batch.tags]
        self._check_health(batch.keys, extra_fields, is_padding, metrics)

        response_mask = data["response_mask"]
        data = DataProto(batch=data.to_padded_tensor())
        data.batch["token_level_scores"] = data.batch["rm_scores"]
        data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)

        # 1. KL penalty in the reward (off in MemPO's config; kept for parity with verl).
        if self.config.algorithm.use_kl_in_reward:
            data, kl_metrics = apply_kl_penalty(
                data, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=self.config.algorithm.kl_penalty)
            metrics.update(kl_metrics)
        else:
            data.batch["token_level_rewards"] = data.batch["token_level_scores"]

        # 2. rollout correction (decoupled mode only), unchanged from verl.
        rollout_corr_config = self.config.algorithm.get("rollout_correction", None)
        bypass = rollout_corr_config and rollout_corr_config.get("bypass_mode", False)
        rollout_correction = (
            rollout_corr_config is not None and "rollout_log_probs" in data.batch and not bypass)
        if rollout_correction:
            data, is_metrics = compute_rollout_correction_and_add_to_batch(data, rollout_corr_config)
            metrics.update(is_metrics)

        # 3. MemPO: episode-level A^T + lambda_mem * A^M on <mem> tokens.
        data, mempo_metrics = mempo_advantage_step(
            data, batch.keys, extra_fields, self._mempo_config(), is_padding=is_padding)
        metrics.update(mempo_metrics)

        # 4. write nested advantages and returns back to TransferQueue.
        out_fields = ["advantages", "returns"]
        if self.config.algorithm.use_kl_in_reward:
            out_fields.append("token_level_rewards")
        if rollout_correction:
            out_fields.append("response_mask")
            if "rollout_is_weights" in data.batch:
                out_fields.append("rollout_is_weights")
        output = {f: response_to_nested(data.batch[f], response_mask) for f in out_fields}
        return tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id,
            fields=TensorDict(output, batch_size=len(batch)))
