"""One `rollout:` section that `train:` and `eval:` override field by field (issue 16), the
errors for the keys that moved, and the plain dataclasses derived from the params models."""

from __future__ import annotations

from pathlib import Path

import pytest

from mempo.config import RENAMED, EvalParams, RolloutParams, TrainParams, load_params
from mempo.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_moved_key_is_an_error_naming_the_field_and_its_new_spelling(old: str, tmp_path: Path) -> None:
    new = RENAMED[old].split(" ")[0]
    value = {"context": "full"} if old == "agent" else 1
    with pytest.raises(ConfigError) as err:
        load_params(None, {old: value})
    assert err.value.field == old and f"`{new}`" in str(err.value)
    # ... and in a params file, the error names the file too
    *parents, leaf = old.split(".")
    text = "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parents)) + f"{'  ' * len(parents)}{leaf}: 1\n"
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(ConfigError, match="p.yaml") as err:
        load_params(tmp_path / "p.yaml")
    assert err.value.field == old and f"`{new}`" in str(err.value)


def test_params_yaml_keeps_the_effective_values_of_before() -> None:
    """The values the three spellings had (agent:, train.max_*, eval.max_*) before the merge."""
    p = load_params(REPO / "params.yaml")
    ev, tr = p.eval.rollout_params(), p.train.rollout_params()
    assert (ev.turns_per_objective, ev.max_turns) == (6, 24)  # 6 per objective, capped at 24
    assert (ev.observation_max_tokens, tr.observation_max_tokens) == (256, 512)
    assert (ev.max_new_tokens, tr.max_new_tokens, p.rollout.max_new_tokens) == (192, 192, 512)
    assert (ev.temperature, tr.temperature) == (0.0, 1.0)
    assert (ev.max_prompt_tokens, tr.max_prompt_tokens) == (4096, 0)
    assert (ev.max_concurrent_episodes, tr.max_concurrent_episodes) == (32, 64)
    assert (tr.turns_per_objective, tr.max_turns, ev.topk, tr.topk) == (6, 24, 3, 3)
    assert p.mempo.lambda_mem == 0.5 and p.verl.lambda_mem is None


def test_eval_and_train_inherit_rollout_unless_they_set_a_field() -> None:
    p = load_params(None, {"rollout.topk": 5, "rollout.max_turns": 30, "rollout.observation_max_tokens": 100})
    ev, tr = p.eval.rollout_params(), p.train.rollout_params()
    assert ev.topk == tr.topk == 5 and ev.max_turns == tr.max_turns == 30
    # eval sets observation_max_tokens itself: rollout's value does not reach it
    assert ev.observation_max_tokens == 256 and tr.observation_max_tokens == 100
    p = load_params(None, {"eval.rollout.topk": 7, "eval.rollout.observation_max_tokens": None,
                           "train.rollout.max_turns": 3})
    assert p.eval.rollout_params().topk == 7 and p.train.rollout_params().topk == 3
    assert p.train.rollout_params().max_turns == 3 and p.eval.rollout_params().max_turns == 24
    # a partial block keeps the stage's other overrides (not the whole block's defaults)
    p = load_params(None, {"eval.rollout.temperature": 0.5})
    assert p.eval.rollout_params().temperature == 0.5 and p.eval.rollout_params().observation_max_tokens == 256
    # explicit null inherits
    p = load_params(None, {"eval.rollout": {"observation_max_tokens": None}})
    assert p.eval.rollout_params().observation_max_tokens == 512


def test_override_blocks_keep_the_rollout_constraints() -> None:
    with pytest.raises(ConfigError, match="eval.rollout.max_turns"):
        load_params(None, {"eval.rollout.max_turns": 0})
    with pytest.raises(ConfigError, match="train.rollout.context"):
        load_params(None, {"train.rollout.context": "partial"})
    with pytest.raises(ConfigError, match="eval.rollout.nope"):
        load_params(None, {"eval.rollout.nope": 1})


def test_a_section_on_its_own_inherits_the_rollout_defaults() -> None:
    assert EvalParams().rollout_params().max_turns == RolloutParams().max_turns
    assert TrainParams().rollout_params().max_new_tokens == 192


def test_plain_configs_derive_from_the_rollout_params_and_their_defaults_agree() -> None:
    from dataclasses import fields

    from mempo.agent.rollout import RolloutConfig
    from mempo.agent.tools import ToolConfig

    r = RolloutParams()
    assert ToolConfig.from_params(r) == ToolConfig()
    built = RolloutConfig.from_params(r)
    for f in fields(RolloutConfig):
        assert getattr(built, f.name) == getattr(r, f.name)
        # by hand it is one fixed 8-turn limit; every other default is the params default
        if f.name not in ("max_turns", "turns_per_objective"):
            assert getattr(RolloutConfig(), f.name) == getattr(r, f.name), f.name


def test_eval_settings_have_no_defaults_of_their_own() -> None:
    from mempo.evaluation.settings import EvalSettings

    s = EvalSettings.from_params(EvalParams())
    assert s.rollout.max_concurrent_episodes == 32  # EvalParams' value, not a mirror's 16
    assert s.rollout_config().turn_budget(2) == 12 and s.tool_config().observation_max_tokens == 256
    with pytest.raises(TypeError):
        EvalSettings()  # type: ignore[call-arg]
