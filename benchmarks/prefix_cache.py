"""The decoder's prefix cache on the full-history agent: its GRPO rollouts and its evaluation
with the cache (`rollout.prefix_cache_mb`) and without, in the same process.

A full-history (Search-R1 style) agent's prompt at turn t+1 is its prompt at turn t, its
response and the observation. Without the cache the decoder prefills the whole history at
every turn; with it, only the tokens after what it decoded last turn
(`mempo.agent.prefix_cache`). This benchmark runs, on a trained full-history policy:

1. `rollouts`: GRPO batches as the full-history train stage samples them (`train.batch_questions`
   x `train.n_rollouts`, `train.rollout` settings, context full), each batch once per mode on the
   same tasks and torch seed, the order of the modes alternating from batch to batch: wall and
   process CPU seconds (one thread), prompt tokens prefilled, response tokens.
2. `eval`: `mempo.evaluation.agent_runner.evaluate_items` with the `full_context` agent on the
   first `--eval-tasks` world-k2 test tasks (params.yaml `eval:` settings, greedy) once per
   mode: wall time, and whether the predictions are identical.

    .venv/bin/python benchmarks/prefix_cache.py --root <a finished make run> [--batches 4]
    .venv/bin/python benchmarks/prefix_cache.py --policy P --data D --retriever R --world W

Writes benchmarks/results/prefix_cache.json.
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
MODES = {"no_cache": 0, "prefix_cache": None}  # None: params.yaml's rollout.prefix_cache_mb


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=".", help="a finished `make run`; the paths below are relative to it")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--policy", default="outputs/sft_full/model", help="a full-history policy")
    ap.add_argument("--data", default=None, help="prepared data (default: the params' train.data)")
    ap.add_argument("--retriever", default=None, help="index or corpus (default: the params' train.retriever)")
    ap.add_argument("--world", default=None, help="the world (its qa/test.jsonl; default: the params' world.out)")
    ap.add_argument("--batches", type=int, default=4, help="GRPO rollout batches, each run both ways")
    ap.add_argument("--eval-tasks", type=int, default=32, help="world-k2 test tasks evaluated both ways (0 = skip)")
    ap.add_argument("--quick", action="store_true", help="1 batch, 4 eval tasks")
    ap.add_argument("--batch-questions", type=int, default=None)
    ap.add_argument("--n-rollouts", type=int, default=None)
    ap.add_argument("--max-turns", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "prefix_cache.json"))
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.eval_tasks = 1, min(a.eval_tasks, 4)
    return a


def _params(a: argparse.Namespace, root: Path) -> Any:
    from mempo.config import load_params

    over: dict[str, Any] = {"rollout.context": "full", "eval.memory_probe": False}
    for key, value in (("train.n_rollouts", a.n_rollouts), ("train.batch_questions", a.batch_questions),
                       ("rollout.max_turns", a.max_turns), ("rollout.max_new_tokens", a.max_new_tokens)):
        if value is not None:
            over[key] = value
    path = root / a.params
    return load_params(path if path.exists() else None, over)


def time_rollouts(a: argparse.Namespace, root: Path, params: Any, model: Any, tok: Any) -> dict[str, Any]:
    """Each GRPO batch once per mode (same tasks and torch seed): seconds and token counts."""
    import torch

    from mempo.agent.generation import make_generator
    from mempo.retrieval import open_retriever
    from mempo.training.grpo import load_tasks, make_rollout_setup, step_tasks
    from mempo.training.rollouts import lockstep_episodes

    tp = params.train
    agent = tp.rollout_params()
    tasks = load_tasks(root / (a.data or tp.data), "train")
    rows: list[dict[str, Any]] = []
    with open_retriever(str(root / (a.retriever or tp.retriever))) as retriever:
        setup = make_rollout_setup(retriever, tok, agent)
        for b in range(a.batches):
            items = [tasks[i] for i in step_tasks(len(tasks), tp.batch_questions, b, a.seed)]
            row: dict[str, Any] = {"batch": b}
            for mode in (list(MODES) if b % 2 == 0 else list(MODES)[::-1]):
                mb = agent.prefix_cache_mb if MODES[mode] is None else MODES[mode]
                gen = make_generator(model, tok, "fast", batch_size=tp.generation_batch_size, prefix_cache_mb=mb)
                torch.manual_seed(a.seed + b)
                t0, c0 = time.perf_counter(), time.process_time()
                eps = lockstep_episodes(items, gen, setup.sampling, setup.env, tok, tp.n_rollouts, setup.config,
                                        context="full")
                row[mode] = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                             "prefill_tokens": gen.decoder.stats["prefill_tokens"],
                             "prompt_tokens": sum(t.prompt_length for ep in eps for t in ep.turns),
                             "response_tokens": sum(ep.response_tokens for ep in eps),
                             "turns": sum(ep.num_turns for ep in eps)}
            row["ratio"] = row["no_cache"]["cpu_s"] / max(row["prefix_cache"]["cpu_s"], 1e-9)
            rows.append(row)
            print(f"batch {b}: {row['no_cache']['turns']} turns; prefilled {row['no_cache']['prefill_tokens']} -> "
                  f"{row['prefix_cache']['prefill_tokens']} tokens; {row['no_cache']['cpu_s']:.1f} -> "
                  f"{row['prefix_cache']['cpu_s']:.1f} s ({row['ratio']:.2f}x)", flush=True)
    total = {m: sum(r[m]["cpu_s"] for r in rows) for m in MODES}
    return {"batch_questions": tp.batch_questions, "n_rollouts": tp.n_rollouts, "max_turns": agent.max_turns,
            "max_new_tokens": agent.max_new_tokens, "temperature": agent.temperature, "batches": rows,
            "median_ratio": statistics.median(r["ratio"] for r in rows),
            "total_ratio": total["no_cache"] / max(total["prefix_cache"], 1e-9),
            "prefill_token_ratio": sum(r["no_cache"]["prefill_tokens"] for r in rows)
            / max(sum(r["prefix_cache"]["prefill_tokens"] for r in rows), 1)}


def time_eval(a: argparse.Namespace, root: Path, params: Any, policy: Path, world: Path) -> dict[str, Any]:
    """The full_context agent on the first `--eval-tasks` world-k2 test tasks, once per mode."""
    from mempo.evaluation.agent_runner import evaluate_items
    from mempo.evaluation.benchmarks import load_benchmarks
    from mempo.evaluation.engine import load_engine
    from mempo.evaluation.settings import EvalSettings

    ep = params.eval
    settings = EvalSettings.from_params(ep)
    tasks = load_benchmarks(["world-k2"], {"world": str(world / "qa" / "test.jsonl")}, limit=a.eval_tasks,
                            seed=ep.seed)
    out: dict[str, Any] = {"tasks": sum(len(v) for v in tasks.values()), "agent": "full_context"}
    predictions = {}
    for mode, mb in MODES.items():
        engine = load_engine(policy, policy, retriever=str(root / (a.retriever or params.train.retriever)),
                             concurrency=ep.rollout_params().max_concurrent_episodes, load_model_for_probe=False,
                             prefix_cache_mb=ep.rollout_params().prefix_cache_mb if mb is None else mb)
        t0 = time.perf_counter()
        rows = evaluate_items(tasks, ["full_context"], engine, settings)
        out[mode] = {"wall_s": time.perf_counter() - t0,
                     "em": statistics.fmean(float(r["em"]) for r in rows)}
        if engine.retriever is not None and hasattr(engine.retriever, "close"):
            engine.retriever.close()
        predictions[mode] = [r.get("prediction") for r in rows]
        print(f"eval {mode}: {len(rows)} tasks in {out[mode]['wall_s']:.1f} s", flush=True)
    out["ratio"] = out["no_cache"]["wall_s"] / max(out["prefix_cache"]["wall_s"], 1e-9)
    out["same_predictions"] = predictions["no_cache"] == predictions["prefix_cache"]
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    sys.path.insert(0, str(REPO))
    from mempo.training.runtime import load_policy

    a = _args(argv)
    root = Path(a.root).resolve()
    params = _params(a, root)
    torch.set_num_threads(1)
    model, tok = load_policy(root / a.policy, "cpu", "float32")
    model.eval()
    out: dict[str, Any] = {"benchmark": "prefix_cache", "date": time.strftime("%Y-%m-%d"), "threads": 1,
                           "policy": a.policy, "prefix_cache_mb": params.rollout.prefix_cache_mb,
                           "rollouts": time_rollouts(a, root, params, model, tok)}
    if a.eval_tasks > 0:
        out["eval"] = time_eval(a, root, params, root / a.policy, root / (a.world or params.world.out))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    r = out["rollouts"]
    print(f"rollouts: {r['total_ratio']:.2f}x CPU time, {r['prefill_token_ratio']:.2f}x fewer tokens prefilled"
          + (f"; eval {out['eval']['ratio']:.2f}x, same predictions: {out['eval']['same_predictions']}"
             if "eval" in out else "") + f" -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
