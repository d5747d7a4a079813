"""Does MemPO's memory advantage help? The paired learning study on the knowledge world.

    .venv/bin/python benchmarks/learning.py --quick     # 2 seeds, small budgets (<= 15 min on 2 cores)
    .venv/bin/python benchmarks/learning.py             # the protocol: 5 seeds (<= 2 h on 2 cores)
    .venv/bin/python benchmarks/learning.py --seeds 0 1 2 3 4 5 6 --rl-steps 120
    .venv/bin/python benchmarks/learning.py --from-pipeline .   # RL from `make run`'s SFT checkpoints
    .venv/bin/python benchmarks/learning.py --start benchmarks/starts/c9cbcc85 --seeds 4 5
        # RL from a committed SFT start (--save-start): the same weights on any machine

Variants (every one trained from this repository's params.yaml, only the keys below changed):

    untrained   the bootstrapped tiny policy (copy warm-up only), memory agent
    sft         the memory-format SFT cold start (teacher episodes k = 1..4), memory agent
    sft_full    the same teacher episodes rendered with the whole history, full-context agent
    grpo        sft + GRPO without the memory advantage (lambda_mem 0, MEM1 style)
    mempo       sft + GRPO + A^M with the method's reward (eps full_context, form logprob)
    mempo_prev  ablation: sft + GRPO + A^M with eps previous, form prob
    mempo_skip  mempo with final_memory skip: each episode's last memory gets no A^M
    mempo_half  mempo with lambda_mem 0.5: A^M at half weight on the <mem> tokens
    mempo_retain  mempo_half with rm_max 0: R^M = min(0, the method's reward), a retention penalty
    mempo_half_skip  mempo_half with final_memory skip (the closing memory gets no A^M)
    mempo_half_closing  mempo_half with final_memory closing (closing memories normalised among closes)
    full        sft_full + GRPO in the full-history format (Search-R1 style)

Protocol: the small world's entity-disjoint splits. The scripted teacher solves train
questions of part `sft` (and k = 2..4 compositions of them) once; both SFT policies learn
from those same episodes, for the same number of steps. RL runs on the data stage's mixture
(part `rl` singles + k = 2 compositions; `--rl-mix` another, e.g. with k = 4 tasks; `--rl-set`
changes a params key for every RL variant, e.g. the multi-objective reward rule), every RL
variant with the same budget (steps, B x n rollouts, LR, max tokens) from the same SFT
checkpoint of its format, and seeds paired: seed s of every variant sees the same task order.
Evaluation is `mempo eval`'s own code
(`mempo.evaluation.agent_runner.evaluate_items`), greedy (a prompt an episode has seen before
sampled at `eval.rollout.repeat_temperature`, docs/evaluation.md), on the held-out test
split: the same singles, world-k2 and world-k4 tasks for every variant (the untrained
policy, which rambles to the turn cap, on the first `--untrained-n` of each).

Reported per variant and k: EM, objective EM, forgetting rate, format validity, peak and
mean prompt tokens per turn, how the episodes ended (`mempo.evaluation.outcomes`); the paired
MemPO - GRPO difference per k with a bootstrap 95% interval (tasks and seeds resampled); RL
reward curves (mean over seeds, with a trailing mean) and EM against k as PNGs; whether each
variant's reward has flattened (`reward_trend`: per seed, the least-squares slope of the reward
in the first and second half of the steps, per 100 steps, pooled over seeds with an interval;
`rising`, `flat` within +-0.02, or `undecided`). Writes benchmarks/results/learning.json,
learning_curves.png, learning_em_vs_k.png (and learning_curves_per_k.png: rollout EM on the
singles and the k=2 tasks while RL trains), and beside `--out` its per-task values
(`learning.per_task.jsonl.gz`), which `benchmarks/learning_pool.py` reads to pool studies run on
other seeds. `config.start` records the sha256 of the SFT checkpoints' weights RL started from
(`mempo.io.weights_sha256`): pooling refuses studies of different starts.
Jobs run in `--jobs` single-threaded processes; a finished job's result is kept in
`--workdir`, so a killed study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PARAMS = REPO / "params.yaml"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# RL variants: (start policy format, params overrides on top of params.yaml).
_MEMPO = {"mempo.lambda_mem": 1.0, "mempo.eps": "full_context", "mempo.form": "logprob"}  # the method's reward
_HALF = {**_MEMPO, "mempo.lambda_mem": 0.5, "mempo.final_memory": "score"}  # mempo_half; the variants below it
RL_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "grpo": ("memory", {"mempo.lambda_mem": 0.0}),
    "mempo": ("memory", {**_MEMPO, "mempo.final_memory": "score"}),
    "mempo_skip": ("memory", {**_MEMPO, "mempo.final_memory": "skip"}),
    "mempo_half": ("memory", _HALF),
    "mempo_retain": ("memory", {**_HALF, "mempo.rm_max": 0.0}),
    "mempo_half_skip": ("memory", {**_HALF, "mempo.final_memory": "skip"}),
    "mempo_half_closing": ("memory", {**_HALF, "mempo.final_memory": "closing"}),
    "mempo_prev": ("memory", {"mempo.lambda_mem": 1.0, "mempo.eps": "previous", "mempo.form": "prob"}),
    "full": ("full", {"mempo.lambda_mem": 0.0, "rollout.context": "full"}),
}
DEFAULT_VARIANTS = ["grpo", "mempo", "mempo_prev", "full"]  # mempo_skip, mempo_half, mempo_retain: by --variants
AGENT_OF_FORMAT = {"memory": "memory", "full": "full_context"}
BENCHES = ("single", "k2", "k4")
REPORTED = ("em", "objective_em", "all_correct", "forgetting_rate", "format_valid", "peak_prompt_tokens",
            "mean_prompt_tokens", "turns")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 seeds, short budgets, fewer test tasks")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--full-seeds", type=int, nargs="+", default=None,
                    help="seeds of the full-history RL variant (default: --seeds); its RL steps cost ~2x")
    ap.add_argument("--variants", nargs="+", default=None, choices=list(RL_VARIANTS),
                    help="RL variants (default: all)")
    ap.add_argument("--sft-steps", type=int, default=None,
                    help="SFT optimiser steps (each format, batch 16; default: one epoch, as params.yaml)")
    ap.add_argument("--rl-steps", type=int, default=None, help="RL steps of every RL variant")
    ap.add_argument("--batch-questions", type=int, default=None)
    ap.add_argument("--n-rollouts", type=int, default=4)
    ap.add_argument("--eval-single", type=int, default=None)
    ap.add_argument("--eval-k2", type=int, default=None)
    ap.add_argument("--eval-k4", type=int, default=None)
    ap.add_argument("--untrained-n", type=int, default=None, help="tasks per set for the untrained policy")
    ap.add_argument("--jobs", type=int, default=2, help="parallel single-threaded processes")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the intervals")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--from-pipeline", default=None, metavar="ROOT",
                    help="start from a finished `make run` in ROOT (its world, RL data, policy and both SFT "
                         "checkpoints, trained from the same params.yaml) instead of building and training them "
                         "here; the SFT policies are then only evaluated")
    ap.add_argument("--start", default=None, metavar="DIR",
                    help="start RL from a saved SFT start (--save-start; e.g. benchmarks/starts/<sha>) instead of "
                         "training SFT here: the same weights on any machine, so seeds run elsewhere pool")
    ap.add_argument("--save-start", default=None, metavar="DIR",
                    help="after the study, save its SFT checkpoints (with their hashes and the world's) to DIR")
    ap.add_argument("--rl-mix", nargs="+", default=None, metavar="K:SHARE", type=_composition,
                    help="RL on this mixture instead of params.yaml's data.compositions (singles + k=2), e.g. "
                         "1:1 2:0.5 4:1 (k=4 tasks too); its own data and workdir (<workdir>/...-mix-<tag>)")
    ap.add_argument("--rl-set", nargs="+", default=None, metavar="KEY=VALUE", type=_override,
                    help="params overrides for every RL variant, e.g. mempo.multi_rule=mean (partial credit on "
                         "multi-objective tasks); not the keys the variants or the study set; own workdir")
    ap.add_argument("--sft-set", nargs="+", default=None, metavar="KEY=VALUE", type=_override,
                    help="sft.* params overrides for the teacher episodes and the SFT start trained here, e.g. "
                         "sft.memory_layout=queue; own workdir (not with --start or --from-pipeline)")
    ap.add_argument("--workdir", default=str(REPO / "outputs" / "bench-learning"))
    ap.add_argument("--out", default=str(RESULTS / "learning.json"))
    a = ap.parse_args(argv)
    if a.from_pipeline and a.start:
        ap.error("--from-pipeline and --start both name the SFT start: give one")
    q = a.quick
    a.seeds = a.seeds or ([0, 1] if q else [0, 1, 2, 3, 4])
    a.full_seeds = a.full_seeds or a.seeds
    a.variants = a.variants or DEFAULT_VARIANTS
    a.sft_steps = a.sft_steps if a.sft_steps is not None else (300 if q else 0)
    a.rl_steps = a.rl_steps or (8 if q else 40)
    a.batch_questions = a.batch_questions or (4 if q else 8)
    a.eval_single = a.eval_single or (60 if q else 500)
    a.eval_k2 = a.eval_k2 or (30 if q else 200)
    a.eval_k4 = a.eval_k4 or (15 if q else 100)
    a.untrained_n = a.untrained_n or (10 if q else 50)
    a.workdir = Path(a.workdir) / ("pipeline" if a.from_pipeline else f"start-{Path(a.start).resolve().name}"
                                   if a.start else "quick" if q else "full")
    if a.rl_mix:
        if [c["k"] for c in a.rl_mix] != sorted({c["k"] for c in a.rl_mix}):
            ap.error("--rl-mix: give each k once, in increasing order (e.g. 1:1 2:0.5 4:1)")
        a.workdir = a.workdir.with_name(f"{a.workdir.name}-mix-{mix_tag(a.rl_mix)}")
    if a.rl_set:
        a.rl_set = dict(a.rl_set)
        taken = sorted(k for k in a.rl_set if k.startswith("train.") or any(k in o for _, o in RL_VARIANTS.values()))
        if taken:
            ap.error(f"--rl-set: {', '.join(taken)}: set by the study or its variants, not overridable")
        _check_set(ap, "--rl-set", a.rl_set)
        a.workdir = a.workdir.with_name(f"{a.workdir.name}-set-" + "-".join(f"{k}={v}" for k, v in a.rl_set.items()))
    if a.sft_set:
        if a.start or a.from_pipeline:
            ap.error("--sft-set changes the SFT start trained here: not with --start or --from-pipeline")
        a.sft_set = dict(a.sft_set)
        wrong = sorted(k for k in a.sft_set if not k.startswith("sft.") or k.removeprefix("sft.") in SFT_SET_BY_STUDY)
        if wrong:
            ap.error(f"--sft-set: {', '.join(wrong)}: only sft.* keys the study does not set itself")
        _check_set(ap, "--sft-set", a.sft_set)
        a.workdir = a.workdir.with_name(f"{a.workdir.name}-sft-" + "-".join(f"{k}={v}" for k, v in a.sft_set.items()))
    return a


def _check_set(ap: argparse.ArgumentParser, flag: str, overrides: dict[str, Any]) -> None:
    """Stop with `flag`'s name when `overrides` do not give valid params."""
    from mempo.errors import MempoError

    try:
        _params(overrides)
    except MempoError as e:
        ap.error(f"{flag}: {e}")


# sft.* keys the study sets itself (paths, the step budget, resumption, device).
SFT_SET_BY_STUDY = ("policy", "out", "world", "retriever", "trajectories", "val_trajectories", "teacher_out",
                    "max_steps", "resume", "device", "max_tokens")


def _override(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` (`--rl-set`), read as `mempo --set` reads it (the value as YAML)."""
    from mempo.config.loading import parse_override
    from mempo.errors import ConfigError

    try:
        return parse_override(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. mempo.multi_rule=mean): {e}") from None


def _composition(text: str) -> dict[str, Any]:
    """`K:SHARE` (`--rl-mix`) as a data.compositions entry."""
    try:
        k, share = text.split(":")
        comp = {"k": int(k), "share": float(share)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K:SHARE (e.g. 4:0.5)") from None
    if comp["k"] < 1 or not 0 < comp["share"] <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: k must be >= 1 and the share in (0, 1]")
    return comp


def mix_tag(mix: Sequence[dict[str, Any]]) -> str:
    return "-".join(f"{c['k']}x{c['share']:g}" for c in mix)


# ---------------------------------------------------------------------------- shared inputs


def _params(overrides: dict[str, Any]) -> Any:
    from mempo.config import load_params

    return load_params(PARAMS, overrides)


def pipeline_inputs(root: Path, formats: Sequence[str] = tuple(AGENT_OF_FORMAT)) -> dict[str, Path]:
    """The inputs of a finished `make run` in `root`, at the paths params.yaml gives them; of the
    SFT checkpoints, those of `formats` (a study of memory-format variants only needs no
    full-history checkpoint, so it can start while that SFT stage still runs)."""
    p = _params({})
    world = root / p.sft.world
    sft = {"memory": root / p.sft.out / "model", "full": root / "outputs" / "sft_full" / "model"}  # dvc.yaml's
    inputs = {"world": world, "corpus": world / "corpus.jsonl", "data": root / p.data.out,
              "policy": root / p.policy.out, **{f"sft-{fmt}": sft[fmt] for fmt in formats}}
    # the SFT stages' metrics, read by the SFT jobs at the end: checked here, not an hour in
    inputs |= {f"sft-{fmt}-metrics": sft[fmt].parent / "metrics.json" for fmt in formats}
    missing = [f"{k}: {v}" for k, v in inputs.items() if not v.exists()]
    if missing:
        raise SystemExit(f"--from-pipeline {root}: missing (run `make run` there first): " + "; ".join(missing))
    return inputs


def prepare_inputs(a: argparse.Namespace) -> dict[str, Path]:
    """World, RL data (the data stage's mixture), bootstrapped policy and the teacher's SFT
    episodes, each built once into the workdir (kept across runs); or a finished pipeline's
    (`--from-pipeline`). With `--start` the SFT checkpoints are a saved start's (checked against
    their recorded hashes and this world), and no teacher episodes are needed."""
    if a.from_pipeline:
        return pipeline_inputs(Path(a.from_pipeline).resolve(), start_formats(a))
    from mempo.data.prepare import prepare_data
    from mempo.policy.bootstrap import bootstrap_policy
    from mempo.world import generate_world

    w = Path(a.workdir)
    world, data, policy, teach = w / "world", w / "data", w / "policy", w / "teacher"
    p0 = _params({})
    if not (world / "manifest.json").exists():
        generate_world(world, size=p0.world.size, seed=p0.world.seed)
    corpus = world / "corpus.jsonl"
    if not (data / "sft.parquet").exists():  # the RL split and the SFT teacher's tasks
        pd = _params(data_overrides(a, world, data))
        prepare_data(pd.data, sft=pd.sft)
    if not (policy / "config.json").exists():
        bootstrap_policy(_params({"policy.out": str(policy), "policy.corpus": str(corpus),
                                  "policy.questions": [str(world / "qa" / "train.jsonl")]}).policy)
    common = {"world": world, "corpus": corpus, "data": data, "policy": policy}
    if a.start:
        return common | start_inputs(a, world)
    if not (teach / "train_episodes.jsonl").exists():
        _teacher_episodes(teacher_params(a, world, data, corpus, policy, teach))
    return common | {"teacher": teach,
                     **{f"sft-{fmt}": w / f"sft-{fmt}" / "model" for fmt in AGENT_OF_FORMAT}}  # trained by job_sft


def data_overrides(a: argparse.Namespace, world: Path, data: Path) -> dict[str, Any]:
    """The data stage's params for the study: `world`'s train and val questions into `data`, the
    test questions held out, RL on params.yaml's mixture or `--rl-mix`'s."""
    return {"data.sources": [{"name": "world", "path": str(world / "qa" / "train.jsonl"), "split": "train"},
                             {"name": "world", "path": str(world / "qa" / "val.jsonl"), "split": "val"}],
            "data.eval_sets": [str(world / "qa" / "test.jsonl")], "data.out": str(data), "data.gate": False,
            "sft.world": str(world), **({"data.compositions": a.rl_mix} if a.rl_mix else {}), **(a.sft_set or {})}


def start_inputs(a: argparse.Namespace, world: Path) -> dict[str, Path]:
    """`--start`: the saved start's checkpoints and SFT metrics of the formats the study needs,
    checked against their recorded hashes and `world`; a mismatch stops the study, named."""
    from mempo.errors import DataError
    from mempo.training.starts import load_start

    try:
        start = load_start(a.start, start_formats(a), world)
    except DataError as e:
        raise SystemExit(f"--start: {e.one_line()}") from e
    return {f"sft-{fmt}{sfx}": s[key] for fmt, s in start.items() for sfx, key in (("", "model"),
                                                                                    ("-metrics", "metrics"))}


def teacher_params(a: argparse.Namespace, world: Path, data: Path, corpus: Path, policy: Path, out: Path) -> Any:
    """The teacher stage's params: params.yaml, `--sft-set`, the study's paths."""
    return _params({**(a.sft_set or {}), "sft.world": str(world), "data.out": str(data), "sft.policy": str(policy),
                    "sft.retriever": str(corpus), "sft.teacher_out": str(out)})


def _teacher_episodes(params: Any) -> None:
    from mempo.training.sft_data import run_teacher

    stats = run_teacher(params, tracking=False)
    print(f"teacher: {stats['data_correct']:.0f}/{stats['data_episodes']:.0f} episodes correct", flush=True)


def test_tasks(world: Path, a: argparse.Namespace) -> dict[str, list[Any]]:
    """The held-out test sets every variant is evaluated on (the eval stage's composition)."""
    from mempo.evaluation.benchmarks import load_benchmark

    paths = {"world": str(world / "qa" / "test.jsonl")}
    seed = _params({}).eval.seed
    return {"single": load_benchmark("world", paths, limit=a.eval_single, seed=seed),
            "k2": load_benchmark("world-k2", paths, limit=a.eval_k2, seed=seed),
            "k4": load_benchmark("world-k4", paths, limit=a.eval_k4, seed=seed)}


# ---------------------------------------------------------------------------- jobs (subprocesses)


def _quiet() -> None:
    import torch

    torch.set_num_threads(1)
    os.environ["MEMPO_TRACKING"] = "0"  # the benchmark measures; the pipeline tracks
    logging.basicConfig(level=logging.WARNING)
    for name in ("mempo", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)


def evaluate_rows(model_dir: Path, agent: str, tasks: dict[str, list[Any]], corpus: Path,
                  device: str) -> list[dict[str, Any]]:
    """Evaluation through `mempo eval`'s code, with its decoding settings: its sample rows
    (`mempo.evaluation.metrics.SAMPLE_COLUMNS`, transcripts included)."""
    from mempo.evaluation.agent_runner import evaluate_items
    from mempo.evaluation.engine import load_engine
    from mempo.evaluation.settings import EvalSettings

    p = _params({"eval.memory_probe": False, "eval.rollout.max_concurrent_episodes": 64, "eval.device": device})
    settings = EvalSettings.from_params(p.eval)
    engine = load_engine(model_dir, model_dir, device=device, retriever=str(corpus), concurrency=64,
                         load_model_for_probe=False, prefix_cache_mb=p.eval.rollout_params().prefix_cache_mb)
    try:
        return evaluate_items(tasks, [agent], engine, settings)
    finally:
        engine.retriever.close()


def evaluate_model(model_dir: Path, agent: str, tasks: dict[str, list[Any]], corpus: Path,
                   device: str) -> dict[str, Any]:
    """`evaluate_rows`, summarised: per set, aggregates and per-task values."""
    from mempo.evaluation.metrics import aggregate_pair
    from mempo.evaluation.outcomes import outcome_shares

    rows = evaluate_rows(model_dir, agent, tasks, corpus, device)
    out: dict[str, Any] = {}
    for bench in tasks:
        part = [r for r in rows if r["benchmark"] == bench]
        agg = aggregate_pair(part)
        agg["mean_prompt_tokens"] = statistics.fmean(
            n for r in part for n in r["prompt_tokens_by_turn"]) if part else 0.0
        agg["outcomes"] = outcome_shares(part)
        per_task = {r["id"]: {m: (None if _nan(r.get(m)) else float(r[m]))
                              for m in ("em", "objective_em", "forgetting_rate")} for r in part}
        out[bench] = {"aggregate": agg, "per_task": per_task}
    return out


def _nan(x: Any) -> bool:
    return x is None or (isinstance(x, float) and x != x)


def job_sft(context: str, a: argparse.Namespace, inputs: dict[str, Path]) -> dict[str, Any]:
    """SFT of one format from the shared teacher episodes (with `--from-pipeline` or `--start`:
    that checkpoint, not retrained); then evaluated."""
    _quiet()
    from mempo.training.sft import run_sft

    model = inputs[f"sft-{context}"]
    t0 = time.perf_counter()
    if a.from_pipeline or a.start:
        m, train_s = json.loads(inputs[f"sft-{context}-metrics"].read_text()), None
    else:
        m = run_sft(sft_params(context, a, inputs), tracking=False)
        train_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    ev = evaluate_model(model, AGENT_OF_FORMAT[context], test_tasks(inputs["world"], a), inputs["corpus"], a.device)
    from mempo.io import weights_sha256

    return {"train_seconds": train_s, "sft": {k: m[k] for k in ("steps", "train_samples", "final_val_loss",
                                                                  "tokens_per_s")},
            "from": str(model), "weights_sha256": weights_sha256(model), "eval": ev,
            "eval_seconds": time.perf_counter() - t1}


def sft_params(context: str, a: argparse.Namespace, inputs: dict[str, Path]) -> Any:
    """The params of one format's SFT job: params.yaml, `--sft-set`, the study's paths and budget."""
    return _params({
        **(a.sft_set or {}), "rollout.context": context, "sft.policy": str(inputs["policy"]),
        "sft.out": str(inputs[f"sft-{context}"].parent),
        "sft.trajectories": str(inputs["teacher"] / "train_episodes.jsonl"),
        "sft.val_trajectories": str(inputs["teacher"] / "val_episodes.jsonl"),
        "sft.max_steps": a.sft_steps, "sft.resume": "auto", "sft.device": a.device,
        "sft.max_tokens": 4096 if context == "full" else _params({}).sft.max_tokens})


def rl_params(variant: str, seed: int, a: argparse.Namespace, inputs: dict[str, Path]) -> Any:
    """The params of one RL job: params.yaml, `--rl-set`, the variant's keys, the study's budget."""
    fmt, over = RL_VARIANTS[variant]
    # Memory scoring only where the method uses it (the lambda_mem = 0 variants skip its cost).
    over = {**(a.rl_set or {}), **over, "train.log_memory_reward": over["mempo.lambda_mem"] != 0}
    return _params({
        **over, "train.policy": str(inputs[f"sft-{fmt}"]), "train.out": str(Path(a.workdir) / f"rl-{variant}-seed{seed}"),
        "train.data": str(inputs["data"]), "train.retriever": str(inputs["corpus"]), "train.seed": seed,
        "train.steps": a.rl_steps, "train.batch_questions": a.batch_questions, "train.n_rollouts": a.n_rollouts,
        "train.resume": "auto", "train.checkpoint_every": 10, "train.device": a.device})


def job_rl(variant: str, seed: int, a: argparse.Namespace, inputs: dict[str, Path]) -> dict[str, Any]:
    """One RL variant for one seed, from its format's SFT checkpoint; then evaluated."""
    _quiet()
    from mempo.training.grpo import run_grpo

    params = rl_params(variant, seed, a, inputs)
    out = Path(params.train.out)
    t0 = time.perf_counter()
    m = run_grpo(params, tracking=False)
    train_s = time.perf_counter() - t0
    ev = evaluate_model(out / "model", AGENT_OF_FORMAT[RL_VARIANTS[variant][0]], test_tasks(inputs["world"], a), inputs["corpus"],
                        a.device)
    return {"train_seconds": train_s, "eval_seconds": time.perf_counter() - t0 - train_s,
            "mean_time_step": m["mean_time_step"], "mem_scoring_share": m["mem_scoring_share"],
            "curve": curve_rows(out), "eval": ev}


CURVE_KEYS = ("reward_mean", "em", "format_valid", "kl", "forgetting_rate")  # averaged over seeds per step
PER_K = ("em_k1", "em_k2", "em_k4", "format_valid_k2", "format_valid_k4")  # where the RL mixture has that k


def curve_rows(rl_out: Path) -> list[dict[str, Any]]:
    """An RL run's training curve (its history.jsonl): per step the values the study reports,
    the per-k ones only for the k its mixture has."""
    keys = ("step", *CURVE_KEYS, "groups_with_signal", "time_step")
    return [{**{k: r.get(k) for k in keys}, **{k: r[k] for k in PER_K if k in r}}
            for r in map(json.loads, (rl_out / "history.jsonl").read_text().splitlines())]


def job_untrained(a: argparse.Namespace, inputs: dict[str, Path]) -> dict[str, Any]:
    _quiet()
    tasks = {b: v[:a.untrained_n] for b, v in test_tasks(inputs["world"], a).items()}
    t0 = time.perf_counter()
    return {"eval": evaluate_model(inputs["policy"], "memory", tasks, inputs["corpus"], a.device),
            "eval_seconds": time.perf_counter() - t0}


def start_formats(a: argparse.Namespace) -> list[str]:
    """The SFT starts a study trains and evaluates: the memory format's always (the reference
    start), the full-history one where a variant trains from it."""
    return ["memory"] + (["full"] if any(RL_VARIANTS[v][0] == "full" for v in a.variants) else [])


def seeds_of(a: argparse.Namespace, variant: str) -> list[int]:
    """The RL seeds of `variant`: --full-seeds for the full-history format, else --seeds."""
    return list(a.full_seeds if RL_VARIANTS[variant][0] == "full" else a.seeds)


def rl_jobs_by_format(a: argparse.Namespace) -> dict[str, list[tuple[str, str, str, int]]]:
    """Each format's RL jobs, ("rl", key, variant, seed), seed by seed: every variant of a seed
    before the next seed, so a study stopped early keeps complete pairs (a rerun with the
    finished --seeds summarises them from the kept job results)."""
    every_seed = sorted({s for v in a.variants for s in seeds_of(a, v)})
    return {fmt: [("rl", f"rl-{v}-seed{s}", v, s) for s in every_seed for v in a.variants
                  if RL_VARIANTS[v][0] == fmt and s in seeds_of(a, v)] for fmt in ("memory", "full")}


def _run_job(kind: str, key: str, a: argparse.Namespace, inputs: dict[str, Path], *args: Any) -> tuple[str, Any]:
    """Run a job unless its result file exists (resume); returns (key, result)."""
    f = Path(a.workdir) / "results" / f"{key}.json"
    if f.exists():
        return key, json.loads(f.read_text())
    fn = {"sft": job_sft, "rl": job_rl, "untrained": job_untrained}[kind]
    res = fn(*args, a, inputs)
    from mempo.io import write_json

    write_json(f, res)
    return key, res


# ---------------------------------------------------------------------------- statistics


def _stats(values: list[float]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    return {"mean": statistics.fmean(vals) if vals else None,
            "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "per_seed": values}


def mean_outcomes(per_run: list[dict[str, float] | None]) -> dict[str, float] | None:
    """How the episodes ended (`mempo.evaluation.outcomes`), shares averaged over the runs
    (None when a run predates the outcome shares)."""
    from mempo.evaluation.outcomes import OUTCOMES

    if not per_run or any(s is None for s in per_run):
        return None
    means = {o: statistics.fmean(s.get(o, 0.0) for s in per_run) for o in OUTCOMES}
    return {o: round(m, 4) for o, m in means.items() if m}


def summarise(a: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """The JSON written to `--out`: per variant and set, per-seed metrics with mean and std;
    paired differences with intervals; curves; timings."""
    variants: dict[str, list[dict[str, Any]]] = {"untrained": [results["untrained"]], "sft": [results["sft-memory"]]}
    if "sft-full" in results:  # studies of memory-format variants only leave it out (start_formats)
        variants["sft_full"] = [results["sft-full"]]
    for v in a.variants:
        variants[v] = [results[f"rl-{v}-seed{s}"] for s in seeds_of(a, v)]
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for v, runs in variants.items():
        table[v] = {}
        for bench in BENCHES:
            table[v][bench] = {m: _stats([r["eval"][bench]["aggregate"].get(m) for r in runs]) for m in REPORTED}
            table[v][bench]["n"] = runs[0]["eval"][bench]["aggregate"].get("n")
            table[v][bench]["outcomes"] = mean_outcomes([r["eval"][bench]["aggregate"].get("outcomes") for r in runs])
    from mempo.evaluation.stats import paired_bootstrap, seed_contrast
    from mempo.tracking.lineage import numerics_tags

    paired: dict[str, dict[str, Any]] = {}
    for name, (x, y) in {"mempo_minus_grpo": ("mempo", "grpo"), "mempo_minus_full": ("mempo", "full"),
                         "mempo_prev_minus_grpo": ("mempo_prev", "grpo"),
                         "mempo_minus_mempo_prev": ("mempo", "mempo_prev"),
                         "mempo_skip_minus_grpo": ("mempo_skip", "grpo"),
                         "mempo_skip_minus_mempo": ("mempo_skip", "mempo"),
                         "mempo_half_minus_grpo": ("mempo_half", "grpo"),
                         "mempo_half_minus_mempo": ("mempo_half", "mempo"),
                         "mempo_retain_minus_grpo": ("mempo_retain", "grpo"),
                         "mempo_retain_minus_mempo_half": ("mempo_retain", "mempo_half"),
                         "mempo_half_skip_minus_grpo": ("mempo_half_skip", "grpo"),
                         "mempo_half_skip_minus_mempo_half": ("mempo_half_skip", "mempo_half"),
                         "mempo_half_closing_minus_grpo": ("mempo_half_closing", "grpo"),
                         "mempo_half_closing_minus_mempo_half": ("mempo_half_closing", "mempo_half")}.items():
        if x not in variants or y not in variants:
            continue
        # pairs on the seeds both variants ran (seed s of each saw the same task order)
        common = [s for s in seeds_of(a, x) if s in seeds_of(a, y)]
        xs = [results[f"rl-{x}-seed{s}"] for s in common]
        ys = [results[f"rl-{y}-seed{s}"] for s in common]
        paired[name] = {"seeds": common}
        for bench in BENCHES:
            for metric in ("em", "objective_em", "forgetting_rate"):
                key = f"{bench}/{metric}"
                paired[name][key] = paired_bootstrap(
                    [{t: d[metric] for t, d in r["eval"][bench]["per_task"].items()} for r in xs],
                    [{t: d[metric] for t, d in r["eval"][bench]["per_task"].items()} for r in ys],
                    a.bootstrap)
        # does the gain grow with k? per seed, the k=4 difference minus the k=2 one (seeds resampled)
        for metric in ("objective_em", "forgetting_rate"):
            gap = {bench: {s: rx["eval"][bench]["aggregate"][metric] - ry["eval"][bench]["aggregate"][metric]
                           for s, rx, ry in zip(common, xs, ys, strict=True)
                           if rx["eval"][bench]["aggregate"].get(metric) is not None
                           and ry["eval"][bench]["aggregate"].get(metric) is not None} for bench in ("k2", "k4")}
            paired[name][f"k4_minus_k2/{metric}"] = seed_contrast(gap["k4"], gap["k2"], a.bootstrap)
    curves = {}
    for v in a.variants:
        rows = []
        for step in range(a.rl_steps):
            row: dict[str, Any] = {"step": step + 1}
            for key in (*CURVE_KEYS, *PER_K):
                vals = [c["curve"][step].get(key) for c in variants[v] if len(c["curve"]) > step]
                vals = [x for x in vals if x is not None]
                if vals:
                    row[key] = statistics.fmean(vals)
            rows.append(row)
        curves[v] = rows
    flat = {}
    for v, rows in curves.items():
        tail = [r["reward_mean"] for r in rows[-max(3, len(rows) // 4):] if "reward_mean" in r]
        head = [r["reward_mean"] for r in rows[:max(3, len(rows) // 4)] if "reward_mean" in r]
        mid = [r["reward_mean"] for r in rows[len(rows) // 2 - max(1, len(rows) // 8):len(rows) // 2 + 1]
               if "reward_mean" in r]
        flat[v] = {"first_quarter": statistics.fmean(head) if head else None,
                   "middle": statistics.fmean(mid) if mid else None,
                   "last_quarter": statistics.fmean(tail) if tail else None}
    from mempo.evaluation.stats import slopes_over_seeds

    # has each variant's reward stopped rising? slopes of each seed's curve, first and second half
    trend = {v: slopes_over_seeds({s: [row.get("reward_mean") for row in results[f"rl-{v}-seed{s}"]["curve"]]
                                   for s in seeds_of(a, v)}, a.bootstrap) for v in a.variants}
    return {
        "benchmark": "learning", "quick": a.quick,
        "config": {"seeds": {v: seeds_of(a, v) for v in a.variants}, "sft_steps": a.sft_steps, "rl_steps": a.rl_steps,
                   "batch_questions": a.batch_questions, "n_rollouts": a.n_rollouts,
                   "eval_tasks": {b: table["sft"][b]["n"] for b in BENCHES}, "untrained_tasks": a.untrained_n,
                   "sft": "one checkpoint per format (seed 0), shared by the RL seeds"
                          + ("; a finished pipeline's (--from-pipeline)" if a.from_pipeline else "")
                          + (f"; a saved start's (--start {a.start})" if a.start else ""),
                   "policy": "tiny (2 x 128 Qwen2, BPE 1.5k)", "device": a.device,
                   # the RL mixture where --rl-mix replaced params.yaml's (absent: singles + k=2), and
                   # --rl-set's overrides (absent: none)
                   **({"rl_mix": a.rl_mix} if a.rl_mix else {}), **({"rl_set": a.rl_set} if a.rl_set else {}),
                   **({"sft_set": a.sft_set} if a.sft_set else {}),
                   # which checkpoints RL started from (learning_pool.py / learning_budget.py compare it)
                   "start": {fmt: results[f"sft-{fmt}"].get("weights_sha256") for fmt in AGENT_OF_FORMAT
                             if f"sft-{fmt}" in results},
                   "numerics": numerics_tags()},
        "results": table,
        "paired": paired,
        "reward_flattening": flat,
        "reward_trend": trend,
        "curves": curves,
        "timings_s": {k: {"train": r.get("train_seconds"), "eval": r.get("eval_seconds")}
                      for k, r in results.items()},
        "rl_step_seconds": {v: _stats([r["mean_time_step"] for r in variants[v]]) for v in a.variants},
        "mem_scoring_share": {v: _stats([r["mem_scoring_share"] for r in variants[v]]) for v in a.variants},
    }


def per_task_rows(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per RL variant, seed, set and test task (em, objective_em, forgetting_rate): the
    `--out` file's `.per_task.jsonl.gz` sidecar, so that studies run on other seeds can be pooled
    with the two-level bootstrap later (`benchmarks/learning_pool.py`)."""
    rows = []
    for v in a.variants:
        for s in seeds_of(a, v):
            for bench in BENCHES:
                for task, vals in sorted(results[f"rl-{v}-seed{s}"]["eval"][bench]["per_task"].items()):
                    rows.append({"variant": v, "seed": s, "bench": bench, "task": task, **vals})
    return rows


def per_task_path(out_path: Path) -> Path:
    return out_path.with_suffix(".per_task.jsonl.gz")


def plots(out: dict[str, Any], out_path: Path) -> None:
    import matplotlib

    from mempo.training.plots import plot_curves

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = out["curves"]
    steps = max((len(c) for c in curves.values()), default=0)
    merged = [{"step": i + 1, **{f"{v}_reward": curves[v][i].get("reward_mean") for v in curves
                                if len(curves[v]) > i and curves[v][i].get("reward_mean") is not None}}
              for i in range(steps)]
    plot_curves(merged, [f"{v}_reward" for v in curves], out_path.with_name(f"{out_path.stem}_curves.png"),
                title="RL training reward (mean over seeds)", smooth=steps // 12)
    em_keys = [key for key in PER_K if key.startswith("em_")]
    by_k = [{"step": i + 1, **{f"{v}_{key}": curves[v][i][key] for v in curves for key in em_keys
                               if len(curves[v]) > i and curves[v][i].get(key) is not None}} for i in range(steps)]
    keys = [f"{v}_{key}" for v in curves for key in em_keys if any(f"{v}_{key}" in r for r in by_k)]
    if keys:  # what RL on the mixture does to each part (rollout EM, mean over seeds)
        ks = sorted({k.rsplit("_k", 1)[1] for k in keys}, key=int)
        plot_curves(by_k, keys, out_path.with_name(f"{out_path.stem}_curves_per_k.png"),
                    title=f"RL rollout EM per k ({', '.join(ks)}; mean over seeds)", smooth=steps // 12)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ks = {"single": 1, "k2": 2, "k4": 4}
    for v, by_bench in out["results"].items():
        for ax, metric in zip(axes, ("em", "objective_em"), strict=True):
            pts = [(ks[b], by_bench[b][metric]["mean"]) for b in BENCHES if by_bench[b][metric]["mean"] is not None]
            if metric == "objective_em":
                pts = [(1, by_bench["single"]["em"]["mean"])] + [p for p in pts if p[0] > 1]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
    for ax, title in zip(axes, ("EM (all objectives right)", "objective EM"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4], ["1", "2", "4"])
        ax.set_xlabel("objectives per task (k)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize="small")
    fig.savefig(out_path.with_name(f"{out_path.stem}_em_vs_k.png"), dpi=110, bbox_inches="tight")
    plt.close(fig)


def print_table(out: dict[str, Any]) -> None:
    from mempo.evaluation.stats import format_interval

    head = f"{'variant':<11}" + "".join(f"{b + ' ' + m:>16}" for b in BENCHES for m in ("em", "obj"))
    print("\n" + head + f"{'forget k4':>11}{'peak tok k4':>12}")
    for v, by in out["results"].items():
        cells = ""
        for b in BENCHES:
            for m in ("em", "objective_em"):
                s = by[b][m]
                cells += f"{'–':>16}" if s["mean"] is None else f"{s['mean']:>10.3f} ±{s['std']:.3f}"
        f = by["k4"]["forgetting_rate"]["mean"]
        cells += f"{'–' if f is None else f'{f:.3f}':>11}{by['k4']['peak_prompt_tokens']['mean'] or 0:>12.0f}"
        print(f"{v:<11}{cells}")
    for name, per in out["paired"].items():
        for key, d in per.items():
            if isinstance(d, dict) and key.rsplit("/", 1)[-1] in ("em", "objective_em"):
                print(f"{name:<22} {key:<24} {format_interval(d)}")
    print_trend(out.get("reward_trend") or {})


def print_trend(trend: dict[str, Any]) -> None:
    """Each variant's training-reward slope per 100 steps, first and second half (mean over seeds)."""
    from mempo.evaluation.stats import format_trend

    for v, t in trend.items():
        print(f"reward slope /100 steps  {v:<11} {format_trend(t)}")


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    sys.path.insert(0, str(REPO))
    os.environ["MEMPO_TRACKING"] = "0"
    import multiprocessing as mp

    from mempo.training.runtime import die_with_parent

    t_all = time.perf_counter()
    inputs = prepare_inputs(a)
    print(f"inputs ready in {time.perf_counter() - t_all:.0f}s: {a.workdir}", flush=True)
    results: dict[str, Any] = {}
    # The two SFT formats and the untrained policy first; each format's RL jobs start as soon
    # as its SFT checkpoint exists, so both cores stay busy.
    rl_jobs = rl_jobs_by_format(a)
    first = [("sft", f"sft-{fmt}", fmt) for fmt in start_formats(a)] + [("untrained", "untrained")]
    total = len(first) + sum(map(len, rl_jobs.values()))
    with ProcessPoolExecutor(max_workers=a.jobs, mp_context=mp.get_context("spawn"),
                             initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        def submit(job: tuple[Any, ...]) -> Future[tuple[str, Any]]:
            return pool.submit(_run_job, job[0], job[1], a, inputs, *job[2:])

        if a.from_pipeline or a.start:  # the SFT checkpoints exist: RL starts at once, the slow full-history jobs first
            first = rl_jobs.pop("full") + first + rl_jobs.pop("memory")
        pending = {submit(j) for j in first}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                key, res = f.result()
                results[key] = res
                if key.startswith("sft-"):
                    pending |= {submit(j) for j in rl_jobs.get(key.removeprefix("sft-"), [])}
                agg = {b: res["eval"][b]["aggregate"] for b in BENCHES}
                print(f"[{time.perf_counter() - t_all:6.0f}s] {key}: single EM {agg['single'].get('em', 0):.3f}, "
                      f"k2 obj EM {agg['k2'].get('objective_em', 0):.3f}, k4 obj EM "
                      f"{agg['k4'].get('objective_em', 0):.3f} ({len(results)}/{total} jobs)", flush=True)
    out = summarise(a, results)
    out["total_seconds"] = time.perf_counter() - t_all
    out_path = Path(a.out)
    from mempo.io import write_json, write_jsonl

    plots(out, out_path)
    write_jsonl(per_task_path(out_path), per_task_rows(a, results))
    write_json(out_path, out)
    print_table(out)
    print(f"wrote {out_path} ({out['total_seconds']:.0f}s)")
    if a.save_start:
        save_study_start(a, inputs)
    return 0


def save_study_start(a: argparse.Namespace, inputs: dict[str, Path]) -> Path:
    """`--save-start`: the study's SFT checkpoints as a start other machines can run from."""
    from mempo.tracking.lineage import git_commit, numerics_tags
    from mempo.training.starts import save_start

    commit, dirty = git_commit(REPO)
    checkpoints = {fmt: (inputs[f"sft-{fmt}"], inputs.get(f"sft-{fmt}-metrics", inputs[f"sft-{fmt}"].parent
                                                           / "metrics.json")) for fmt in start_formats(a)}
    record = save_start(a.save_start, checkpoints, inputs["world"],
                        note={"numerics_at_save": numerics_tags(), "params": str(PARAMS.relative_to(REPO)),
                              "saved_at_commit": commit + ("+dirty" if dirty else ""),
                              **({"sft_set": a.sft_set} if a.sft_set else {})})
    print(f"saved the SFT start to {a.save_start}: " + ", ".join(
        f"{fmt} {r['weights_sha256'][:12]}" for fmt, r in record["formats"].items()))
    return Path(a.save_start)


if __name__ == "__main__":
    sys.exit(main())
