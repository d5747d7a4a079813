"""The verl plug-in on CPU: registration in a fresh `import verl`, loud failure, the Hydra
overlay composed and validated by verl, and the reward through verl's reward loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from verl_cpu_helpers import CONFIG_DIR, compose_mempo_config, subprocess_env, tiny_policy  # noqa: F401

# Only `import verl`: the plug-in must arrive through verl's entry-point loader.
FRESH_IMPORT = """
import json, verl
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
print("RESULT " + json.dumps({"adv": "mempo" in ADV_ESTIMATOR_REGISTRY,
    "trainer": "mempo_sync" in TRAINER_REGISTRY, "agent": "mem_agent" in _agent_loop_registry}))
"""

# A plug-in whose agent-loop module cannot be imported (as a broken install would be).
BROKEN_IMPORT = """
import sys
sys.modules["mempo.verl_plugin.agent_loop"] = None
import verl
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
try:
    from mempo.verl_plugin import assert_registered
except ImportError:
    print("RESULT plugin-module-not-importable")
print("RESULT adv-registered=" + str("mempo" in ADV_ESTIMATOR_REGISTRY))
"""


@pytest.fixture(scope="module")
def fresh_processes() -> dict[str, subprocess.CompletedProcess]:
    """Run both fresh-interpreter scripts at once (verl's import takes seconds each)."""
    procs = {
        name: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=subprocess_env())
        for name, code in (("fresh", FRESH_IMPORT), ("broken", BROKEN_IMPORT))
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def test_import_verl_registers_mempo_trainer_and_agent_loop(fresh_processes):
    proc = fresh_processes["fresh"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    assert json.loads(line[len("RESULT "):]) == {"adv": True, "trainer": True, "agent": True}
    assert "NOT registered" not in proc.stderr


def test_broken_plugin_is_logged_loudly_not_silently(fresh_processes):
    proc = fresh_processes["broken"]
    assert proc.returncode == 0, proc.stderr[-2000:]  # verl itself carries on ...
    assert "mempo.verl_plugin failed to import: MemPO is NOT registered in verl" in proc.stderr  # ... but we shout
    assert "Traceback" in proc.stderr
    assert "mempo.verl_plugin.agent_loop" in proc.stderr


def test_registration_status_and_assert_in_process():
    import mempo.verl_plugin as plugin

    status = plugin.registration_status()
    assert status == {"adv_estimator:mempo": True, "trainer:mempo_sync": True, "agent_loop:mem_agent": True}
    plugin.assert_registered()


@pytest.fixture(scope="module")
def composed(tiny_policy):  # noqa: F811
    return compose_mempo_config([
        f"actor_rollout_ref.model.path={tiny_policy}",
        "data.train_files=data/prepared/train.parquet",
        "data.val_files=data/prepared/val.parquet",
    ])


def test_hydra_composes_overlay_over_verl_defaults_and_verl_validation_passes(composed):
    from omegaconf import OmegaConf
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import HFModelConfig, RolloutConfig

    cfg = composed
    # verl's own validation, as main_ppo runs it before starting Ray
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert need_reference_policy(cfg) and not need_critic(cfg)  # KL loss needs the ref; GRPO has no critic
    # the typed sections verl builds from the config accept our values
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert isinstance(rollout, RolloutConfig) and rollout.name == "sglang" and rollout.n == 5
    assert rollout.multi_turn.enable and rollout.multi_turn.max_assistant_turns == cfg.mempo.max_turns
    assert rollout.agent.default_agent_loop == "mem_agent"
    algo = omega_conf_to_dataclass(cfg.algorithm)
    assert isinstance(algo, AlgoConfig) and algo.adv_estimator == "mempo"
    model = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    assert isinstance(model, HFModelConfig) and model.tokenizer is not None
    # only the deltas changed; verl's defaults are still there
    assert cfg.trainer.use_v1 is True and cfg.trainer.v1.trainer_mode == "mempo_sync"
    assert list(cfg.trainer.logger) == ["console", "mlflow"]
    assert cfg.trainer.resume_mode == "auto"
    assert cfg.actor_rollout_ref.actor.kl_loss_type == "low_var_kl" and cfg.actor_rollout_ref.actor.use_kl_loss
    assert cfg.actor_rollout_ref.actor.clip_ratio_c == 3.0  # untouched verl default
    resolved = OmegaConf.to_container(cfg.reward.custom_reward_function, resolve=True)
    assert resolved["reward_kwargs"] == {"multi_rule": "all", "format_rule": "strict", "format_penalty": 0.0,
                                        "no_answer_penalty": 0.0}


def test_model_path_and_data_are_parameters_not_verl_example_defaults():
    cfg = compose_mempo_config()
    assert cfg.actor_rollout_ref.model.path is None  # not verl's example model
    assert cfg.data.train_files is None and cfg.data.val_files is None


def test_config_names_resolve_to_mempo_components(composed):
    from verl.tools.tool_registry import load_all_tools
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls

    from mempo.verl_plugin.estimator import mempo_outcome_advantage
    from mempo.verl_plugin.tool import RetrievalTool
    from mempo.verl_plugin.trainer import MempoTrainerSync

    trainer_cls = get_trainer_cls(composed.trainer.v1.trainer_mode)
    assert trainer_cls is MempoTrainerSync and issubclass(trainer_cls, PPOTrainerSync)
    assert get_adv_estimator_fn(composed.algorithm.adv_estimator) is mempo_outcome_advantage
    tools = load_all_tools(str(CONFIG_DIR / "retrieval_tool.yaml"), None)
    assert len(tools) == 1 and isinstance(tools[0], RetrievalTool)
    assert tools[0].settings.timeout_s == 10.0 and tools[0].settings.topk == 3
    fn = get_custom_reward_fn(composed)
    assert fn is not None
    turns = ["<mem> x </mem> <answer> Paris </answer>"]
    assert fn(data_source="world", solution_str=turns[0], ground_truth=["Paris"], extra_info={}) == 1.0


def test_trainer_reads_sync_mode_for_verl_branches():
    from mempo.verl_plugin.trainer import MempoTrainerSync

    trainer = MempoTrainerSync.__new__(MempoTrainerSync)
    trainer.trainer_mode = "mempo_sync"  # what PPOTrainer.__init__ assigns from the config
    assert trainer.trainer_mode == "sync"
    assert trainer.registered_mode == "mempo_sync"


def _reward_row(tokenizer, final_text: str, gold: list[str], outcome: dict):
    """One trajectory's last output as verl's `_compute_score` hands it to the reward loop
    (`outcome`: the extra fields `mem_agent` writes on it)."""
    from tensordict import TensorDict
    from verl.protocol import DataProto

    prompt = torch.tensor(tokenizer.encode("Question: q", add_special_tokens=False))
    response = torch.tensor(tokenizer.encode(final_text, add_special_tokens=False))
    ids = torch.cat([prompt, response])
    batch = TensorDict({
        "prompts": prompt[None], "responses": response[None], "input_ids": ids[None],
        "attention_mask": torch.ones_like(ids)[None], "position_ids": torch.arange(len(ids))[None],
    }, batch_size=1)
    non_tensor = {
        "data_source": np.array(["world"], dtype=object),
        "reward_model": np.array([{"ground_truth": np.array(gold, dtype=object), "style": "rule"}], dtype=object),
        "extra_info": np.array([{"question": "q"}], dtype=object),
        "tool_extra_fields": np.array([dict(outcome)], dtype=object),
        "__num_turns__": np.array([2]),
    }
    return DataProto(batch=batch, non_tensor_batch=non_tensor)


def test_reward_function_through_verls_reward_loop(composed, tiny_policy):  # noqa: F811
    """verl's naive reward manager (the reward loop's default) calling our custom_reward_function."""
    from transformers import AutoTokenizer
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    manager = NaiveRewardManager(composed, tok, get_custom_reward_fn(composed))
    first = "<mem> nothing yet </mem> <think> look it up </think> <search> capital of X </search>"
    final = "<mem> capital of X is Paris </mem> <think> done </think> <answer> Paris </answer>"

    def score(final_text, gold, outcome):
        # the manager binds verl's worker event loop at construction; run on that loop
        return manager.loop.run_until_complete(manager.run_single(_reward_row(tok, final_text, gold, outcome)))

    # mem_agent's outcome of the episode `first`, `final` (both turns valid, answer Paris)
    outcome = {"mempo_final_answer": "Paris", "mempo_format_valid": True}
    right = score(final, ["Paris"], outcome)
    assert right["reward_score"] == 1.0
    assert score(final, ["Lyon"], outcome)["reward_score"] == 0.0
    # an earlier turn without <mem> breaks the episode's format: strict rule gives 0, though
    # the last response alone is well formed (the reward reads the outcome, not the text)
    assert score(final, ["Paris"], {**outcome, "mempo_format_valid": False})["reward_score"] == 0.0
    assert score(first, ["Paris"], outcome)["reward_score"] == 1.0
    # without the outcome (a plain single-turn agent) the decoded last response is scored
    assert score(final, ["Paris"], {})["reward_score"] == 1.0
    assert score(first, ["Paris"], {})["reward_score"] == 0.0
    # mempo.no_answer_penalty reaches the reward through reward_kwargs: an episode stopped at
    # the turn limit (no final answer) scores below a wrong answer
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(composed, resolve=False))
    cfg.mempo.no_answer_penalty = 0.5
    pen = NaiveRewardManager(cfg, tok, get_custom_reward_fn(cfg))
    stopped = {"mempo_final_answer": None, "mempo_format_valid": False, "mempo_termination": "turn_limit"}
    row = _reward_row(tok, first, ["Paris"], stopped)
    assert pen.loop.run_until_complete(pen.run_single(row))["reward_score"] == -0.5
    assert score(first, ["Paris"], stopped)["reward_score"] == 0.0  # the default: a wrong answer's 0
    wrong = _reward_row(tok, final, ["Lyon"], outcome)
    assert pen.loop.run_until_complete(pen.run_single(wrong))["reward_score"] == 0.0


def test_required_verl_pin_matches_installed():
    import verl

    pin = (CONFIG_DIR / "REQUIRED_VERL.txt").read_text().splitlines()[0].strip()
    assert pin == f"verl=={verl.__version__}"
    assert Path(CONFIG_DIR / "mempo_trainer.yaml").read_text().count("- ppo_trainer") == 1
