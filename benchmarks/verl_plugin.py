"""Cost of MemPO's additions on the verl path, each against verl's own step measured in the same run.

1. Advantage step: `mempo.verl_plugin.trainer.mempo_advantage_step` (episode GRPO + A^M on
   `<mem>` tokens) vs verl 0.9.1's `compute_advantage_for_multi_trajectories` (GRPO for
   multi-output agent loops) on the same synthetic batch of turn rows
   (prompts x rollouts x turns rows, `--width` response tokens).
2. Per-turn bookkeeping in `mem_agent` (stop cut, turn parse, `<mem>` token mask and its
   check) vs the decode of the response that any agent loop pays, on the tiny tokenizer.

    .venv/bin/python benchmarks/verl_plugin.py --quick     # 64 prompts, 200 turns
    .venv/bin/python benchmarks/verl_plugin.py             # 256 prompts x 5 x 4 turns, 2000 turns

Writes benchmarks/results/verl_plugin.json and prints a table of times and ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _batch(prompts: int, rollouts: int, max_turns: int, width: int, seed: int = 0):
    import numpy as np
    import torch

    rng = random.Random(seed)
    keys, uids, extra, lengths = [], [], [], []
    for p in range(prompts):
        for s in range(rollouts):
            for t in range(rng.randint(1, max_turns)):
                n = rng.randint(width // 4, width)
                a = rng.randint(0, n // 2)
                keys.append(f"uid{p}_{s}_{t}")
                uids.append(f"uid{p}")
                lengths.append(n)
                extra.append({"mem_mask": [1 if a <= j < a + n // 3 else 0 for j in range(n)], "turn_index": t,
                              "mem_prob": rng.random(), "mem_logprob": -rng.random()})
    b = len(keys)
    rewards = torch.zeros(b, width)
    resp = torch.zeros(b, width, dtype=torch.long)
    score = {}
    for r, key in enumerate(keys):
        ep = key.rsplit("_", 1)[0]
        score.setdefault(ep, float(rng.random() < 0.5))
        resp[r, :lengths[r]] = 1
        rewards[r, lengths[r] - 1] = score[ep]
    return keys, np.array(uids, dtype=object), rewards, resp, extra


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_advantage(prompts: int, rollouts: int, max_turns: int, width: int, repeats: int) -> dict:
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    from mempo.verl_plugin.advantage import MempoAdvantageConfig
    from mempo.verl_plugin.trainer import mempo_advantage_step

    keys, uids, rewards, resp, extra = _batch(prompts, rollouts, max_turns, width)

    def data():
        return DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(), "response_mask": resp.clone()},
                                   non_tensors={"uid": uids.copy()})

    verl_s = _time(lambda: compute_advantage_for_multi_trajectories(
        data(), batch_keys=keys, adv_estimator=AdvantageEstimator.GRPO, num_repeat=rollouts), repeats)
    mempo_s = _time(lambda: mempo_advantage_step(data(), keys, extra, MempoAdvantageConfig()), repeats)
    return {"rows": len(keys), "width": width, "verl_grpo_s": round(verl_s, 4), "mempo_step_s": round(mempo_s, 4),
            "mempo_over_verl": round(mempo_s / verl_s, 2)}


def bench_turn_bookkeeping(turns: int, tokenizer_dir: Path) -> dict:
    from transformers import AutoTokenizer

    from mempo.agent.format import STOP_SEQUENCES
    from mempo.agent.generation import cut_at_stop
    from mempo.agent.step import digest_turn

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(1)
    words = "Gristead mayor born river company founded capital Thys Vaelthouristan Ploria".split()
    texts = []
    for _ in range(turns):
        mem = " ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
        think = " ".join(rng.choice(words) for _ in range(rng.randint(10, 40)))
        texts.append(f"<mem> {mem} </mem> <think> {think} </think> <search> {rng.choice(words)} </search> junk")
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]

    def decode_only():
        for i in ids:
            tok.decode(i, skip_special_tokens=True)

    def bookkeeping():
        for i in ids:
            kept, _, _ = cut_at_stop(i, tok, STOP_SEQUENCES)
            digest_turn(kept, tok)  # what both drivers run per turn: decode, parse, mask + check

    base = _time(decode_only, 3)
    ours = _time(bookkeeping, 3)
    mean_tokens = statistics.mean(len(i) for i in ids)
    return {"turns": turns, "mean_response_tokens": round(mean_tokens, 1),
            "decode_ms_per_turn": round(1000 * base / turns, 3),
            "mem_agent_ms_per_turn": round(1000 * ours / turns, 3),
            "mem_agent_over_decode": round(ours / base, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small batch (64 prompts) and 200 turns")
    ap.add_argument("--width", type=int, default=512, help="response tokens per row")
    args = ap.parse_args(argv)
    prompts, turns, repeats = (64, 200, 3) if args.quick else (256, 2000, 5)

    from mempo.policy.tiny import TinyPolicySpec, bootstrap_tiny
    from mempo.world import generate_world

    adv = bench_advantage(prompts, rollouts=5, max_turns=8, width=args.width, repeats=repeats)
    with tempfile.TemporaryDirectory() as tmp:
        world = Path(tmp) / "world"
        generate_world(world, size="tiny", seed=13)
        bootstrap_tiny(Path(tmp) / "policy", world / "corpus.jsonl", [world / "qa" / "train.jsonl"],
                       spec=TinyPolicySpec(copy_steps=0))
        turn = bench_turn_bookkeeping(turns, Path(tmp) / "policy")

    result = {"advantage": adv, "turn_bookkeeping": turn, "quick": args.quick}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "verl_plugin.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'measurement':<44}{'baseline':>12}{'mempo':>12}{'ratio':>8}")
    print(f"{'advantage step, ' + str(adv['rows']) + ' rows x ' + str(adv['width']) + ' (s)':<44}"
          f"{adv['verl_grpo_s']:>12}{adv['mempo_step_s']:>12}{adv['mempo_over_verl']:>8}")
    print(f"{'per turn, ' + str(turn['mean_response_tokens']) + ' tokens (ms)':<44}"
          f"{turn['decode_ms_per_turn']:>12}{turn['mem_agent_ms_per_turn']:>12}{turn['mem_agent_over_decode']:>8}")
    print("baseline: verl GRPO multi-trajectory / one tokenizer.decode per turn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
