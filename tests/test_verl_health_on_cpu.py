"""Rollout health on the verl path: retrieval failures and missing rollout sessions are
counted per step, logged, and stop the run past their limits (mempo.verl_plugin.health), and
the trainer's progress file is what the RayJob step reads while it waits."""

from __future__ import annotations

import pytest
from verl_cpu_helpers import compose_mempo_config, tiny_policy  # noqa: F401

from mempo.verl_plugin.health import (
    HealthLimits,
    RolloutHealthError,
    check_rollout_health,
    rollout_health,
)


def _rows(spec: dict[str, dict[int, list[dict]]]) -> tuple[list[str], list[dict]]:
    keys, extras = [], []
    for uid, sessions in spec.items():
        for session, turns in sessions.items():
            for t, extra in enumerate(turns):
                keys.append(f"{uid}_{session}_{t}")
                extras.append(extra)
    return keys, extras


SEARCH_OK = {"tool_called": True, "tool_ok": True}
SEARCH_FAILED = {"tool_called": True, "tool_ok": False}
ANSWER = {"tool_called": False, "tool_ok": True}


def test_counts_tool_failures_missing_sessions_and_turns():
    # uid "q_1" holds an underscore (verl's uids may); session 2 of it never came back
    keys, extras = _rows({
        "q_1": {0: [SEARCH_OK, ANSWER], 1: [SEARCH_FAILED, SEARCH_FAILED, {**ANSWER, "logprobs_filled": 1}]},
        "q2": {0: [SEARCH_OK, ANSWER], 1: [ANSWER], 2: [SEARCH_FAILED, ANSWER]},
    })
    keys.append("padXYZ_0_0")
    extras.append(SEARCH_FAILED)  # a padding row: ignored
    h = rollout_health(keys, extras, n_rollouts=3, is_padding=[False] * (len(keys) - 1) + [True])
    assert h["mempo/tool_calls"] == 5 and h["mempo/tool_failures"] == 3
    assert h["mempo/tool_failure_rate"] == pytest.approx(0.6)
    assert h["mempo/sessions"] == 5 and h["mempo/failed_sessions"] == 1
    assert h["mempo/failed_session_rate"] == pytest.approx(1 / 6)
    assert h["mempo/turns_per_episode"] == pytest.approx(10 / 5)
    assert h["mempo/logprobs_filled"] == 1
    # a prompt whose every session failed has no rows at all: the step's prompt count finds it
    h3 = rollout_health(keys[:-1], extras[:-1], n_rollouts=3, n_prompts=3)
    assert h3["mempo/failed_sessions"] == 4 and h3["mempo/prompts"] == 3


def test_limits_stop_the_run_only_past_the_rate_and_with_enough_samples():
    keys, extras = _rows({f"q{i}": {0: [SEARCH_FAILED, ANSWER], 1: [SEARCH_OK, ANSWER]} for i in range(20)})
    h = rollout_health(keys, extras, n_rollouts=2)
    assert h["mempo/tool_failure_rate"] == 0.5
    with pytest.raises(RolloutHealthError, match="20 of 40 retrieval calls failed.*retriever reachable"):
        check_rollout_health(h, HealthLimits(max_tool_failure_rate=0.2, min_health_samples=32))
    check_rollout_health(h, HealthLimits(max_tool_failure_rate=0.2, min_health_samples=41))  # too few to judge
    check_rollout_health(h, HealthLimits(max_tool_failure_rate=0.5, min_health_samples=32))  # at the limit
    missing = rollout_health(keys, extras, n_rollouts=4)  # half the sessions never came back
    with pytest.raises(RolloutHealthError, match="40 of 80 rollout sessions are missing"):
        check_rollout_health(missing, HealthLimits(max_tool_failure_rate=1.0))


def test_trainer_checks_health_with_its_config_limits(tiny_policy):  # noqa: F811
    from mempo.verl_plugin.trainer import MempoTrainerSync

    trainer = MempoTrainerSync.__new__(MempoTrainerSync)
    trainer.config = compose_mempo_config([f"actor_rollout_ref.model.path={tiny_policy}",
                                           "actor_rollout_ref.rollout.n=2", "data.train_batch_size=20",
                                           "mempo.max_tool_failure_rate=0.4"])
    keys, extras = _rows({f"q{i}": {0: [SEARCH_FAILED, ANSWER], 1: [SEARCH_OK, ANSWER]} for i in range(20)})
    metrics: dict = {}
    with pytest.raises(RolloutHealthError, match="max_tool_failure_rate 0.4"):
        trainer._check_health(keys, extras, [False] * len(keys), metrics)
    assert metrics["mempo/tool_failure_rate"] == 0.5  # logged before stopping
    healthy = [SEARCH_OK if e is SEARCH_FAILED else e for e in extras]
    trainer._check_health(keys, healthy, [False] * len(keys), metrics)
    assert metrics["mempo/tool_failure_rate"] == 0.0 and trainer._mempo_health["mempo/failed_sessions"] == 0


def test_progress_file_round_trip_with_the_rayjob_reader(tmp_path):
    from mempo.orchestration.rayjob import read_progress
    from mempo.verl_plugin.trainer import write_progress

    path = tmp_path / "verl" / "progress.json"
    assert read_progress(path) is None
    write_progress(path, 7, 200, {"mempo/tool_failure_rate": 0.01})
    info = read_progress(path)
    assert info["step"] == 7 and info["total"] == 200 and info["health"]["mempo/tool_failure_rate"] == 0.01
    (tmp_path / "ro").write_text("a file where a folder should be")
    write_progress(tmp_path / "ro" / "progress.json", 1, 1, None)  # logged, never raised
