"""The memory reward's probes, packed as prefix trees vs one row each, on GRPO rollouts of a
finished pipeline's SFT policy, measured in the same process.

MemPO's memory reward scores the gold answer after each turn's memory and after the full
history that memory replaces (`mempo.advantage.memory_reward`, eps full_context). Turn t's
full history is the start of turn t+1's, so one row per probe runs an episode's history
about T / 2 times; packed (`mempo.training.packing`), the longest probe runs once and the
others add only their answer on its KV cache. This benchmark rolls out GRPO batches as the
train stage does (the default run's `train.batch_questions` x `train.n_rollouts`, sampled),
then scores each batch's memories both ways, interleaved batch by batch so a drift of the
machine's speed hits both the same, and checks that the rewards agree.

    .venv/bin/python benchmarks/memory_probe.py --root <a finished make run> [--batches 6]
    .venv/bin/python benchmarks/memory_probe.py --policy P --data D --retriever R   # any policy

Writes benchmarks/results/memory_probe.json: per batch the probe count, prompt tokens and
thread CPU seconds each way; the median ratio; the largest reward difference; and, from
the root's train stage history, the share of an RL step memory scoring took, with the step
time the ratio predicts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=".", help="a finished `make run`; the paths below are relative to it")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--policy", default="outputs/sft/model", help="the memory-format SFT policy")
    ap.add_argument("--data", default=None, help="prepared data (default: the params' train.data)")
    ap.add_argument("--retriever", default=None, help="index or corpus (default: the params' train.retriever)")
    ap.add_argument("--history", default="outputs/train/history.jsonl", help="a train stage's history, if any")
    ap.add_argument("--batches", type=int, default=6, help="GRPO rollout batches scored each way")
    ap.add_argument("--quick", action="store_true", help="2 batches")
    ap.add_argument("--n-rollouts", type=int, default=None)
    ap.add_argument("--batch-questions", type=int, default=None)
    ap.add_argument("--max-turns", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "memory_probe.json"))
    a = ap.parse_args(argv)
    if a.quick:
        a.batches = 2
    return a


def step_shares(history: Path) -> dict[str, float] | None:
    """Mean seconds of an RL step and of its memory scoring in a train stage's history.jsonl."""
    if not history.exists():
        return None
    rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time_step" in r and "time_mem_scoring" in r]
    if not rows:
        return None
    step = statistics.mean(r["time_step"] for r in rows)
    mem = statistics.mean(r["time_mem_scoring"] for r in rows)
    return {"steps": len(rows), "step_s": step, "mem_scoring_s": mem, "mem_scoring_share": mem / step}


def main(argv: list[str] | None = None) -> int:
    import torch

    sys.path.insert(0, str(REPO))
    from mempo.agent.generation import make_generator
    from mempo.config import load_params
    from mempo.retrieval import open_retriever
    from mempo.training.grpo import (
        episode_memory_rewards,
        load_tasks,
        make_rollout_setup,
        step_tasks,
    )
    from mempo.training.rollouts import lockstep_episodes
    from mempo.training.runtime import load_policy

    a = _args(argv)
    root = Path(a.root).resolve()
    over: dict[str, Any] = {"mempo.eps": "full_context", "mempo.form": "logprob"}
    for key, value in (("train.n_rollouts", a.n_rollouts), ("train.batch_questions", a.batch_questions),
                       ("rollout.max_turns", a.max_turns), ("rollout.max_new_tokens", a.max_new_tokens)):
        if value is not None:
            over[key] = value
    params_path = root / a.params
    params = load_params(params_path if params_path.exists() else None, over)
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    tp, mp = params.train, params.mempo
    model, tok = load_policy(root / a.policy, "cpu", "float32")
    model.eval()
    tasks = load_tasks(root / (a.data or tp.data), "train")
    agent = tp.rollout_params()
    rows: list[dict[str, Any]] = []
    worst = 0.0
    with open_retriever(str(root / (a.retriever or tp.retriever))) as retriever:
        setup = make_rollout_setup(retriever, tok, agent)
        generator = make_generator(model, tok, agent.decoder, batch_size=tp.generation_batch_size)
        for b in range(a.batches):
            items = [tasks[i] for i in step_tasks(len(tasks), tp.batch_questions, b, a.seed)]
            episodes = lockstep_episodes(items, generator, setup.sampling, setup.env, tok, tp.n_rollouts,
                                         setup.config, context="memory")
            times, rewards = {}, {}
            for packed in ((False, True) if b % 2 == 0 else (True, False)):
                t0 = time.thread_time()
                rewards[packed] = episode_memory_rewards(model, tok, episodes, mp, packed=packed)
                times[packed] = time.thread_time() - t0
            worst = max(worst, float((rewards[True] - rewards[False]).abs().max()))
            n_probes = sum(len(ep.turns) for ep in episodes)
            rows.append({"batch": b, "episodes": len(episodes), "turn_records": n_probes,
                         "one_row_each_s": times[False], "packed_s": times[True],
                         "ratio": times[False] / max(times[True], 1e-9)})
            print(f"batch {b}: {n_probes} turn records, one row each {times[False]:.2f} s, "
                  f"packed {times[True]:.2f} s ({rows[-1]['ratio']:.2f}x)", flush=True)
    ratio = statistics.median(r["ratio"] for r in rows)
    shares = step_shares(root / a.history)
    out: dict[str, Any] = {
        "benchmark": "memory_probe", "date": time.strftime("%Y-%m-%d"), "root": root.name,
        "reward": {"eps": "full_context", "form": "logprob"}, "batches": rows,
        "median_ratio": ratio,
        "total_ratio": sum(r["one_row_each_s"] for r in rows) / max(sum(r["packed_s"] for r in rows), 1e-9),
        "max_abs_reward_difference": worst,
    }
    if shares:
        # the train stage ran with packing or without it: the prediction assumes it ran without
        shares["predicted_step_s_packed"] = shares["step_s"] - shares["mem_scoring_s"] * (1 - 1 / ratio)
        out["train_stage"] = shares
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"median {ratio:.2f}x packed over one row each; largest reward difference {worst:.2e}; -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
