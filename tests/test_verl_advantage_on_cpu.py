"""MemPO's advantage on the verl path equals the core (local-trainer) maths, and both ways of
getting memory rewards (actor recompute, rollout-server prompt log-probs) agree."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from verl_cpu_helpers import ScriptedServer, tiny_policy  # noqa: F401

from mempo.advantage import answer_probability, memory_reward_from_scores
from mempo.verl_plugin.advantage import (
    MempoAdvantageConfig,
    mem_tensors_from_extra_fields,
    parse_output_key,
)
from mempo.verl_plugin.reward import FINAL_ANSWER_KEY

WIDTH = 12


def _episodes(seed: int = 0) -> list[dict]:
    """Rollouts of 2 prompts x 3 sessions with 1-4 turns; per turn a memory score and mask."""
    rng = random.Random(seed)
    eps = []
    for uid in ("q_a", "q_b"):  # underscores in uids must survive key parsing
        for session in range(3):
            turns = []
            for _turn in range(rng.randint(1, 4)):
                length = rng.randint(3, WIDTH)
                start = rng.randint(0, length - 2)
                turns.append({"length": length, "mem": (start, rng.randint(start + 1, length)),
                              "score": rng.random(), "full": rng.random()})
            eps.append({"uid": uid, "session": session, "R": float(rng.random() < 0.5), "turns": turns,
                        "answered": (uid, session) != ("q_a", 1)})  # one rollout stopped at the turn limit
    return eps


def _local_advantages(eps, cfg: MempoAdvantageConfig) -> dict[tuple[str, int, int], torch.Tensor]:
    """The local trainer's advantages for the same rollouts: its R^M (core
    `memory_reward_from_scores`, which `memory_reward` applies to the probe scores) and its
    `mempo.training.grpo_update.build_turn_samples`."""
    from mempo.agent.rollout import Episode, TurnRecord
    from mempo.config import MempoParams
    from mempo.training.grpo_update import build_turn_samples

    episodes = []
    for e in eps:
        ep = Episode(episode_id=f"{e['uid']}#{e['session']}", item_id=e["uid"], question="q",
                     golden_answers=["a"], objectives=[["a"]], context="memory",
                     final_answer="a" if e["answered"] else None)
        for t, turn in enumerate(e["turns"]):
            mask = [1 if turn["mem"][0] <= j < turn["mem"][1] else 0 for j in range(turn["length"])]
            ep.turns.append(TurnRecord(
                turn_index=t, prompt_ids=[1], response_ids=list(range(turn["length"])),
                response_mask=[1] * turn["length"], mem_mask=mask, memory="m", prompt_length=1,
                response_text="", action=None, argument=None, valid=True, error=""))
        episodes.append(ep)
    records = [(i, t) for i, e in enumerate(eps) for t in range(len(e["turns"]))]
    # the probe's score in the configured form (P, or mean log P as the agent loop also reports)
    pick = (lambda x: float(np.log(x))) if cfg.form == "logprob" else float
    scores = [pick(eps[i]["turns"][t]["score"]) for i, t in records]
    full = [pick(eps[i]["turns"][t]["full"]) for i, t in records]
    r_m = memory_reward_from_scores(scores, [episodes[i].episode_id for i, _ in records], [t for _, t in records],
                                    cfg.eps, full if cfg.eps == "full_context" else None, cfg.rm_max)
    mempo = MempoParams(eps=cfg.eps, norm_by_std=cfg.norm_by_std, mem_adv_group=cfg.mem_adv_group,
                        adv_eps=cfg.adv_eps, final_memory=cfg.final_memory, rm_max=cfg.rm_max)
    samples, _ = build_turn_samples(episodes, [e.item_id for e in episodes], [e["R"] for e in eps], r_m,
                                    cfg.lambda_mem, mempo)
    assert len(samples) == len(records)
    return {(eps[i]["uid"], eps[i]["session"], t): torch.tensor(sample.advantages)
            for (i, t), sample in zip(records, samples, strict=True)}


def _verl_rows(eps, shuffle_seed: int = 1, padding_rows: int = 1):
    """The same rollouts as verl's TransferQueue rows: one per turn, shuffled, right-padded,
    the score copied to every turn row at its last token, plus synthetic padding rows."""
    rows = []
    for e in eps:
        for t, turn in enumerate(e["turns"]):
            rows.append((f"{e['uid']}_{e['session']}_{t}", e["uid"], e["R"], turn, t,
                         t == len(e["turns"]) - 1, "a" if e["answered"] else None))
    random.Random(shuffle_seed).shuffle(rows)
    keys, uids, extra = [], [], []
    rewards = torch.zeros(len(rows) + padding_rows, WIDTH)
    resp = torch.zeros(len(rows) + padding_rows, WIDTH, dtype=torch.long)
    for r, (key, uid, score, turn, t, last, answer) in enumerate(rows):
        keys.append(key)
        uids.append(uid)
        resp[r, :turn["length"]] = 1
        rewards[r, turn["length"] - 1] = score
        mask = [0] * turn["length"]
        for j in range(*turn["mem"]):
            mask[j] = 1
        extra.append({"mem_mask": mask, "turn_index": t, "mem_prob": turn["score"],
                      "mem_logprob": float(np.log(turn["score"])), "full_prob": turn["full"],
                      "full_logprob": float(np.log(turn["full"]))})
        if last:  # the agent loop writes the episode's final answer (None: none) on its last row
            extra[-1][FINAL_ANSWER_KEY] = answer
    for p in range(padding_rows):  # verl: pad uid, session p, turn 0; template extra fields copied
        keys.append(f"padabc_{p}_0")
        uids.append("padabc")
        resp[len(rows) + p, 0] = 1
        extra.append(dict(extra[0]))
    is_padding = [False] * len(rows) + [True] * padding_rows
    return keys, uids, rewards, resp, extra, is_padding


@pytest.mark.parametrize("cfg", [
    MempoAdvantageConfig(),  # the method's reward: eps full_context, form logprob
    MempoAdvantageConfig(lambda_mem=0.5, eps="none", norm_by_std=False, mem_adv_group="per_group"),
    MempoAdvantageConfig(eps="previous", form="prob"),
    MempoAdvantageConfig(final_memory="skip"),
    MempoAdvantageConfig(final_memory="closing"),
    MempoAdvantageConfig(rm_max=0.0),  # the retention penalty
])
def test_trainer_advantage_step_equals_local_trainer_advantages(cfg):
    from verl.protocol import DataProto

    from mempo.verl_plugin.trainer import mempo_advantage_step

    eps = _episodes()
    expected = _local_advantages(eps, cfg)
    keys, uids, rewards, resp, extra, is_padding = _verl_rows(eps)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": resp},
                               non_tensors={"uid": np.array(uids, dtype=object)})
    data, metrics = mempo_advantage_step(data, keys, extra, cfg, is_padding=is_padding)
    adv = data.batch["advantages"]
    assert torch.equal(data.batch["returns"], adv)
    for r, key in enumerate(keys):
        if is_padding[r]:
            assert torch.all(adv[r] == 0)
            continue
        uid, session, turn = parse_output_key(key)
        want = expected[(uid, int(session), turn)]
        n = len(want)
        torch.testing.assert_close(adv[r, :n], want, atol=1e-6, rtol=1e-5)
        assert torch.all(adv[r, n:] == 0)  # right padding
    assert metrics["mempo/episodes"] == 7  # 6 real sessions + the padding group
    assert adv.abs().sum() > 0


def test_closing_on_verl_takes_the_closes_from_the_rows_final_answers():
    """final_memory closing: a rollout whose last row carries no final answer (the turn limit)
    closes nothing, so its task's advantages change with it; without the flags the step refuses."""
    from verl.protocol import DataProto

    from mempo.verl_plugin.advantage import mempo_advantages
    from mempo.verl_plugin.trainer import mempo_advantage_step

    cfg = MempoAdvantageConfig(final_memory="closing")
    runs = {}
    for name, eps in (("one stopped", _episodes()), ("all answered", [{**e, "answered": True} for e in _episodes()])):
        keys, uids, rewards, resp, extra, is_padding = _verl_rows(eps)
        data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": resp},
                                   non_tensors={"uid": np.array(uids, dtype=object)})
        runs[name] = (keys, mempo_advantage_step(data, keys, extra, cfg, is_padding=is_padding)[0].batch["advantages"])
    keys, stopped = runs["one stopped"]
    _, answered = runs["all answered"]
    q_a = [r for r, k in enumerate(keys) if k.startswith("q_a_")]
    q_b = [r for r, k in enumerate(keys) if k.startswith("q_b_")]
    assert not torch.equal(stopped[q_a], answered[q_a])
    assert torch.equal(stopped[q_b], answered[q_b])
    keys, uids, rewards, resp, extra, is_padding = _verl_rows(_episodes())
    mem_mask, scores, turns, full = mem_tensors_from_extra_fields(extra, WIDTH, cfg.form)
    with pytest.raises(ValueError, match="needs `answered`"):
        mempo_advantages(keys, uids, rewards, resp, mem_mask, scores, turns, cfg, full, is_padding)


def test_without_memory_term_equals_verls_own_multi_trajectory_grpo():
    """lambda_mem=0: exactly verl's V1 GRPO for multi-output agent loops (an independent check)."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    from mempo.verl_plugin.trainer import mempo_advantage_step

    keys, uids, rewards, resp, extra, _ = _verl_rows(_episodes(3), padding_rows=0)
    theirs = compute_advantage_for_multi_trajectories(
        DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(), "response_mask": resp.clone()},
                            non_tensors={"uid": np.array(uids, dtype=object)}),
        batch_keys=keys, adv_estimator=AdvantageEstimator.GRPO, num_repeat=3).batch["advantages"]
    ours, _ = mempo_advantage_step(
        DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(), "response_mask": resp.clone()},
                            non_tensors={"uid": np.array(uids, dtype=object)}),
        keys, extra, MempoAdvantageConfig(lambda_mem=0.0))
    torch.testing.assert_close(ours.batch["advantages"], theirs.float(), atol=1e-6, rtol=1e-5)


def test_registered_estimator_matches_verl_grpo_on_single_turn_rows():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_adv_estimator_fn

    torch.manual_seed(0)
    rewards = torch.zeros(8, 5)
    rewards[:, -1] = torch.tensor([1.0, 0, 1, 1, 0, 0, 1, 0])
    mask = torch.ones(8, 5)
    index = np.array(["a"] * 4 + ["b"] * 4, dtype=object)
    ours, returns = get_adv_estimator_fn("mempo")(token_level_rewards=rewards, response_mask=mask, index=index)
    theirs, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    assert torch.equal(ours, returns)


def test_mem_tensors_from_extra_fields_pad_truncate_and_default():
    rows = [{"mem_mask": [0, 1, 1], "turn_index": 2, "mem_prob": 0.25, "mem_logprob": -1.0},
            None,
            {"mem_mask": [1] * 10, "turn_index": 0, "mem_prob": 0.5, "mem_logprob": -0.5, "full_prob": 0.1}]
    mask, scores, turns, full = mem_tensors_from_extra_fields(rows, width=4)
    assert mask.tolist() == [[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert scores.tolist() == [0.25, 0.0, 0.5] and turns.tolist() == [2, 0, 0]
    assert full is not None and full[2].item() == pytest.approx(0.1)
    _, logs, _, _ = mem_tensors_from_extra_fields(rows, width=4, form="logprob")
    assert logs.tolist() == [-1.0, 0.0, -0.5]


def test_parse_output_key_rejects_foreign_keys():
    assert parse_output_key("abc_def_1_12") == ("abc_def", "1", 12)
    with pytest.raises(ValueError):
        parse_output_key("no-turn-index")


def test_answer_logprob_rows_follow_verls_prompt_logprob_layout():
    from mempo.verl_plugin.memory_probe import answer_logprobs_from_prompt_logprobs

    # 3 prompt tokens + 2 answer tokens; row j = log p(token j+1); last row is verl's dummy
    rows = [[-0.1], [-0.2], [-0.3], [-0.4], [0.0]]
    assert answer_logprobs_from_prompt_logprobs(rows, 3, 2).tolist() == pytest.approx([-0.3, -0.4])
    with pytest.raises(ValueError):
        answer_logprobs_from_prompt_logprobs(rows, 3, 3)


def test_memory_rewards_actor_recompute_and_rollout_server_agree(tiny_policy):  # noqa: F811
    """Same (question, memory, answer) probes: core `answer_probability` on the model (the
    actor path) vs the rollout-server path on a server backed by the same model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mempo.agent.format import (
        ANSWER_PROBE_PREFIX,
        answer_continuation,
        answer_probe_messages,
        render_prompt,
    )
    from mempo.verl_plugin.memory_probe import answer_probability_from_server, memory_probe

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    cases = [("Who founded Quaevzawick?", None, "Thys Dreindreilvaix"),
             ("Who founded Quaevzawick?", "Quaevzawick was founded by Thys", "Thys Dreindreilvaix"),
             ("Where was Gaki born?; Who founded X?", "Gaki born in Ploria", "Ploria; Thys"),
             ("Q?", "", "a")]
    prompts = [render_prompt(tok, answer_probe_messages(q, m), ANSWER_PROBE_PREFIX) for q, m, _ in cases]
    answers = [answer_continuation(a) for _, _, a in cases]
    actor = answer_probability(model, tok, prompts, answers, batch_size=2)

    server = ScriptedServer(tok, [], model=model)
    probes = [memory_probe(tok, q, m, a) for q, m, a in cases]
    rollout = asyncio.run(answer_probability_from_server(server, probes, max_concurrency=2))

    assert len(server.probe_calls) == len(cases)
    torch.testing.assert_close(rollout.mean_logprob, actor.mean_logprob, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rollout.prob, actor.prob, atol=1e-5, rtol=1e-4)
    assert rollout.n_tokens.tolist() == actor.n_tokens.tolist()
    assert len(set(rollout.prob.tolist())) > 1  # the probes differ, so must the probabilities


def test_token_bucket_schedule_without_waiting():
    from mempo.verl_plugin.tool import TokenBucket

    now = [0.0]
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    bucket = TokenBucket(rate=10.0, burst=2, clock=lambda: now[0], sleep=fake_sleep)

    async def take(n: int) -> list[float]:
        return [await bucket.acquire() for _ in range(n)]

    waits = asyncio.run(take(5))
    assert waits[:2] == [0.0, 0.0]  # the burst
    assert waits[2:] == pytest.approx([0.1, 0.1, 0.1])  # then 10 per second
    assert sum(slept) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        TokenBucket(rate=0, burst=1)
