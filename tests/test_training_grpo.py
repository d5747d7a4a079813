"""SFT and the local GRPO trainer end to end on the tiny policy: metrics in MLflow, FAILED
runs, SIGKILL-and-resume determinism, and (slow) the SmolLM2 policy."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchmark_helpers import load_benchmark

REPO = Path(__file__).resolve().parents[1]

GRPO_KEYS = [
    "reward_mean", "reward_std", "em", "f1", "format_valid", "mem_reward_mean", "mem_reward_turn_0",
    "kl", "entropy", "clip_frac", "response_length", "turns", "prompt_tokens_per_turn",
    "time_rollout", "time_mem_scoring", "time_update", "time_step", "mem_scoring_share",
]


def test_merged_full_history_turn_records_give_the_same_policy_gradient(setup: dict[str, Path]) -> None:
    import random

    import torch

    from mempo.config import load_params
    from mempo.training.grpo_update import TurnSample, merge_turn_samples, update_policy
    from mempo.training.runtime import load_policy
    from mempo.training.sft import tokenize_samples
    from mempo.training.sft_data import load_sft_samples

    model, tok = load_policy(setup["sft"] / "model", "cpu", "float32")
    turns = tokenize_samples(load_sft_samples(setup["sft"] / "trajectories" / "train_episodes.jsonl", "full")[:40],
                             tok)
    rng = random.Random(0)
    records, episode = [], -1
    for t in turns:
        episode += t.n_prompt < (len(records[-1].prompt_ids) + 1 if records else 10**9)  # a new question
        records.append(TurnSample(episode, t.input_ids[:t.n_prompt], t.input_ids[t.n_prompt:],
                                  [rng.uniform(-1, 1) for _ in t.input_ids[t.n_prompt:]], 0.01))
    merged = merge_turn_samples(records)
    assert len(merged) < len(records) // 2
    assert sum(sum(m.loss_mask or [1.0] * len(m.response_ids)) for m in merged) == sum(
        len(r.response_ids) for r in records)
    tp = load_params(None, {}).train

    def grads(samples: list) -> tuple[dict[str, float], list]:
        model.zero_grad()
        stats = update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), samples, tok.pad_token_id, tp,
                              1.0, "cpu")
        return stats, [p.grad.clone() for p in model.parameters()]

    s1, g1 = grads(records)
    s2, g2 = grads(merged)
    assert abs(s1["loss"] - s2["loss"]) < 1e-5 and abs(s1["entropy"] - s2["entropy"]) < 1e-4
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g1, g2, strict=True))
    assert any(float(a.abs().sum()) > 0 for a in g1)


def test_full_history_turns_merge_into_one_sample_with_the_same_loss_per_response_token(
    setup: dict[str, Path]
) -> None:
    import torch

    from mempo.training.runtime import load_policy
    from mempo.training.sft import (
        TokenizedSample,
        collate,
        merge_prefix_turns,
        token_loss,
        tokenize_samples,
    )
    from mempo.training.sft_data import load_sft_samples

    labels = collate([TokenizedSample([5, 6, 7, 8, 9, 10], 6, None, ((1, 3), (4, 6)))], pad_id=0)["labels"]
    assert labels.tolist() == [[-100, 6, 7, -100, 9, 10]]
    model, tok = load_policy(setup["sft"] / "model", "cpu", "float32")
    episodes = setup["sft"] / "trajectories" / "train_episodes.jsonl"
    full = tokenize_samples(load_sft_samples(episodes, "full")[:60], tok, prompt_lm=True)
    merged = merge_prefix_turns(full)
    assert len(merged) < len(full) // 2  # episodes of 2+ turns became one sample each
    assert sum(len(s.loss_spans()) for s in merged) == len(full)
    with torch.no_grad():
        per_turn = [token_loss(model, collate([s], tok.pad_token_id), "cpu") for s in full]
        per_episode = [token_loss(model, collate([s], tok.pad_token_id), "cpu") for s in merged]
    assert sum(n for _, n in per_episode) == sum(n for _, n in per_turn)
    assert abs(sum(float(x) for x, _ in per_episode) - sum(float(x) for x, _ in per_turn)) < 1e-3
    assert sum(len(s.input_ids) for s in merged) < sum(len(s.input_ids) for s in full) / 2
    # a merged sample never grows past max_tokens; memory-context turns never merge
    cap = max(len(s.input_ids) for s in full) - 1
    assert all(len(s.input_ids) <= cap or len(s.loss_spans()) == 1 for s in merge_prefix_turns(full, cap))
    memory = tokenize_samples(load_sft_samples(episodes, "memory")[:60], tok)
    assert merge_prefix_turns(memory) == memory


def test_sft_loss_without_the_mask_and_with_the_head_on_loss_positions_equals_the_models_own(
    setup: dict[str, Path]
) -> None:
    """token_loss drops a right-padded batch's attention mask, runs the samples' shared leading
    tokens once and the LM head only where a next token has a weight; loss, weight sum and
    gradients equal the model's own forward (the mask, logits everywhere): memory turns of
    different lengths (padding), merged full-history episodes with several loss spans, prompt
    weights, the turns of one episode (their shared question runs once)."""
    import torch

    from mempo.training.forward import has_plain_head, shared_prefix_length
    from mempo.training.runtime import load_policy
    from mempo.training.sft import collate, merge_prefix_turns, token_loss, tokenize_samples
    from mempo.training.sft_data import load_sft_samples

    model, tok = load_policy(setup["sft"] / "model", "cpu", "float32")
    assert has_plain_head(model) and not has_plain_head(torch.nn.Linear(2, 2))
    episodes = setup["sft"] / "trajectories" / "train_episodes.jsonl"
    turns = load_sft_samples(episodes, "memory")
    memory = tokenize_samples(turns[:6], tok)
    full = merge_prefix_turns(tokenize_samples(load_sft_samples(episodes, "full")[:12], tok, prompt_lm=True))
    assert len({len(s.input_ids) for s in memory}) > 1 and max(len(s.loss_spans()) for s in full) > 1
    # the turns of one episode share their question: it runs once (`_shared_prefix_loss`)
    question = max({t.messages[-1]["content"].split("\n")[0] for t in turns},
                   key=lambda q: sum(t.messages[-1]["content"].startswith(q) for t in turns))
    same = tokenize_samples([t for t in turns if t.messages[-1]["content"].startswith(question)], tok, prompt_lm=True)
    batches = (collate(memory, tok.pad_token_id), collate(full[:3], tok.pad_token_id, prompt_weight=0.3),
               collate(same, tok.pad_token_id, prompt_weight=0.5))
    assert len(same) > 1
    assert [shared_prefix_length(b["input_ids"], b["attention_mask"]) > 0 for b in batches] == [False, False, True]
    for batch in batches:
        grads = []
        for every in (False, True):
            model.zero_grad(set_to_none=True)
            loss, n = token_loss(model, batch, "cpu", reference=every)
            (loss / n).backward()
            grads.append((loss.item(), n, [p.grad.clone() for p in model.parameters()]))
        (fast, n_fast, g_fast), (ref, n_ref, g_ref) = grads
        assert n_fast == n_ref > 0 and abs(fast - ref) <= 1e-4 * abs(ref)
        assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(g_fast, g_ref, strict=True))
        assert any(float(g.abs().sum()) > 0 for g in g_fast)


@pytest.fixture(scope="module")
def setup(tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny policy -> a short SFT -> prepared parquet (rl part) for GRPO."""
    from mempo.config import load_params
    from mempo.data.schema import to_verl_row, write_prepared
    from mempo.data.sft_split import write_sft_split
    from mempo.datasets import load_qa
    from mempo.policy import TinyPolicySpec, bootstrap_tiny
    from mempo.training.sft import run_sft

    root = tmp_path_factory.mktemp("training")
    bootstrap_tiny(root / "policy", tiny_world / "corpus.jsonl", [tiny_world / "qa" / "train.jsonl"],
                   spec=TinyPolicySpec(vocab_size=500, hidden_size=64, intermediate_size=128, seed=1,
                                       copy_steps=0))
    corpus = str(tiny_world / "corpus.jsonl")
    params = load_params(None, {
        "sft.policy": str(root / "policy"), "sft.world": str(tiny_world), "sft.retriever": corpus,
        "sft.out": str(root / "sft"), "sft.max_questions": 40, "sft.multi_tasks": 4,
        "sft.val_questions": 8, "sft.max_steps": 12, "sft.batch_size": 8, "sft.eval_every": 6,
        "sft.checkpoint_every": 100, "sft.warmup_steps": 2, "data.out": str(root / "prepared"),
    })
    write_sft_split(params.sft, root / "prepared")  # the data stage's SFT tasks
    metrics = run_sft(params, tracking=False)
    train = [q for q in load_qa(tiny_world / "qa" / "train.jsonl") if q.part == "rl"]
    val = load_qa(tiny_world / "qa" / "val.jsonl")
    write_prepared([to_verl_row(q, data_source="world", split="train", index=i) for i, q in enumerate(train)],
                   root / "data" / "train.parquet")
    write_prepared([to_verl_row(q, data_source="world", split="val", index=i) for i, q in enumerate(val)],
                   root / "data" / "val.parquet")
    return {"root": root, "policy": root / "policy", "sft": root / "sft", "data": root / "data",
            "corpus": Path(corpus), "sft_metrics": metrics}  # type: ignore[dict-item]


def _grpo_overrides(setup: dict[str, Path], out: Path, **extra: object) -> dict[str, object]:
    base: dict[str, object] = {
        "train.policy": str(setup["sft"] / "model"), "train.data": str(setup["data"]),
        "train.retriever": str(setup["corpus"]), "train.out": str(out), "train.steps": 3,
        "train.batch_questions": 2, "train.n_rollouts": 2, "train.rollout.max_new_tokens": 40,
        "train.rollout.max_turns": 3, "train.checkpoint_every": 2, "train.threads": 1,
    }
    base.update(extra)
    return base


def test_grpo_validation_runs_the_eval_code_and_matches_greedy_lockstep_episodes(
        setup: dict[str, Path], tmp_path: Path) -> None:
    """The periodic validation goes through `mempo eval`'s `run_multi_turn`; per task it
    gives what GRPO's former evaluator (`evaluate_tasks`, removed) gave: greedy lock-step
    episodes with the training rollout's tools and limits, scored with `mempo.rewards`."""
    import dataclasses

    from mempo.agent.generation import make_generator
    from mempo.config import load_params
    from mempo.evaluation.agent_runner import run_multi_turn
    from mempo.evaluation.engine import Engine
    from mempo.retrieval import open_retriever
    from mempo.rewards import answer_correctness, token_f1
    from mempo.tasks import compose_multi_objective
    from mempo.training.grpo import load_tasks, make_rollout_setup, val_settings, validate
    from mempo.training.rollouts import lockstep_episodes
    from mempo.training.runtime import load_policy

    params = load_params(None, _grpo_overrides(setup, tmp_path / "train", **{"train.rollout.max_new_tokens": 64,
                                                                            "train.rollout.max_turns": 4}))
    agent, tp, rule = params.train.rollout_params(), params.train, params.mempo.multi_rule
    model, tok = load_policy(setup["sft"] / "model", "cpu", "float32")
    singles = load_tasks(setup["data"], "val")
    tasks = singles[:6] + compose_multi_objective(singles[6:], k=2, n_tasks=2, seed=0)
    with open_retriever(str(setup["corpus"])) as retriever:
        model.eval()
        rows = run_multi_turn("memory", "val", tasks, Engine(make_generator(
            model, tok, agent.decoder, batch_size=tp.generation_batch_size), tok, retriever), val_settings(agent, tp))
        summary = validate(model, tok, retriever, tasks, agent, tp)
        rs = make_rollout_setup(retriever, tok, agent)
        episodes = lockstep_episodes(tasks, make_generator(model, tok, agent.decoder,
                                                           batch_size=tp.generation_batch_size),
                                     dataclasses.replace(rs.sampling, temperature=0.0), rs.env, tok, 1, rs.config,
                                     context="memory")
    by_id = {r["id"]: r for r in rows}
    assert [ep.item_id for ep in episodes] == [t.id for t in tasks] == [r["id"] for r in rows]
    assert {t.metadata.get("k", 1) for t in tasks} == {1, 2}
    for ep in episodes:
        r = by_id[ep.item_id]
        assert r["prediction"] == (ep.final_answer or "")
        assert r["em"] == answer_correctness(ep.final_answer, ep.golden_answers, ep.objectives, rule)
        assert r["f1"] == token_f1(ep.final_answer, ep.golden_answers)
        assert (r["format_valid"], r["turns"]) == (float(ep.format_valid), ep.num_turns)
        assert r["prompt_tokens_by_turn"] == list(ep.prompt_tokens)
    assert any(r["turns"] > 1 for r in rows)  # episodes long enough for the two loops to diverge
    assert summary == pytest.approx({m: sum(float(r[m]) for r in rows) / len(rows)
                                     for m in ("em", "f1", "format_valid", "turns")})


def test_sft_trains_on_assistant_tokens_and_saves_an_hf_folder(setup: dict[str, Path]) -> None:
    import json

    from transformers import AutoModelForCausalLM

    from mempo.training.sft import TokenizedSample, collate

    batch = collate([TokenizedSample([5, 6, 7, 8], 2), TokenizedSample([9, 10, 11], 1)], pad_id=0)
    assert batch["labels"].tolist() == [[-100, -100, 7, 8], [-100, 10, 11, -100]]
    hist = [json.loads(x) for x in (setup["sft"] / "history.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in hist if "val_loss" in r]
    assert len(val) == 2 and val[-1] < val[0]
    assert hist[-1]["loss"] < hist[0]["loss"]
    assert setup["sft_metrics"]["data_teacher_em"] == 1.0
    assert (setup["sft"] / "trajectories" / "train.jsonl").exists()
    assert (setup["sft"] / "plots" / "sft_loss.png").stat().st_size > 0
    AutoModelForCausalLM.from_pretrained(setup["sft"] / "model")


def test_the_teacher_stage_writes_the_episodes_the_sft_stage_ran_its_teacher_on(setup: dict[str, Path],
                                                                                  tmp_path: Path) -> None:
    """`mempo train teacher` (dvc.yaml's teacher stage, which both SFT stages read) writes the
    same records, byte for byte, as the SFT stage's own teacher run with the same params."""
    import json

    from mempo.config import load_params
    from mempo.training.sft_data import run_teacher

    root, tiny_world = setup["root"], setup["corpus"].parent
    params = load_params(None, {
        "sft.policy": str(setup["policy"]), "sft.world": str(tiny_world), "sft.retriever": str(setup["corpus"]),
        "sft.teacher_out": str(tmp_path / "teacher"), "data.out": str(root / "prepared")})
    metrics = run_teacher(params, tracking=False)
    for name in ("train_episodes.jsonl", "val_episodes.jsonl"):
        assert (tmp_path / "teacher" / name).read_bytes() == (setup["sft"] / "trajectories" / name).read_bytes(), name
    assert metrics["data_teacher_em"] == 1.0 and metrics["train_episodes"] > 40
    assert json.loads((tmp_path / "teacher" / "metrics.json").read_text())["val_episodes"] == metrics["val_episodes"]
    assert not (tmp_path / "teacher" / "model").exists()  # no model is trained or saved


def test_full_history_baseline_learns_from_the_same_teacher_episodes_and_trains_two_grpo_steps(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    import json

    from mempo.config import load_params
    from mempo.errors import ConfigError
    from mempo.training.grpo import run_grpo
    from mempo.training.sft import run_sft
    from mempo.training.sft_data import load_sft_samples

    traj = setup["sft"] / "trajectories"
    mem = load_sft_samples(traj / "train_episodes.jsonl", "memory")
    full = load_sft_samples(traj / "train_episodes.jsonl", "full")
    # the same teacher turns, rendered two ways; the memory rendering is what the memory SFT trained on
    assert [s.response for s in full] == [s.response for s in mem] and len(mem) > 40
    assert mem == load_sft_samples(traj / "train.jsonl")
    # full history: turn t's prompt holds every earlier response; the memory prompt never does
    later = [(m, f) for m, f in zip(mem, full, strict=True) if len(f.messages) > 2]
    assert later and all(len(f.messages) > len(m.messages) for m, f in later)
    assert all(any(msg["role"] == "assistant" for msg in f.messages) for _, f in later)
    assert not any(msg["role"] == "assistant" for m, _ in later for msg in m.messages)

    sft_out, grpo_out = tmp_path / "sft_full", tmp_path / "grpo_full"
    sft_params = load_params(None, {
        "rollout.context": "full", "sft.policy": str(setup["policy"]), "sft.out": str(sft_out),
        "sft.trajectories": str(traj / "train_episodes.jsonl"),
        "sft.val_trajectories": str(traj / "val_episodes.jsonl"), "sft.max_steps": 2, "sft.batch_size": 4,
        "sft.eval_every": 2, "sft.max_tokens": 4096, "sft.resume": "never"})
    sft_metrics = run_sft(sft_params, tracking=False)
    assert sft_metrics["steps"] == 2
    # an episode's full-history turns trained as one prefix-sharing sample
    assert sft_metrics["data_merged_samples"] < sft_metrics["train_samples"] == len(full)
    assert json.loads((sft_out / "model" / "policy.json").read_text())["context"] == "full"
    over = _grpo_overrides(setup, grpo_out, **{"train.policy": str(sft_out / "model"), "train.steps": 2,
                                               "mempo.lambda_mem": 0.0, "rollout.context": "full",
                                               "train.val_every": 2, "train.val_questions": 3})
    metrics = run_grpo(load_params(None, over), tracking=False)
    assert metrics["steps"] == 2
    hist = [json.loads(x) for x in (grpo_out / "history.jsonl").read_text().splitlines()]
    assert len(hist) == 2 and all("mem_reward_mean" not in r for r in hist)  # nothing to score
    # the greedy validation (the eval code's full_context agent) ran at step 2 only
    assert "val_em" not in hist[0] and metrics["val_em"] == hist[1]["val_em"]
    assert hist[1]["val_turns"] >= 1 and 0.0 <= hist[1]["val_format_valid"] <= 1.0
    assert json.loads((grpo_out / "model" / "policy.json").read_text())["context"] == "full"
    with pytest.raises(ConfigError, match="lambda_mem"):
        run_grpo(load_params(None, {**over, "mempo.lambda_mem": 1.0}), tracking=False)


@pytest.fixture(scope="module")
def grpo_run(setup: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One uninterrupted 3-step run (checkpoint at step 2), tracked in its own MLflow store."""
    from mempo.config import load_params
    from mempo.training.grpo import run_grpo

    root = tmp_path_factory.mktemp("grpo")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("MLFLOW_ARTIFACTS_DESTINATION", str(root / "mlartifacts"))
        metrics = run_grpo(load_params(None, _grpo_overrides(setup, root / "run")))
    return {"uri": uri, "out": root / "run", "metrics": metrics}


def test_grpo_three_steps_log_metrics_to_mlflow(grpo_run: dict[str, object]) -> None:
    import mlflow

    metrics, out, uri = grpo_run["metrics"], Path(grpo_run["out"]), str(grpo_run["uri"])
    assert metrics["steps"] == 3  # type: ignore[index]
    assert 0.0 <= metrics["mem_scoring_share"] < 1.0  # type: ignore[index]
    client = mlflow.MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("mempo").experiment_id])[0]
    assert run.info.status == "FINISHED"
    for key in GRPO_KEYS:
        hist = client.get_metric_history(run.info.run_id, f"train/{key}")
        assert [m.step for m in hist] == [1, 2, 3], key
    from mempo.config import load_params

    assert run.data.params["mempo.lambda_mem"] == str(load_params(None).mempo.lambda_mem) == "0.5"  # the default
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert "model/config.json" in artifacts
    assert (out / "model" / "model.safetensors").exists()
    assert (out / "plots" / "train_reward.png").exists()


def test_no_answer_penalty_is_the_reward_of_episodes_stopped_at_the_turn_limit(setup: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    """`mempo.no_answer_penalty` reaches the local trainer's R^T: with one turn per episode the
    SFT policy (which searches first) never answers, and every episode scores -p, not 0."""
    import json

    from mempo.config import load_params
    from mempo.training.grpo import run_grpo

    rows = {}
    for p in (0.0, 0.5):
        out = tmp_path / f"p{p}"
        run_grpo(load_params(None, _grpo_overrides(setup, out, **{
            "train.steps": 1, "train.rollout.max_turns": 1, "mempo.lambda_mem": 0.0,
            "mempo.no_answer_penalty": p})), tracking=False)
        rows[p] = json.loads((out / "history.jsonl").read_text().splitlines()[0])
    for p, row in rows.items():
        assert row["hit_turn_limit"] == 1.0 and row["em"] == 0.0
        assert row["reward_mean"] == pytest.approx(-p) and row["reward_std"] == 0.0


def test_grpo_exception_ends_the_mlflow_run_failed(setup: dict[str, Path], tmp_path: Path, mlflow_uri: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    import mempo.training.grpo as grpo
    from mempo.config import load_params

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("update exploded")

    monkeypatch.setattr(grpo, "update_policy", boom)
    with pytest.raises(RuntimeError, match="update exploded"):
        grpo.run_grpo(load_params(None, _grpo_overrides(setup, tmp_path / "run", **{"train.steps": 1})))
    client = mlflow.MlflowClient(mlflow_uri)
    run = client.search_runs([client.get_experiment_by_name("mempo").experiment_id])[0]
    assert run.info.status == "FAILED"
    assert not (tmp_path / "run" / "model").exists()


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model" / "model.safetensors"))


def test_sigkill_after_a_checkpoint_then_resume_gives_the_same_weights(
    setup: dict[str, Path], grpo_run: dict[str, object], tmp_path: Path
) -> None:
    import torch

    killed = tmp_path / "killed"
    sets = [f"--set={k}={v}" for k, v in _grpo_overrides(setup, killed).items()]
    env = {**os.environ, "MEMPO_TRACKING": "0", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "mempo", "--params", str(tmp_path / "none.yaml"), *sets, "train", "grpo"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = killed / "checkpoints" / "step-0000002" / "state.pt"
    deadline = time.monotonic() + 300
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ckpt.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no checkpoint"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "model").exists()  # it died before finishing

    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stderr
    a, b = _tensors(Path(grpo_run["out"])), _tensors(killed)  # type: ignore[arg-type]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_smollm2_three_grpo_steps(setup: dict[str, Path], tmp_path: Path) -> None:
    from mempo.config import load_params
    from mempo.policy import bootstrap_smollm2
    from mempo.training.grpo import run_grpo

    bootstrap_smollm2(tmp_path / "smol")
    over = _grpo_overrides(setup, tmp_path / "run", **{
        # 135M parameters on 1 CPU thread: one turn per episode, one task of 2 rollouts per step.
        "train.policy": str(tmp_path / "smol"), "train.lr": 1e-6, "train.rollout.max_new_tokens": 16,
        "train.rollout.max_turns": 1, "train.batch_questions": 1, "train.micro_batch_size": 4})
    metrics = run_grpo(load_params(None, over), tracking=False)
    assert metrics["steps"] == 3
    assert (tmp_path / "run" / "model" / "config.json").exists()


def test_rename_entities_replaces_chain_names_consistently_and_keeps_generic_words() -> None:
    import random

    from mempo.tasks import Hop, single_task
    from mempo.training.sft import SFTSample
    from mempo.training.sft_data import rename_entities

    chain = [Hop("Kuvshil Brailteix", "works_for", "Khailkheind Textiles", "1"),
             Hop("Khailkheind Textiles", "founded_by", "Gian Gourlio", "2")]
    item = single_task("q1", "Who founded the company that Kuvshil Brailteix works for?", ["Gian Gourlio"],
                       chain=chain)
    s = SFTSample([{"role": "system", "content": "sys"},
                   {"role": "user", "content": "Question: Who founded the company that Kuvshil Brailteix works for?\n"
                                               "<information> Doc 1(Title: Khailkheind Textiles) Khailkheind Textiles "
                                               "was founded by Gian Gourlio. Brailteix works there. </information>"}],
                  "<mem> Kuvshil Brailteix works for Khailkheind Textiles. </mem> <answer> Gian Gourlio </answer>")
    (out,) = rename_entities([s], item, random.Random(0))
    text = out.messages[1]["content"] + out.response
    for word in ["Kuvshil", "Brailteix", "Khailkheind", "Gian", "Gourlio"]:
        assert word not in text
    assert "Textiles" in out.response and out.messages[0]["content"] == "sys"
    # the same new name everywhere: the answer in the response is the founder named in the passage
    answer = out.response.split("<answer>")[1].split("</answer>")[0].strip()
    assert f"founded by {answer}." in out.messages[1]["content"]
    subject = out.response.split("<mem> ")[1].split(" works for")[0]
    assert f"company that {subject} works for?" in out.messages[1]["content"]
    assert f"{subject.split()[1]} works there" in out.messages[1]["content"]  # a surname alone too
    # another draw gives other names; no chain -> unchanged
    (again,) = rename_entities([s], item, random.Random(1))
    assert again.response != out.response
    assert rename_entities([s], single_task("q2", "x?", ["y"]), random.Random(0)) == [s]
    # with a pool, every replacement word comes from it
    (pooled,) = rename_entities([s], item, random.Random(0), pool=["Zorv", "Quell"])
    assert set(re.findall(r"[A-Z][a-z]+", pooled.response)) <= {"Zorv", "Quell", "Textiles"}


def test_name_word_pool_is_the_made_up_words_of_corpus_titles(tiny_world: Path) -> None:
    from mempo.datasets import iter_corpus
    from mempo.training.sft_data import name_word_pool

    pool = name_word_pool(tiny_world / "corpus.jsonl")
    titles = " ".join(p.title for p in iter_corpus(tiny_world / "corpus.jsonl"))
    assert pool == sorted(set(pool)) and len(pool) > 20
    assert all(w in titles for w in pool) and "Textiles" not in pool and "The" not in pool


def test_prompt_lm_loss_weights_skip_retrieved_passages(setup: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mempo.training.sft import SFTSample, collate, token_loss, tokenize_samples

    tok = AutoTokenizer.from_pretrained(setup["policy"])
    model = AutoModelForCausalLM.from_pretrained(setup["policy"])
    s = SFTSample([{"role": "user", "content": "Question: where? <information> Doc 1 secret fact </information> tail"}],
                  "<answer> x </answer>")
    (plain,) = tokenize_samples([s], tok)
    (lm,) = tokenize_samples([s], tok, prompt_lm=True)
    assert plain.prompt_lm is None and lm.input_ids == plain.input_ids and len(lm.prompt_lm) == lm.n_prompt
    marked = tok.decode([t for t, m in zip(lm.input_ids, lm.prompt_lm, strict=False) if m])
    assert "Question: where?" in marked and "tail" in marked and "secret" not in marked
    w = collate([lm], tok.pad_token_id, prompt_weight=0.5)["loss_weights"][0]
    assert set(w[:lm.n_prompt].tolist()) == {0.0, 0.5} and w[lm.n_prompt:].eq(1.0).all()
    # without a prompt weight the loss is the assistant-token loss, whatever prompt_lm says
    with torch.no_grad():
        a, na = token_loss(model, collate([plain], tok.pad_token_id), "cpu")
        b, nb = token_loss(model, collate([lm], tok.pad_token_id, 0.0), "cpu")
        c, nc = token_loss(model, collate([lm], tok.pad_token_id, 0.5), "cpu")
    assert float(a) == float(b) and na == nb == len(lm.input_ids) - lm.n_prompt
    assert nc > nb and float(c) > float(b)


@pytest.mark.slow
def test_side_by_side_benchmark_runs_the_sft_stages_both_ways(setup: dict[str, Path], tmp_path: Path) -> None:
    """benchmarks/side_by_side.py on the tiny setup: dvc.yaml's two SFT commands, 2 steps each,
    one after the other twice and side by side once; the JSON has the ratio and its parts."""
    import json

    bench = load_benchmark("side_by_side")
    root = tmp_path / "root"
    (root / "outputs").mkdir(parents=True)
    (root / "outputs" / "policy").symlink_to(setup["policy"])
    out = tmp_path / "side_by_side.json"
    assert bench.main(["--root", str(root), "--teacher", str(setup["sft"] / "trajectories"), "--steps", "2",
                       "--full-steps", "100", "300", "--work", str(tmp_path / "w"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["side_by_side"] for r in res["runs"]] == [False, True, False]
    assert all(r["sft_steps"] == 2 and r["sft_full_steps"] == 2 for r in res["runs"])
    assert res["ratio"] == pytest.approx(res["sequential_wall_s"] / res["side_by_side_wall_s"])
    pred = res["predicted_full_length"]
    assert pred["steps"] == {"sft": 100, "sft_full": 300}
    assert pred["saved_s"] == pytest.approx(pred["sequential_s"] - pred["side_by_side_s"])
    full = json.loads((tmp_path / "w" / "sft" / "1-side" / "sft_full" / "model" / "policy.json").read_text())
    assert full["context"] == "full"  # dvc.yaml's sft_full command, rendered with the whole history


def test_side_by_side_benchmark_builds_the_grpo_pair_from_dvc_yaml(tmp_path: Path) -> None:
    """`--pair grpo`: dvc.yaml's `train` and `train_full` commands with the step budget and the
    output folder set after dvc.yaml's own `--set`s (the last value wins), no retriever URL."""
    bench = load_benchmark("side_by_side")
    cmds = {name: bench.stage_command(name, 6, tmp_path / name, tmp_path / "teacher") for name in bench.PAIRS["grpo"]}
    for name, argv in cmds.items():
        assert argv[-2:] == ["train", "grpo"] and "--retriever" not in argv
        sets = [argv[i + 1] for i, x in enumerate(argv) if x == "--set"]
        assert sets[-5:] == ["train.steps=6", f"train.out={tmp_path / name}", "train.resume=never",
                             "train.checkpoint_every=1000000", "train.val_every=0"]
    full_sets = [x for x in cmds["train_full"] if "=" in x]
    assert "rollout.context=full" in full_sets and "mempo.lambda_mem=0" in full_sets
    assert full_sets.index("train.out=outputs/train_full") < full_sets.index(f"train.out={tmp_path / 'train_full'}")


def test_memory_credit_benchmark_classes_every_turn_record(setup: dict[str, Path], tmp_path: Path) -> None:
    """benchmarks/memory_credit.py on the tiny policy: every turn record counted once, final
    memories get 0 with final_memory skip, and A^M is centred."""
    import json

    mod = load_benchmark("memory_credit")
    out = tmp_path / "credit.json"
    assert mod.main(["--params", str(tmp_path / "none.yaml"), "--policy", str(setup["sft"] / "model"),
                     "--data", str(setup["data"]), "--retriever", str(setup["corpus"]), "--tasks", "4", "--k", "1",
                     "--n-rollouts", "2", "--max-turns", "3", "--max-new-tokens", "40", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["episodes"] == 8
    classes = res["classes"]
    assert sum(c["n"] for c in classes.values()) == res["turn_records"] >= 8
    finals = [name for name in classes if name != "continuing"]
    assert sum(classes[name]["n"] for name in finals) == 8  # one last turn per episode
    for name in finals:
        assert classes[name]["a_m_mean_final_memory_skip"] == 0.0
    total = sum(c["a_m_mean"] * c["n"] for c in classes.values())
    assert abs(total) < 1e-3  # A^M sums to 0 within each (task, turn) set, so over all records too
    # final_memory closing: the closes (answered last turns) sum to 0 among themselves (per task),
    # the other records too, a turn-limit episode's last memory among them
    def closing_sum(names: list[str]) -> float:
        return sum(classes[n]["a_m_mean_final_memory_closing"] * classes[n]["n"] for n in names if n in classes)

    assert abs(closing_sum([n for n in finals if n.startswith("answer:")])) < 1e-3
    assert abs(closing_sum(["continuing", "last turn, no answer"])) < 1e-3


def test_memory_probe_benchmark_packs_and_agrees(setup: dict[str, Path], tmp_path: Path) -> None:
    """benchmarks/memory_probe.py on the tiny policy: both ways score every turn record of the
    same rollouts, and the packed rewards equal the one-row-each rewards."""
    import json

    mod = load_benchmark("memory_probe")
    out = tmp_path / "probe.json"
    assert mod.main(["--root", str(tmp_path), "--params", "none.yaml", "--policy", str(setup["sft"] / "model"),
                     "--data", str(setup["data"]), "--retriever", str(setup["corpus"]), "--batches", "2",
                     "--batch-questions", "3", "--n-rollouts", "2", "--max-turns", "3", "--max-new-tokens", "40",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["episodes"] for r in res["batches"]] == [6, 6]
    assert all(r["turn_records"] >= 6 and r["packed_s"] > 0 and r["one_row_each_s"] > 0 for r in res["batches"])
    assert res["max_abs_reward_difference"] < 1e-4
    assert "train_stage" not in res  # no train history under this root


def test_prefix_cache_benchmark_reuses_history_and_keeps_greedy_predictions(setup: dict[str, Path],
                                                                             tiny_world: Path, tmp_path: Path) -> None:
    """benchmarks/prefix_cache.py on the tiny policy in the full-history format: with the cache
    fewer prompt tokens are prefilled for the same turns, and greedy evaluation predicts the same."""
    import json

    mod = load_benchmark("prefix_cache")
    out = tmp_path / "prefix.json"
    assert mod.main(["--root", str(tmp_path), "--params", "none.yaml", "--policy", str(setup["sft"] / "model"),
                     "--data", str(setup["data"]), "--retriever", str(setup["corpus"]), "--world", str(tiny_world),
                     "--batches", "1", "--eval-tasks", "3", "--batch-questions", "2", "--n-rollouts", "2",
                     "--max-turns", "3", "--max-new-tokens", "40", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (row,) = res["rollouts"]["batches"]
    assert row["no_cache"]["prefill_tokens"] == row["no_cache"]["prompt_tokens"]
    assert row["no_cache"]["turns"] > 4  # a second turn extends the first: its history comes from the cache
    assert row["prefix_cache"]["prefill_tokens"] < row["prefix_cache"]["prompt_tokens"]
    assert res["eval"]["tasks"] == 3 and res["eval"]["same_predictions"] is True
