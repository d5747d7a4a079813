"""Both trainers resume only their own run: a changed input (the start policy, the data)
moves old checkpoints aside instead of continuing them, and a finished run retires its
checkpoints. Tiny policy, a few steps, BM25 over the tiny world in process."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def inputs(tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from mempo.data.schema import to_verl_row, write_prepared
    from mempo.datasets import load_qa
    from mempo.policy import TinyPolicySpec, bootstrap_tiny

    root = tmp_path_factory.mktemp("resume")
    bootstrap_tiny(root / "policy", tiny_world / "corpus.jsonl", [tiny_world / "qa" / "train.jsonl"],
                   spec=TinyPolicySpec(vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=1,
                                       num_heads=2, num_kv_heads=1, seed=1, copy_steps=0))
    train = [q for q in load_qa(tiny_world / "qa" / "train.jsonl") if q.part == "rl"]
    write_prepared([to_verl_row(q, data_source="world", split="train", index=i) for i, q in enumerate(train)],
                   root / "data" / "train.parquet")
    return {"root": root, "policy": root / "policy", "data": root / "data", "world": tiny_world}


def _touch_content(policy: Path) -> None:
    """A real change of the start policy's contents (as a re-run upstream stage makes)."""
    cfg = policy / "generation_config.json"
    doc = json.loads(cfg.read_text())
    doc["mempo_test_revision"] = doc.get("mempo_test_revision", 0) + 1
    cfg.write_text(json.dumps(doc))


def _fail_at_step(monkeypatch: pytest.MonkeyPatch, module: object, name: str, step: int) -> None:
    real = getattr(module, name)
    calls = {"n": 0}

    def wrapped(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == step:
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def test_grpo_never_continues_checkpoints_of_another_start_policy(
        inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import mempo.training.grpo as grpo
    from mempo.config import load_params

    policy = tmp_path / "policy"
    shutil.copytree(inputs["policy"], policy)
    out = tmp_path / "train"
    params = load_params(None, {
        "train.policy": str(policy), "train.data": str(inputs["data"]),
        "train.retriever": str(inputs["world"] / "corpus.jsonl"), "train.out": str(out), "train.steps": 2,
        "train.batch_questions": 1, "train.n_rollouts": 2, "train.rollout.max_new_tokens": 8, "train.rollout.max_turns": 1,
        "train.checkpoint_every": 1, "train.threads": 1, "train.kl_coef": 0.0,
    })
    with monkeypatch.context() as m:
        _fail_at_step(m, grpo, "update_policy", 2)
        with pytest.raises(RuntimeError, match="killed"):
            grpo.run_grpo(params, tracking=False)
    assert (out / "checkpoints" / "step-0000001").is_dir()

    _touch_content(policy)  # e.g. SFT re-ran upstream
    with caplog.at_level(logging.INFO):
        metrics = grpo.run_grpo(params, tracking=False)
    assert metrics["steps"] == 2
    assert "resumed from" not in caplog.text and "moved" in caplog.text
    [aside] = list(out.glob("checkpoints.stale-*"))
    assert (aside / "step-0000001").is_dir()
    assert not list((out / "checkpoints").glob("step-*"))  # the finished run retired its own


def test_grpo_resumes_its_own_run_then_retires(
        inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import mempo.training.grpo as grpo
    from mempo.config import load_params

    out = tmp_path / "train"
    params = load_params(None, {
        "train.policy": str(inputs["policy"]), "train.data": str(inputs["data"]),
        "train.retriever": str(inputs["world"] / "corpus.jsonl"), "train.out": str(out), "train.steps": 2,
        "train.batch_questions": 1, "train.n_rollouts": 2, "train.rollout.max_new_tokens": 8, "train.rollout.max_turns": 1,
        "train.checkpoint_every": 1, "train.threads": 1, "train.kl_coef": 0.0,
    })
    with monkeypatch.context() as m:
        _fail_at_step(m, grpo, "update_policy", 2)
        with pytest.raises(RuntimeError, match="killed"):
            grpo.run_grpo(params, tracking=False)
    with caplog.at_level(logging.INFO):
        grpo.run_grpo(params, tracking=False)
    assert "resumed from" in caplog.text
    assert (out / "model" / "config.json").exists()
    assert not list((out / "checkpoints").glob("step-*"))
    assert not list(out.glob("checkpoints.stale-*"))


def test_sft_never_continues_checkpoints_of_another_start_policy(
        inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import mempo.training.sft as sft
    from mempo.config import load_params

    policy = tmp_path / "policy"
    shutil.copytree(inputs["policy"], policy)
    out = tmp_path / "sft"
    params = load_params(None, {
        "sft.policy": str(policy), "sft.world": str(inputs["world"]),
        "sft.retriever": str(inputs["world"] / "corpus.jsonl"), "sft.out": str(out),
        "sft.max_questions": 4, "sft.multi_tasks": 0, "sft.val_questions": 2, "sft.max_steps": 3,
        "sft.batch_size": 2, "sft.eval_every": 3, "sft.checkpoint_every": 1, "sft.warmup_steps": 0,
        "data.out": str(tmp_path / "prepared"),
    })
    from mempo.data.sft_split import write_sft_split

    write_sft_split(params.sft, tmp_path / "prepared")  # the data stage's SFT tasks
    with monkeypatch.context() as m:
        _fail_at_step(m, sft, "evaluate_loss", 1)  # the first validation, at step 3, after 2 checkpoints
        with pytest.raises(RuntimeError, match="killed"):
            sft.run_sft(params, tracking=False)
    assert (out / "checkpoints" / "step-0000002").is_dir()

    _touch_content(policy)  # e.g. `policy.copy_steps` changed and the policy stage re-ran
    with caplog.at_level(logging.INFO):
        metrics = sft.run_sft(params, tracking=False)
    assert metrics["steps"] == 3
    assert "resumed from" not in caplog.text and "moved" in caplog.text
    [aside] = list(out.glob("checkpoints.stale-*"))
    assert (aside / "step-0000002").is_dir()
    assert not list((out / "checkpoints").glob("step-*"))
