"""The verl Hydra `mempo:` block is generated from the params models (mempo.config.hydra), and
the plug-in's plain settings classes agree with them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from mempo.config import Params, RolloutParams
from mempo.config.hydra import HYDRA_MEMPO_KEYS, hydra_mempo_values, with_generated_block

REPO = Path(__file__).resolve().parents[1]
TRAINER_YAML = REPO / "configs" / "verl" / "mempo_trainer.yaml"


def test_the_committed_hydra_block_is_the_generated_one() -> None:
    text = TRAINER_YAML.read_text()
    assert text == with_generated_block(text), "run: python -m mempo.config.hydra configs/verl/mempo_trainer.yaml"
    assert yaml.safe_load(text)["mempo"] == hydra_mempo_values(Params())


def test_the_plugin_settings_default_to_the_params_defaults() -> None:
    from mempo.verl_plugin.advantage import MempoAdvantageConfig
    from mempo.verl_plugin.agent_loop import MemAgentSettings
    from mempo.verl_plugin.tool import RetrievalToolConfig

    section = hydra_mempo_values(Params())
    for cls in (MempoAdvantageConfig, MemAgentSettings):
        assert cls() == cls.from_mapping(section), cls.__name__
        assert {f.name for f in dataclasses.fields(cls)} <= set(HYDRA_MEMPO_KEYS), cls.__name__
    rollout = RolloutParams()
    tool = RetrievalToolConfig()
    shipped = RetrievalToolConfig.from_mapping(yaml.safe_load(
        (REPO / "configs" / "verl" / "retrieval_tool.yaml").read_text())["tools"][0]["config"])
    for name in ("topk", "observation_max_tokens", "access_chunk_chars", "short_text_chars"):
        assert getattr(tool, name) == getattr(rollout, name) == getattr(shipped, name), name


def test_verl_lambda_mem_wins_over_mempo_lambda_mem() -> None:
    from mempo.config import load_params

    assert hydra_mempo_values(load_params(None, {"mempo.lambda_mem": 0.3}))["lambda_mem"] == 0.3
    assert hydra_mempo_values(load_params(None, {"mempo.lambda_mem": 0.3, "verl.lambda_mem": 0.0}))["lambda_mem"] == 0.0
