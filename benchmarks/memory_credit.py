"""Which memories does the memory advantage credit? A batch of training rollouts, classified.

    .venv/bin/python benchmarks/memory_credit.py --policy outputs/sft/model --tasks 32 --k 2 \
        --out benchmarks/results/memory_credit.json

Runs training rollouts as GRPO does (`train.rollout` sampling, `train.n_rollouts` per task,
lockstep batches) on the first `--tasks` k-objective tasks of the data stage's train split,
scores every memory with the configured reward (`mempo.eps`, `mempo.form`, the trainer's own
`episode_memory_rewards`) and normalises it into A^M as the trainer does, once with each
`mempo.final_memory` mode. Each turn record is classed by what its episode does at that turn:
it answers (all objectives right / some / none), it is the last turn without an answer (the
turn limit or a broken turn), or the episode continues. Mean R^M, mean A^M and the share of
positive A^M per class show whether the memory advantage credits closing memories over the
memories of episodes that go on searching.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CLASSES = ("answer: all right", "answer: some right", "answer: none right", "last turn, no answer", "continuing")


def turn_class(episode: Any, turn_index: int) -> str:
    """The class of `episode`'s turn `turn_index` (see the module docstring)."""
    from mempo.rewards import multi_objective_scores

    if turn_index < episode.num_turns - 1:
        return "continuing"
    if episode.final_answer is None:
        return "last turn, no answer"
    scores = multi_objective_scores(episode.final_answer, episode.objectives)
    return CLASSES[0] if scores.all_correct == 1.0 else CLASSES[1] if scores.mean > 0 else CLASSES[2]


def summarise(classes: Sequence[str], r_m: Sequence[float], a_m: Sequence[float],
              a_m_skip: Sequence[float], a_m_closing: Sequence[float]) -> dict[str, dict[str, float]]:
    """Per class: n, mean R^M, mean A^M and share of A^M > 0 (final memories scored), and
    mean A^M and share > 0 with `final_memory: skip` and with `final_memory: closing`."""
    by: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(classes):
        by[c].append(i)
    out = {}
    for c in CLASSES:
        idx = by.get(c, [])
        if idx:
            out[c] = {"n": len(idx), "r_m_mean": statistics.fmean(r_m[i] for i in idx),
                      "a_m_mean": statistics.fmean(a_m[i] for i in idx),
                      "a_m_positive_share": sum(a_m[i] > 0 for i in idx) / len(idx),
                      "a_m_mean_final_memory_skip": statistics.fmean(a_m_skip[i] for i in idx),
                      "a_m_mean_final_memory_closing": statistics.fmean(a_m_closing[i] for i in idx),
                      "a_m_positive_share_final_memory_closing": sum(a_m_closing[i] > 0 for i in idx) / len(idx)}
    return out


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--params", default="params.yaml", help="the run's params (defaults where missing)")
    ap.add_argument("--policy", default="outputs/sft/model", help="the policy that rolls out and scores")
    ap.add_argument("--data", default=None, help="prepared data folder (params: train.data)")
    ap.add_argument("--retriever", default=None, help="index folder or corpus .jsonl (params: train.retriever)")
    ap.add_argument("--tasks", type=int, default=32, help="k-objective train tasks (the first ones)")
    ap.add_argument("--k", type=int, default=2, help="objectives per task")
    ap.add_argument("--n-rollouts", type=int, default=None, help="rollouts per task (params: train.n_rollouts)")
    ap.add_argument("--max-turns", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--examples", type=int, default=4, help="memories shown per class")
    ap.add_argument("--out", default=None, help="JSON file to write")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    import torch

    from mempo.agent.generation import make_generator
    from mempo.config import load_params
    from mempo.errors import DataError
    from mempo.io import write_json
    from mempo.retrieval import open_retriever
    from mempo.training.grpo import episode_memory_rewards, load_tasks, make_rollout_setup
    from mempo.training.grpo_update import episode_memory_advantage
    from mempo.training.rollouts import lockstep_episodes
    from mempo.training.runtime import load_policy

    params = load_params(a.params, {
        "train.data": a.data, "train.retriever": a.retriever, "train.n_rollouts": a.n_rollouts,
        "train.rollout.max_turns": a.max_turns, "train.rollout.max_new_tokens": a.max_new_tokens})
    tp, mp = params.train, params.mempo
    agent = tp.rollout_params()
    tasks = [t for t in load_tasks(tp.data, "train") if t.k == a.k][:a.tasks]
    if not tasks:
        raise DataError(f"no k={a.k} tasks in the train split", path=Path(tp.data) / "train.parquet")
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    model, tok = load_policy(a.policy, "cpu", "float32")
    model.eval()
    with open_retriever(tp.retriever) as retriever:
        setup = make_rollout_setup(retriever, tok, agent)
        generator = make_generator(model, tok, agent.decoder, batch_size=tp.generation_batch_size)
        episodes = lockstep_episodes(tasks, generator, setup.sampling, setup.env, tok, tp.n_rollouts, setup.config,
                                     context="memory")
    r_m = episode_memory_rewards(model, tok, episodes, mp)
    records = [(ep, t) for ep in episodes for t in ep.turns]
    groups = [ep.item_id for ep in episodes]
    a_m, a_m_skip, a_m_closing = (
        episode_memory_advantage(episodes, groups, r_m, mp.model_copy(update={"final_memory": mode}))
        for mode in ("score", "skip", "closing"))
    classes = [turn_class(ep, t.turn_index) for ep, t in records]
    table = summarise(classes, r_m.tolist(), a_m.tolist(), a_m_skip.tolist(), a_m_closing.tolist())
    examples: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (ep, t), c, r, adv in zip(records, classes, r_m.tolist(), a_m.tolist(), strict=True):
        if len(examples[c]) < a.examples:
            examples[c].append({"task": ep.item_id, "turn": t.turn_index, "memory": t.memory, "r_m": r, "a_m": adv,
                                "answer": ep.final_answer, "gold": ep.golden_answers[0]})
    out = {"benchmark": "memory_credit", "policy": str(a.policy), "k": a.k, "tasks": len(tasks),
           "n_rollouts": tp.n_rollouts, "seed": a.seed, "episodes": len(episodes), "turn_records": len(records),
           "mempo": {"eps": mp.eps, "form": mp.form, "mem_adv_group": mp.mem_adv_group,
                     "mem_adv_min_std": mp.mem_adv_min_std},
           "classes": table, "examples": dict(examples)}
    print(f"{len(episodes)} episodes, {len(records)} turn records ({tp.n_rollouts} rollouts x {len(tasks)} "
          f"k={a.k} tasks, {a.policy})")
    print(f"{'class':<22}{'n':>6}{'R^M':>9}{'A^M':>9}{'A^M>0':>8}{'A^M skip':>10}{'A^M closing':>13}{'>0':>6}")
    for c, d in table.items():
        print(f"{c:<22}{d['n']:>6}{d['r_m_mean']:>+9.3f}{d['a_m_mean']:>+9.3f}{d['a_m_positive_share']:>8.2f}"
              f"{d['a_m_mean_final_memory_skip']:>+10.3f}{d['a_m_mean_final_memory_closing']:>+13.3f}"
              f"{d['a_m_positive_share_final_memory_closing']:>6.2f}")
    if a.out:
        write_json(a.out, out)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
