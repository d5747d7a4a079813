"""The SFT step as `mempo.training.sft.token_loss` runs it vs the model's own forward,
measured in the same process on a finished pipeline's policy and teacher episodes.

`token_loss` drops a right-padded batch's attention mask (SDPA's causal kernel instead of an
explicit mask) and runs the LM head (hidden x vocabulary, its softmax and their gradients)
only at positions whose next token has a loss weight; `reference=True` is the model's own
forward: the mask, logits at every position. Both give the same loss and gradients
(tests/test_training_grpo.py). This benchmark times whole optimiser
steps (forward, backward, AdamW) both ways on the default run's batches, for the memory
format (`sft`) and the full-history format (`sft_full`, merged episodes), interleaved
call by call so a drift of the machine's speed hits both the same.

    .venv/bin/python benchmarks/sft_step.py --root <a finished make run> [--steps 40]
    .venv/bin/python benchmarks/sft_step.py --root <run> --ways fast reference compiled bfloat16

`--policy` times another model on the same samples (e.g. SmolLM2-135M from `mempo policy
bootstrap --kind smollm2`, whose chat template keeps the system prompt; `--batch-size` then
keeps its steps affordable), `--formats` one format only.

`--ways` adds what else one could try on the same batches, interleaved the same way:
`unshared` is `token_loss` with the samples' shared leading tokens (chat template, system
prompt) run per sample instead of once (`share_prefix=False`; the tiny policy's template
drops the system prompt, so there they share little);
`compiled` is `token_loss` with the decoder stack under `torch.compile(dynamic=True)` (its
compilation, on the first steps, is left out of the timings and reported apart); `bfloat16`
is `token_loss` on a bfloat16 copy of the policy (parameters, activations and AdamW state).

Writes benchmarks/results/sft_step.json: per format, the share of positions that get
logits, the median and best step (thread CPU seconds) each way, their ratio, and what the
ratio predicts for the default run's SFT stage at its step count.
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
# way -> (dtype of the policy copy, compile its decoder stack, token_loss(reference=...), share_prefix)
WAYS = {"fast": ("float32", False, False, True), "reference": ("float32", False, True, False),
        "compiled": ("float32", True, False, True), "bfloat16": ("bfloat16", False, False, True),
        "unshared": ("float32", False, False, False)}


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="a finished `make run` (its outputs/policy and outputs/teacher)")
    ap.add_argument("--steps", type=int, default=40, help="optimiser steps timed each way, per format")
    ap.add_argument("--quick", action="store_true", help="8 steps each way")
    ap.add_argument("--ways", nargs="+", default=["fast", "reference"], choices=list(WAYS),
                    help="step implementations timed (fast and reference always)")
    ap.add_argument("--policy", default="outputs/policy", help="model folder, relative to --root")
    ap.add_argument("--batch-size", type=int, default=None, help="turns per step (default: sft.batch_size)")
    ap.add_argument("--formats", nargs="+", default=["memory", "full"], choices=["memory", "full"])
    ap.add_argument("--out", default=str(RESULTS / "sft_step.json"))
    a = ap.parse_args(argv)
    if a.quick:
        a.steps = 8
    a.ways = ["fast", "reference"] + [w for w in a.ways if w not in ("fast", "reference")]
    return a


def format_batches(root: Path, context: str, steps: int, policy: str = "outputs/policy",
                   batch_size: int | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The first `steps` batches of the SFT stage of `context` (memory | full), built as
    `run_sft` builds them (dvc.yaml's sft / sft_full settings; `batch_size` turns per step
    instead of sft.batch_size), tokenised for `policy`, with the stage's facts."""
    from mempo.config import load_params
    from mempo.training.runtime import load_tokenizer
    from mempo.training.sft import (
        collate,
        length_bucketed_batches,
        merge_prefix_turns,
        tokenize_samples,
    )
    from mempo.training.sft_data import load_sft_samples

    p = load_params(REPO / "params.yaml", {"rollout.context": context}).sft
    max_tokens = 4096 if context == "full" else p.max_tokens  # dvc.yaml's sft_full sets 4096
    tok = load_tokenizer(root / policy)
    samples = load_sft_samples(root / "outputs" / "teacher" / "train_episodes.jsonl", context)
    turns = tokenize_samples(samples, tok, max_tokens, prompt_lm=p.prompt_loss_weight > 0)
    merged = merge_prefix_turns(turns, max_tokens)
    batch_size = max(1, round((batch_size or p.batch_size) * len(merged) / len(turns)))
    order = length_bucketed_batches([len(s.input_ids) for s in merged], batch_size, p.seed, 0)[:steps]
    batches = [collate([merged[i] for i in idx], tok.pad_token_id, p.prompt_loss_weight) for idx in order]
    positions = sum(int(b["attention_mask"].sum()) for b in batches)
    with_loss = sum(int((b["loss_weights"][:, 1:] != 0).sum()) for b in batches)
    from mempo.training.forward import shared_prefix_length

    shared = sum(shared_prefix_length(b["input_ids"], b["attention_mask"]) * (len(b["input_ids"]) - 1)
                 for b in batches)
    facts = {"samples": len(merged), "turns": len(turns), "batch_size": batch_size,
             "steps_per_epoch": -(-len(merged) // batch_size), "epochs": p.epochs,
             "prompt_loss_weight": p.prompt_loss_weight, "share_of_tokens_with_logits": with_loss / positions,
             "share_of_tokens_shared": shared / positions}  # positions a shared prefix saves
    return batches, facts


def time_steps(root: Path, batches: list[dict[str, Any]], ways: list[str],
               policy: str = "outputs/policy") -> tuple[dict[str, list[float]], dict[str, float]]:
    """Thread CPU seconds of one optimiser step per batch for each of `ways` (`WAYS`), the
    order of the ways rotated from batch to batch. Each way has its own copy of the policy
    and AdamW state. Also returns, per compiled way, the CPU seconds of its first step."""
    import torch

    from mempo.training.runtime import load_policy
    from mempo.training.sft import token_loss

    torch.manual_seed(0)
    models, first_step = {}, {}
    for way in ways:
        dtype, compiled, _, _ = WAYS[way]
        model = load_policy(root / policy, "cpu", dtype)[0]
        if compiled:
            model.model = torch.compile(model.model, dynamic=True)
        models[way] = model
    opts = {way: torch.optim.AdamW(m.parameters(), lr=1e-4) for way, m in models.items()}
    out: dict[str, list[float]] = {way: [] for way in ways}
    for i, batch in enumerate(batches):
        for way in ways[i % len(ways):] + ways[:i % len(ways)]:
            model, opt = models[way], opts[way]
            t0 = time.thread_time()
            loss, n = token_loss(model, batch, "cpu", reference=WAYS[way][2], share_prefix=WAYS[way][3])
            (loss / max(n, 1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out[way].append(time.thread_time() - t0)
            if i == 0 and WAYS[way][1]:
                first_step[way] = out[way][-1]
    return out, first_step


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(1)  # as the SFT stages run (sft.threads: 1)
    root = Path(a.root).resolve()
    stage_metrics = {"memory": root / "outputs" / "sft" / "metrics.json",
                     "full": root / "outputs" / "sft_full" / "metrics.json"}
    out: dict[str, Any] = {"benchmark": "sft_step", "steps_each_way": a.steps, "threads": 1, "ways": a.ways,
                           "policy": Path(a.policy).name, "formats": {}}
    for context in a.formats:
        batches, facts = format_batches(root, context, a.steps + 2, a.policy, a.batch_size)
        t, first_step = time_steps(root, batches, a.ways, a.policy)
        t = {way: v[2:] for way, v in t.items()}  # the first two steps warm allocators, caches, compilers
        med = {way: statistics.median(v) for way, v in t.items()}
        best = {way: min(v) for way, v in t.items()}
        row = {**facts, "median_step_s": med, "best_step_s": best,
               "speedup_median": med["reference"] / med["fast"], "speedup_best": best["reference"] / best["fast"]}
        if len(a.ways) > 2:  # > 1: faster than token_loss as the SFT stage runs it
            row["vs_fast_median"] = {w: med["fast"] / med[w] for w in a.ways if w != "fast"}
            row["first_step_s"] = first_step
        if stage_metrics[context].exists() and a.policy == "outputs/policy":
            m = json.loads(stage_metrics[context].read_text())
            row["default_run_stage"] = {"steps": m["steps"], "train_seconds": m["train_seconds"],
                                        "predicted_seconds": m["train_seconds"] / row["speedup_median"]}
        out["formats"][context] = row
        print(f"{context}: {facts['share_of_tokens_with_logits']:.0%} of tokens get logits; step "
              f"{med['reference'] * 1e3:.0f} -> {med['fast'] * 1e3:.0f} ms (median), {row['speedup_median']:.2f}x"
              + "".join(f"; {w} {x:.2f}x of fast" for w, x in row.get("vs_fast_median", {}).items()), flush=True)
    from mempo.io import write_json

    write_json(Path(a.out), out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
