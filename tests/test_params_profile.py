"""Params profiles: `params.tiny.yaml` holds only the keys it changes, and
`mempo pipeline run --params FILE` writes them into params.yaml (comments kept, validated first)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from mempo.config import load_params, params_flat, profile_overrides
from mempo.errors import ConfigError
from mempo.pipeline import TINY_PROFILE, apply_params_profile, write_params_with

REPO = Path(__file__).resolve().parents[1]


def _project(tmp_path: Path) -> Path:
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copy(REPO / TINY_PROFILE, tmp_path / TINY_PROFILE)
    return tmp_path


def test_tiny_profile_is_dotted_overrides_that_validate() -> None:
    tiny = profile_overrides(REPO / TINY_PROFILE)
    assert tiny["world.size"] == "tiny"
    assert tiny["train.rollout.max_turns"] == 2 and tiny["eval.rollout.turns_per_objective"] == 2
    assert tiny["promote.floors"] == {}  # a mapping-valued setting is one override, replaced whole
    assert tiny["data.compositions"] == [{"k": 1, "share": 1.0}]
    params = load_params(REPO / "params.yaml", overrides=tiny)
    assert params.promote.floors == {} and params.train.rollout_params().max_turns == 2
    assert params.eval.rollout_params().max_turns == load_params(REPO / "params.yaml").rollout.max_turns


def test_a_profile_with_an_unknown_or_moved_key_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "typo.yaml").write_text("train:\n  stepz: 1\n")
    with pytest.raises(ConfigError, match=r"typo\.yaml.*train\.stepz"):
        profile_overrides(tmp_path / "typo.yaml")
    (tmp_path / "old.yaml").write_text("agent:\n  max_turns: 2\n")
    with pytest.raises(ConfigError, match="write `rollout`"):
        profile_overrides(tmp_path / "old.yaml")


def test_writing_nothing_keeps_params_yaml_byte_for_byte(tmp_path: Path) -> None:
    out = write_params_with(REPO / "params.yaml", tmp_path / "p.yaml", {})
    assert out.read_text() == (REPO / "params.yaml").read_text()


def test_apply_profile_writes_its_values_into_params_yaml_and_keeps_comments(tmp_path: Path) -> None:
    root = _project(tmp_path)
    changed = apply_params_profile(root, TINY_PROFILE)
    text = (root / "params.yaml").read_text()
    expected = params_flat(load_params(REPO / "params.yaml", overrides=profile_overrides(REPO / TINY_PROFILE)))
    assert params_flat(load_params(root / "params.yaml")) == expected
    assert "world.size" in changed and "promote.floors.memory/world/em" in changed
    assert "# One section per stage; every seed explicit." in text
    assert "max_turns: 24        # turns before an episode is cut" in text
    assert "size: tiny" in text and yaml.safe_load(text)["promote"]["floors"] == {}
    # only the profile's lines differ
    before = (REPO / "params.yaml").read_text().splitlines()
    assert len(set(text.splitlines()) ^ set(before)) < 4 * len(profile_overrides(REPO / TINY_PROFILE))
    # applying it again changes nothing
    assert apply_params_profile(root, TINY_PROFILE) == []
    assert (root / "params.yaml").read_text() == text


def test_apply_a_bad_profile_leaves_params_yaml_alone(tmp_path: Path) -> None:
    root = _project(tmp_path)
    (root / "bad.yaml").write_text("eval:\n  rollout:\n    max_turns: 0\n")
    with pytest.raises(ConfigError, match="eval.rollout.max_turns"):
        apply_params_profile(root, "bad.yaml")
    assert (root / "params.yaml").read_text() == (REPO / "params.yaml").read_text()


def test_pipeline_run_takes_a_params_profile() -> None:
    from mempo.cli import build_parser

    args = build_parser().parse_args(["pipeline", "run", "--params", TINY_PROFILE, "eval"])
    assert args.params == TINY_PROFILE and args.targets == ["eval"]
