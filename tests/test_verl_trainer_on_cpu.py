"""`MempoTrainerSync._compute_advantage` end to end through a real TransferQueue on a local
CPU Ray instance: agent-loop outputs stored the way verl's TQ worker stores them, the trainer's
advantage step reads them back (nested tensors + extra_fields) and writes advantages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl_cpu_helpers import compose_mempo_config, tiny_policy  # noqa: F401

pytestmark = pytest.mark.slow  # starts Ray + TransferQueue (~20 s on 2 cores)


def _turn(prompt_len: int, resp_len: int, mem: tuple[int, int], turn: int, prob: float, score: float,
          full: float = 0.5):
    from verl.experimental.agent_loop import AgentLoopOutput

    mask = [1 if mem[0] <= j < mem[1] else 0 for j in range(resp_len)]
    return AgentLoopOutput(
        prompt_ids=list(range(1, prompt_len + 1)), response_ids=list(range(10, 10 + resp_len)),
        response_mask=[1] * resp_len, reward_score=score, num_turns=2, metrics={},
        extra_fields={"mem_mask": mask, "turn_index": turn, "mem_prob": prob, "mem_logprob": float(np.log(prob)),
                      "full_prob": full, "full_logprob": float(np.log(full)),
                      "min_global_steps": 0, "max_global_steps": 0},
    )


@pytest.fixture(scope="module")
def tq_session():
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    ray.shutdown()


def test_compute_advantage_through_transfer_queue(tq_session, tiny_policy):  # noqa: F811
    from transfer_queue import KVBatchMeta
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from mempo.verl_plugin.advantage import MempoAdvantageConfig, mempo_advantages
    from mempo.verl_plugin.trainer import MempoTrainerSync

    tq = tq_session
    # uid -> session -> turns; episode outcome 1/0 copied to every turn row (as verl does)
    episodes = {
        "qa": {0: [_turn(5, 6, (1, 3), 0, 0.2, 1.0, 0.3), _turn(7, 4, (0, 2), 1, 0.6, 1.0, 0.4)],
               1: [_turn(5, 5, (1, 4), 0, 0.1, 0.0)]},
        "qb": {0: [_turn(6, 3, (0, 1), 0, 0.3, 0.0), _turn(4, 8, (2, 5), 1, 0.2, 0.0)],
               1: [_turn(6, 7, (1, 2), 0, 0.5, 1.0), _turn(5, 6, (0, 3), 1, 0.9, 1.0)]},
    }
    keys, fields, tags = [], [], []
    for uid, sessions in episodes.items():
        for session, turns in sessions.items():
            for i, out in enumerate(turns):
                field = out.as_dict()
                field.update(uid=uid, session_id=session)
                field["loss_mask"] = field["response_mask"]
                keys.append(f"{uid}_{session}_{i}")
                fields.append(field)
                tags.append({"status": "success"})
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields), tags=tags)

    trainer = MempoTrainerSync.__new__(MempoTrainerSync)
    # two prompts x two sessions: what the rollout-health check expects to find
    trainer.config = compose_mempo_config([f"actor_rollout_ref.model.path={tiny_policy}", "mempo.lambda_mem=0.7",
                                           "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2"])
    trainer.trainer_mode = "mempo_sync"
    metrics: dict = {}
    trainer._compute_advantage(KVBatchMeta(partition_id="train", keys=keys, tags=tags), metrics)

    got = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages", "returns"])
    adv_rows = [row for row in got["advantages"].unbind(0)]
    # expected: the pure step on the same rows, padded by hand
    width = max(len(f["responses"]) for f in fields)
    rewards = torch.zeros(len(fields), width)
    resp = torch.zeros(len(fields), width, dtype=torch.long)
    mem = torch.zeros(len(fields), width, dtype=torch.long)
    for r, f in enumerate(fields):
        n = len(f["responses"])
        rewards[r, :n] = f["rm_scores"]
        resp[r, :n] = 1
        mem[r, :n] = torch.tensor(f["extra_fields"]["mem_mask"])
    # the default reward: log p(a* | memory) - log p(a* | full history)
    config = MempoAdvantageConfig(lambda_mem=0.7)
    assert (config.eps, config.form) == ("full_context", "logprob")
    expected, _ = mempo_advantages(
        keys, [f["uid"] for f in fields], rewards, resp, mem,
        torch.tensor([f["extra_fields"]["mem_logprob"] for f in fields]),
        torch.tensor([f["extra_fields"]["turn_index"] for f in fields]), config,
        full_context_scores=torch.tensor([f["extra_fields"]["full_logprob"] for f in fields]))
    for r, row in enumerate(adv_rows):
        n = len(fields[r]["responses"])
        assert row.shape[0] == n  # written back as nested, one value per response token
        torch.testing.assert_close(row, expected[r, :n], atol=1e-6, rtol=1e-5)
    assert metrics["mempo/episodes"] == 4.0
    assert metrics["mempo/failed_sessions"] == 0.0 and metrics["mempo/turns_per_episode"] == 7 / 4
    assert any(row.unique().numel() > 1 for row in adv_rows)  # the memory term moved some tokens
