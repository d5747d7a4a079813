"""dvc.yaml lists the exact params keys each stage reads (its header promises it): every
listed key exists in params.yaml, and no stage lists a whole section."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _stages() -> dict:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def test_every_listed_params_key_exists_in_params_yaml() -> None:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    missing = []
    for name, stage in _stages().items():
        for key in stage.get("params", []):
            cur = params
            for part in str(key).split("."):
                if not isinstance(cur, dict) or part not in cur:
                    missing.append(f"{name}: {key}")
                    break
                cur = cur[part]
    assert missing == []


def test_no_stage_lists_a_whole_section() -> None:
    whole = [f"{name}: {key}" for name, stage in _stages().items() for key in stage.get("params", [])
             if "." not in str(key)]
    assert whole == []


def test_stages_that_run_episodes_list_every_rollout_key_they_read() -> None:
    """`rollout:` is read through `train:`/`eval:` inheritance; a stage that runs episodes
    must re-run when any of it changes (except keys its command line pins)."""
    rollout = set(yaml.safe_load((REPO / "params.yaml").read_text())["rollout"])
    for name, pinned in (("train", set()), ("sft", set()), ("train_full", {"context"}),
                         ("sft_full", {"context"}), ("eval", {"context"})):
        listed = {k.removeprefix("rollout.") for k in _stages()[name]["params"] if k.startswith("rollout.")}
        assert listed == rollout - pinned, name
