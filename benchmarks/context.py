"""Context-length benchmark: prompt tokens per turn of the memory agent vs the full-history agent.

The scripted teacher (`mempo.agent.teacher`) solves knowledge-world tasks of k = 1, 2, 4, 8,
16 objectives with real BM25 searches; every trajectory is replayed in two contexts:
`MemoryContext` (MemPO: question + last memory + last action/result) and `FullContext`
(Search-R1: the whole history, the baseline measured in the same run). Prompt tokens are
counted with a real tokenizer (default: SmolLM2-135M-Instruct's, from the packaged GGUF).

    .venv/bin/python benchmarks/context.py --quick            # tiny world, 4 tasks per k
    .venv/bin/python benchmarks/context.py --tokenizer outputs/policy --tasks 20

Writes benchmarks/results/context.json and benchmarks/results/context_prompt_tokens.png and
prints a table of full/memory ratios. Target: peak_prompt_ratio_k8 (full / memory) >= 4.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).resolve().parent / "results"
KS = (1, 2, 4, 8, 16)
TARGET_PEAK_RATIO_K8 = 4.0


def load_tokenizer(path: str | None) -> tuple[Any, str]:
    """An HF tokenizer folder, or (default) SmolLM2's tokenizer read from the packaged GGUF."""
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path), Path(path).name
    from mempo.policy.bootstrap import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), "SmolLM2-135M-Instruct (GGUF)"


def _stats(episodes: list[Any]) -> dict[str, Any]:
    per_turn = [n for e in episodes for n in e.prompt_tokens]
    peaks = [max(e.prompt_tokens) for e in episodes]
    by_turn: dict[int, list[int]] = {}
    for e in episodes:
        for t, n in enumerate(e.prompt_tokens):
            by_turn.setdefault(t, []).append(n)
    return {
        "episodes": len(episodes),
        "accuracy": statistics.fmean(e.outcome_reward() for e in episodes),
        "mean_turns": statistics.fmean(e.num_turns for e in episodes),
        "peak_prompt_tokens": statistics.fmean(peaks),  # mean over episodes of the episode's peak
        "max_prompt_tokens": max(peaks),
        "mean_prompt_tokens": statistics.fmean(per_turn),
        "total_prompt_tokens": sum(per_turn),
        "mean_prompt_tokens_by_turn": [statistics.fmean(by_turn[t]) for t in sorted(by_turn)],
    }


def run(world: Path, tokenizer: Any, n_tasks: int, seed: int, topk: int, obs_tokens: int) -> dict[str, Any]:
    """Teacher rollouts for each k in both contexts; returns the per-k statistics."""
    from mempo.agent.rollout import RolloutConfig, run_episodes
    from mempo.agent.teacher import ScriptedTeacher
    from mempo.agent.tools import ToolConfig, ToolEnv
    from mempo.datasets import load_qa
    from mempo.retrieval.inprocess import InProcessRetriever
    from mempo.tasks import compose_multi_objective

    retriever = InProcessRetriever.from_corpus(world / "corpus.jsonl", method="bm25")
    items = load_qa(world / "qa" / "test.jsonl") + load_qa(world / "qa" / "val.jsonl")
    env = ToolEnv(retriever, tokenizer, ToolConfig(topk=topk, observation_max_tokens=obs_tokens))
    per_k: dict[str, Any] = {}
    for k in KS:
        n = min(n_tasks, len(items) // k)
        tasks = compose_multi_objective(items, k=k, n_tasks=n, seed=seed)
        cfg = RolloutConfig(max_turns=8 * k + 8)
        row: dict[str, Any] = {"k": k, "tasks": n}
        for context in ("memory", "full"):
            t0 = time.perf_counter()
            eps = run_episodes(tasks, ScriptedTeacher(tokenizer), env, tokenizer, context=context,
                               config=cfg, progress=False)
            elapsed = time.perf_counter() - t0
            row[context] = _stats(eps) | {"episodes_per_s": len(eps) / elapsed}
        row["peak_ratio"] = row["full"]["peak_prompt_tokens"] / row["memory"]["peak_prompt_tokens"]
        row["mean_ratio"] = row["full"]["mean_prompt_tokens"] / row["memory"]["mean_prompt_tokens"]
        row["total_ratio"] = row["full"]["total_prompt_tokens"] / row["memory"]["total_prompt_tokens"]
        per_k[str(k)] = row
        print(f"k={k:>2}: {n} tasks, memory peak {row['memory']['peak_prompt_tokens']:.0f}, "
              f"full peak {row['full']['peak_prompt_tokens']:.0f}", file=sys.stderr)
    return per_k


def plot(per_k: dict[str, Any], out: Path) -> None:
    """Mean prompt tokens by turn, memory (solid) vs full history (dashed), one colour per k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (k, row) in enumerate(per_k.items()):
        c = colours[i % len(colours)]
        for context, style in (("memory", "-"), ("full", "--")):
            ys = row[context]["mean_prompt_tokens_by_turn"]
            ax.plot(range(1, len(ys) + 1), ys, style, color=c, label=f"{context} k={k}")
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt tokens (mean over tasks)")
    ax.set_yscale("log")
    ax.set_title("Prompt tokens by turn: MemPO memory context (solid) vs full history (dashed)")
    ax.legend(ncol=2, fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny world, 4 tasks per k")
    ap.add_argument("--world", help="a generated world folder (default: generate one: tiny with --quick, else small)")
    ap.add_argument("--tokenizer", help="HF tokenizer folder (default: SmolLM2 from the packaged GGUF)")
    ap.add_argument("--tasks", type=int, help="tasks per k (default 4 with --quick, else 20)")
    ap.add_argument("--topk", type=int, default=3, help="passages per search (params rollout.topk)")
    ap.add_argument("--obs-tokens", type=int, default=512, help="observation token budget (params rollout.observation_max_tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "context.json"))
    args = ap.parse_args(argv)

    n_tasks = args.tasks or (4 if args.quick else 20)
    tokenizer, tok_name = load_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        world = Path(args.world) if args.world else Path(tmp) / "world"
        size = "tiny" if args.quick else "small"
        if not args.world:
            from mempo.world import generate_world

            generate_world(world, size=size, seed=13)
        t0 = time.perf_counter()
        per_k = run(world, tokenizer, n_tasks, args.seed, args.topk, args.obs_tokens)
        elapsed = time.perf_counter() - t0

    out = Path(args.out)
    png = out.with_name("context_prompt_tokens.png")
    plot(per_k, png)
    ratio_k8 = per_k["8"]["peak_ratio"]
    mem_peaks = [per_k[str(k)]["memory"]["peak_prompt_tokens"] for k in KS]
    full_peaks = [per_k[str(k)]["full"]["peak_prompt_tokens"] for k in KS]
    result = {
        "benchmark": "context",
        "quick": args.quick,
        "world": args.world or f"generated {size} (seed 13)",
        "tokenizer": tok_name,
        "tasks_per_k": n_tasks,
        "topk": args.topk,
        "observation_max_tokens": args.obs_tokens,
        "baseline": "full-history context (Search-R1), same teacher trajectories, same run",
        "peak_prompt_ratio_k8": ratio_k8,
        "target_peak_prompt_ratio_k8": TARGET_PEAK_RATIO_K8,
        "passed": ratio_k8 >= TARGET_PEAK_RATIO_K8,
        "memory_peak_growth_k16_over_k1": mem_peaks[-1] / mem_peaks[0],
        "full_peak_growth_k16_over_k1": full_peaks[-1] / full_peaks[0],
        "teacher_accuracy": statistics.fmean(per_k[str(k)]["memory"]["accuracy"] for k in KS),
        "seconds": elapsed,
        "per_k": per_k,
        "plot": png.name,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    print(f"\ncontext benchmark ({tok_name} tokens; baseline = full history, ratio = full / memory)")
    print(f"{'k':>3} {'turns':>6} {'mem peak':>9} {'full peak':>10} {'peak x':>7} {'mem mean':>9} "
          f"{'full mean':>10} {'mean x':>7} {'acc':>5} {'ep/s':>7}")
    for k in KS:
        r = per_k[str(k)]
        print(f"{k:>3} {r['memory']['mean_turns']:>6.1f} {r['memory']['peak_prompt_tokens']:>9.0f} "
              f"{r['full']['peak_prompt_tokens']:>10.0f} {r['peak_ratio']:>7.2f} "
              f"{r['memory']['mean_prompt_tokens']:>9.0f} {r['full']['mean_prompt_tokens']:>10.0f} "
              f"{r['mean_ratio']:>7.2f} {r['memory']['accuracy']:>5.2f} {r['memory']['episodes_per_s']:>7.1f}")
    print(f"peak_prompt_ratio_k8 = {ratio_k8:.2f} (target >= {TARGET_PEAK_RATIO_K8}) "
          f"{'PASS' if result['passed'] else 'FAIL'}; memory peak k16/k1 = {result['memory_peak_growth_k16_over_k1']:.2f}, "
          f"full peak k16/k1 = {result['full_peak_growth_k16_over_k1']:.2f}")
    print(f"wrote {out} and {png}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
