"""The local GRPO + memory-advantage trainer (MemPO), single process, CPU or one GPU.

    mempo train grpo --policy outputs/sft/model --data data/prepared --retriever outputs/index \
        --out outputs/train
    mempo --set mempo.lambda_mem=0 train grpo ...       # plain GRPO (no memory advantage)

One step:
 1. take B tasks from `train.parquet` (a seeded permutation per epoch; the position is in
    the checkpoint), run n rollouts each with the memory agent (`mempo.agent.rollout`,
    lockstep batched so a seed gives the same samples) against the retriever;
 2. R^T per episode (`Episode.outcome_reward`), A^T = `grpo_outcome_advantage` over each
    task's n rollouts;
 3. R^M per turn = `memory_reward` (batched teacher-forced P(a* | q, mem_t) - eps_t),
    A^M = `memory_advantage` within (task, turn index), per-token advantages = `combine`
    (A^T on every generated token + lambda_mem * A^M on the `<mem>` tokens);
 4. loss = clipped surrogate, token-mean per trajectory (all turns of an episode), averaged
    over trajectories, + kl_coef * low_var_kl to the frozen initial policy; AdamW with
    gradient clipping, `update_epochs` passes over `num_minibatches` minibatches.

Per-step metrics go to MLflow (stage run `train`) and the console; checkpoints (model,
optimiser, scheduler, RNG states, data position) every `checkpoint_every` steps, atomically;
`resume: auto` continues from the newest. Writes OUT/model (HF folder, logged to the run),
OUT/metrics.json, OUT/history.jsonl, OUT/plots/*.png (setup and ending: `mempo.training.stage`).
An exception ends the run FAILED. Every `val_every` steps a greedy check on `val.parquet`
runs through `mempo eval`'s own agent runner (`validate`: val_em, val_f1, ...).
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mempo.errors import ConfigError, DataError
from mempo.training.grpo_update import (
    build_turn_samples,
    fill_logprobs,
    mean,
    merge_turn_samples,
    sample_std,
    update_policy,
)

log = logging.getLogger(__name__)


def task_order(n_tasks: int, seed: int, epoch: int) -> list[int]:
    """The seeded permutation of task indices for `epoch` (same seed, same order)."""
    order = list(range(n_tasks))
    random.Random(seed * 7919 + epoch).shuffle(order)
    return order


def step_tasks(n_tasks: int, batch: int, step: int, seed: int) -> list[int]:
    """Task indices for optimiser step `step` (0-based): consecutive slices of per-epoch
    permutations; a batch never straddles two epochs (the tail of an epoch is skipped)."""
    if batch > n_tasks:
        raise ConfigError(f"batch_questions={batch} exceeds the {n_tasks} training tasks",
                          field="train.batch_questions")
    per_epoch = n_tasks // batch
    epoch, pos = divmod(step, per_epoch)
    return task_order(n_tasks, seed, epoch)[pos * batch:(pos + 1) * batch]


def episode_metrics(episodes: Sequence[Any], rewards: Sequence[float], multi_rule: str) -> dict[str, float]:
    """Outcome metrics of a set of episodes: reward mean/std, EM, F1, format validity, turns,
    response tokens per turn, prompt tokens per turn; EM and format validity per number of
    objectives (`em_k1`, `em_k2`, ...) when the batch mixes them."""
    from mempo.rewards import answer_correctness, token_f1

    em = [answer_correctness(ep.final_answer, ep.golden_answers, ep.objectives, multi_rule)  # type: ignore[arg-type]
          for ep in episodes]
    f1 = [token_f1(ep.final_answer, ep.golden_answers) for ep in episodes]
    from mempo.forgetting import forgetting_rate

    prompt_tokens = [n for ep in episodes for n in ep.prompt_tokens]
    resp = [len(t.response_ids) for ep in episodes for t in ep.turns]
    forgot = forgetting_rate((ep.objectives, ep.memory_steps()) for ep in episodes if ep.context == "memory")
    by_k: dict[int, list[int]] = {}
    for i, ep in enumerate(episodes):
        by_k.setdefault(max(1, len(ep.objectives)), []).append(i)
    per_k = {}
    if len(by_k) > 1:  # a mixture (singles + k=2): what RL does to each part, which the means hide
        for k, idx in sorted(by_k.items()):
            per_k[f"em_k{k}"] = mean([em[i] for i in idx])
            per_k[f"format_valid_k{k}"] = mean([float(episodes[i].format_valid) for i in idx])
    return {
        "reward_mean": mean(rewards), "reward_std": sample_std(rewards),
        "em": mean(em), "f1": mean(f1),
        "format_valid": mean([float(ep.format_valid) for ep in episodes]),
        "turns": mean([ep.num_turns for ep in episodes]),
        "response_length": mean(resp),
        "response_tokens_per_episode": mean([ep.response_tokens for ep in episodes]),
        "prompt_tokens_per_turn": mean(prompt_tokens),
        "hit_turn_limit": mean([float(ep.hit_turn_limit) for ep in episodes]),
        **({"forgetting_rate": forgot} if forgot is not None else {}),
        **per_k,
    }


@dataclass
class RolloutSetup:
    """What a rollout needs besides the model: env, sampling, limits."""

    env: Any
    sampling: Any
    config: Any


def make_rollout_setup(retriever: Any, tokenizer: Any, rollout: Any) -> RolloutSetup:
    """Tool env, sampling params and rollout config from the training episodes' settings
    (`params.train.rollout_params()`: `rollout:` with `train.rollout` over it)."""
    from mempo.agent.generation import SamplingParams
    from mempo.agent.rollout import RolloutConfig
    from mempo.agent.tools import ToolConfig, ToolEnv

    env = ToolEnv(retriever, tokenizer, ToolConfig.from_params(rollout))
    sampling = SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                              top_p=rollout.top_p, seed=None, logprobs=False)
    return RolloutSetup(env, sampling, RolloutConfig.from_params(rollout))


# The eval agent that runs in each training context.
AGENT_OF_CONTEXT = {"memory": "memory", "full": "full_context"}


def val_settings(rollout: Any, tp: Any) -> Any:
    """The evaluation settings of the periodic validation: the training episodes' tools and
    turn limits (`rollout`, resolved for `train:`), greedy, `train.generation_batch_size`
    episodes at once, no probe (the other eval-only knobs: `EvalParams` defaults)."""
    from mempo.config import EvalParams
    from mempo.evaluation.settings import EvalSettings

    greedy = rollout.model_copy(update={"temperature": 0.0, "max_concurrent_episodes": tp.generation_batch_size})
    return EvalSettings.from_params(EvalParams(memory_probe=False), rollout=greedy)


def validate(model: Any, tokenizer: Any, retriever: Any, tasks: Sequence[Any], rollout: Any,
             tp: Any) -> dict[str, float]:
    """Greedy episodes of the training agent on `tasks` (`mempo.tasks.Task`s) through `mempo eval`'s own
    code (`mempo.evaluation.agent_runner.run_multi_turn`): mean em, f1, format_valid, turns
    of its sample rows."""
    from mempo.agent.generation import make_generator
    from mempo.evaluation.agent_runner import run_multi_turn
    from mempo.evaluation.engine import Engine

    model.eval()
    engine = Engine(make_generator(model, tokenizer, rollout.decoder, batch_size=tp.generation_batch_size,
                                   prefix_cache_mb=rollout.prefix_cache_mb), tokenizer, retriever)
    rows = run_multi_turn(AGENT_OF_CONTEXT[rollout.context], "val", list(tasks), engine, val_settings(rollout, tp))
    return {m: mean([float(r[m]) for r in rows]) for m in ("em", "f1", "format_valid", "turns")}


def run_grpo(params: Any, tracking: bool = True) -> dict[str, Any]:
    """Run the local GRPO + memory-advantage trainer. `params` is the whole
    `mempo.config.Params` (reads `train`, `rollout`, `mempo`). Returns the final metrics."""
    from mempo.training.stage import tracked

    tp = params.train
    return tracked("train", tracking, lambda: _run_grpo(params),
                   params={"train": tp.model_dump(), "rollout": tp.rollout_params().model_dump(),
                           "mempo": params.mempo.model_dump()},
                   data={"policy": tp.policy, "train_data": str(Path(tp.data) / "train.parquet")})


def load_tasks(data: str | Path, split: str, limit: int | None = None) -> list[Any]:
    """The tasks of `data/<split>.parquet` (the data stage's verl schema), ids unique."""
    from mempo.data.schema import load_prepared

    path = Path(data) / f"{split}.parquet"
    tasks = [t.task for t in load_prepared(path)]
    if not tasks:
        raise DataError("no tasks", path=path)
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise DataError("task ids are not unique (extra_info.id)", path=path, field="extra_info.id")
    return tasks[:limit] if limit else tasks


def episode_memory_rewards(model: Any, tokenizer: Any, episodes: Sequence[Any], mempo: Any, packed: bool = True) -> Any:
    """R^M (`mempo.advantage.memory_reward`) of every turn record of memory-agent `episodes`,
    in episode / turn order, with `mempo`'s eps, form, rm_max and probe batch size: float tensor [M].
    `packed`: probes sharing leading tokens run them once (benchmarks/memory_probe.py)."""
    import torch

    from mempo.advantage import MemoryTurn, memory_reward

    turns = [(ep, t) for ep in episodes for t in ep.turns]
    full_prompts: list[str | None] = [None] * len(turns)
    if mempo.eps == "full_context":
        from mempo.agent.format import ANSWER_PROBE_PREFIX, render_prompt
        from mempo.agent.rollout import full_context_messages

        full_prompts = [render_prompt(tokenizer, full_context_messages(ep, t.turn_index), ANSWER_PROBE_PREFIX)
                        for ep, t in turns]
    records = [MemoryTurn(ep.episode_id, t.turn_index, ep.question, t.memory, ep.golden_answers[0], fp)
               for (ep, t), fp in zip(turns, full_prompts, strict=True)]
    with torch.no_grad():
        return memory_reward(model, tokenizer, records, mempo.eps, mempo.form, mempo.probe_batch_size, packed,
                             mempo.rm_max)


def _run_grpo(params: Any) -> dict[str, Any]:  # noqa: C901 - one loop, kept in one place on purpose
    import torch
    from tqdm import tqdm

    from mempo.agent.generation import make_generator
    from mempo.retrieval import open_retriever
    from mempo.tracking import active_run_id, log_metrics
    from mempo.training.rollouts import lockstep_episodes
    from mempo.training.stage import CurvePlot, TrainingStage

    tp, mp = params.train, params.mempo
    agent = tp.rollout_params()  # `rollout:` with `train.rollout` over it
    if agent.context == "full" and mp.lambda_mem != 0:
        raise ConfigError("the full-history agent writes no memory its context depends on: train it with "
                          "lambda_mem 0 (plain GRPO, Search-R1 style)", field="mempo.lambda_mem")
    stage = TrainingStage.start(tp.out, tp.policy, seed=tp.seed, threads=tp.threads, device=tp.device, dtype=tp.dtype)
    model, tok, device = stage.model, stage.tokenizer, stage.device
    ref_model = None
    if tp.kl_coef > 0:
        ref_model = copy.deepcopy(model).eval()
        for prm in ref_model.parameters():
            prm.requires_grad_(False)
    train_tasks = load_tasks(tp.data, "train")
    val_tasks = load_tasks(tp.data, "val", tp.val_questions) if tp.val_every and tp.val_questions else []
    # RL uses a constant LR after a linear warmup (as verl's default actor optimiser).
    opt = torch.optim.AdamW(model.parameters(), lr=tp.lr, weight_decay=tp.weight_decay, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(tp.warmup_steps, 1)))
    # The run's identity: params plus the contents of what it reads (a changed start policy,
    # data or index is a different run, whose old checkpoints must not be continued).
    state = stage.resume(tp.resume, {"train": tp.model_dump(), "rollout": agent.model_dump(), "mempo": mp.model_dump()},
                         {"policy": tp.policy, "data": tp.data, "retriever": tp.retriever}, opt, sched)
    pad_id = tok.pad_token_id
    temperature = agent.temperature if agent.temperature > 0 else 1.0
    t_run = time.perf_counter()

    with open_retriever(tp.retriever) as retriever:
        setup = make_rollout_setup(retriever, tok, agent)
        generator = make_generator(model, tok, agent.decoder, batch_size=tp.generation_batch_size,
                                   prefix_cache_mb=agent.prefix_cache_mb)
        bar = tqdm(total=tp.steps, initial=state.step, desc=f"grpo (lambda_mem={mp.lambda_mem})", unit="step")
        while state.step < tp.steps:
            t0 = time.perf_counter()
            idx = step_tasks(len(train_tasks), tp.batch_questions, state.step, tp.seed)
            items = [train_tasks[i] for i in idx]
            # 1. rollouts
            model.eval()
            episodes = lockstep_episodes(items, generator, setup.sampling, setup.env, tok, tp.n_rollouts,
                                         setup.config, context=agent.context)
            t1 = time.perf_counter()
            groups = [ep.item_id for ep in episodes]
            rewards = [ep.outcome_reward(mp.multi_rule, mp.format_rule, mp.format_penalty, mp.no_answer_penalty)
                       for ep in episodes]
            # 2. memory rewards (batched teacher-forced answer probabilities)
            mem_r = None
            turns_flat = [(ep, t) for ep in episodes for t in ep.turns]
            if agent.context == "memory" and (mp.lambda_mem != 0 or tp.log_memory_reward):
                mem_r = episode_memory_rewards(model, tok, episodes, mp)
            t2 = time.perf_counter()
            # 3. advantages
            samples, adv = build_turn_samples(episodes, groups, rewards, mem_r, mp.lambda_mem, mp)
            n_records = len(samples)
            samples = merge_turn_samples(samples)  # full history: one record per episode
            # 4. update
            upd: dict[str, float] = {}
            if samples:
                if ref_model is not None:
                    fill_logprobs(ref_model, samples, pad_id, temperature, "ref_logp", tp.micro_batch_size,
                                  tp.token_budget, device)
                if tp.update_epochs > 1 or tp.num_minibatches > 1:
                    fill_logprobs(model, samples, pad_id, temperature, "old_logp", tp.micro_batch_size,
                                  tp.token_budget, device)
                model.train()
                upd = update_policy(model, opt, samples, pad_id, tp, temperature, device)
                sched.step()
            t3 = time.perf_counter()
            state.step += 1
            row: dict[str, float] = {"step": state.step}
            row.update(episode_metrics(episodes, rewards, mp.multi_rule))
            row.update(upd)
            row["update_records"] = float(len(samples))  # < turn records when full-history turns merged
            row["turn_records"] = float(n_records)
            row["lr"] = sched.get_last_lr()[0]
            row["adv_T_abs_mean"] = float(adv["A_T"].abs().mean()) if len(adv["A_T"]) else 0.0
            row["groups_with_signal"] = mean([
                float(sample_std([r for r, g in zip(rewards, groups, strict=True) if g == gid]) > 0)
                for gid in dict.fromkeys(groups)])
            if mem_r is not None and len(mem_r):
                row["mem_reward_mean"] = float(mem_r.mean())
                by_turn: dict[int, list[float]] = defaultdict(list)
                for (_, t), r in zip(turns_flat, mem_r.tolist(), strict=True):
                    by_turn[t.turn_index].append(r)
                for ti, vals in sorted(by_turn.items()):
                    row[f"mem_reward_turn_{ti}"] = mean(vals)
            row.update({"time_rollout": t1 - t0, "time_mem_scoring": t2 - t1, "time_update": t3 - t2,
                        "time_step": t3 - t0})
            row["mem_scoring_share"] = row["time_mem_scoring"] / max(row["time_step"], 1e-9)
            if tp.val_every and val_tasks and (state.step % tp.val_every == 0 or state.step == tp.steps):
                row.update({f"val_{k}": v for k, v in validate(model, tok, retriever, val_tasks, agent, tp).items()})
            state.history.append(row)
            log_metrics({k: v for k, v in row.items() if k != "step"}, step=state.step, prefix="train")
            bar.update(1)
            bar.set_postfix(R=f"{row['reward_mean']:.2f}", em=f"{row['em']:.2f}", kl=f"{row.get('kl', 0):.3f}",
                            t=f"{row['time_step']:.1f}s")
            log.info("step %d: reward %.3f em %.3f f1 %.3f valid %.2f kl %.4f ent %.3f clip %.3f "
                     "turns %.2f prompt/turn %.0f | rollout %.1fs mem %.2fs update %.1fs",
                     state.step, row["reward_mean"], row["em"], row["f1"], row["format_valid"],
                     row.get("kl", 0.0), row.get("entropy", 0.0), row.get("clip_frac", 0.0), row["turns"],
                     row["prompt_tokens_per_turn"], row["time_rollout"], row["time_mem_scoring"],
                     row["time_update"])
            if state.step % tp.checkpoint_every == 0 and state.step < tp.steps:
                state.data_position = {"next_step": state.step, "tasks_seen": state.step * tp.batch_questions}
                stage.checkpoint(opt, sched, state, tp.keep_checkpoints)
        bar.close()

    hist = state.history
    total_step = sum(r["time_step"] for r in hist)
    metrics: dict[str, Any] = {
        "steps": state.step,
        "lambda_mem": mp.lambda_mem,
        "train_seconds": time.perf_counter() - t_run,
        "final_reward_mean": mean([r["reward_mean"] for r in hist[-max(1, len(hist) // 4):]]),
        "final_em": mean([r["em"] for r in hist[-max(1, len(hist) // 4):]]),
        "final_kl": mean([r["kl"] for r in hist[-max(1, len(hist) // 4):]]),
        "mean_time_step": total_step / max(len(hist), 1),
        "mean_time_rollout": mean([r["time_rollout"] for r in hist]),
        "mean_time_mem_scoring": mean([r["time_mem_scoring"] for r in hist]),
        "mean_time_update": mean([r["time_update"] for r in hist]),
        "mem_scoring_share": sum(r["time_mem_scoring"] for r in hist) / max(total_step, 1e-9),
        "prompt_tokens_per_turn": mean([r["prompt_tokens_per_turn"] for r in hist]),
    }
    if active_run_id():
        metrics["mlflow_run_id"] = active_run_id()  # `mempo register` links the model to this run
    vals = [r for r in hist if "val_em" in r]
    per_k = sorted({k for r in hist for k in r if k.startswith(("em_k", "format_valid_k"))})
    if vals:
        metrics["val_em"] = vals[-1]["val_em"]
        metrics["val_f1"] = vals[-1]["val_f1"]
    stage.finish({"kind": "grpo", "base": str(tp.policy), "steps": state.step, "lambda_mem": mp.lambda_mem,
                  "context": agent.context}, metrics, hist, [
        CurvePlot(["reward_mean", "em", "format_valid"] + (["val_em"] if vals else []), "train_reward.png",
                  f"GRPO (lambda_mem={mp.lambda_mem})"),
        CurvePlot(["kl", "entropy", "clip_frac"], "train_policy.png", "policy statistics"),
        CurvePlot(["time_rollout", "time_mem_scoring", "time_update"], "train_time.png", "step time (s)"),
        *([CurvePlot(per_k, "train_per_k.png", "EM and format validity per number of objectives")] if per_k else []),
    ], "train_final")
    return metrics
