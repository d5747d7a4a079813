"""MemPO as a verl 0.9 plug-in: no fork, only verl's own registries.

verl imports every entry point of the group `verl.plugins` when `verl` itself is imported
(in the driver and in every Ray worker), so installing this package is enough:

    [project.entry-points."verl.plugins"]
    mempo = "mempo.verl_plugin"

Importing this package registers

- `algorithm.adv_estimator=mempo`        (`mempo.verl_plugin.estimator`, verl's `register_adv_est`)
- `trainer.v1.trainer_mode=mempo_sync`   (`mempo.verl_plugin.trainer`, verl's `register_trainer`)
- agent loop `mem_agent`                 (`mempo.verl_plugin.agent_loop`, verl's agent-loop `register`)

and ships the retrieval `BaseTool` (`mempo.verl_plugin.tool.RetrievalTool`, named in the
tool config `configs/verl/retrieval_tool.yaml`) and the reward entry point
(`reward.custom_reward_function.path=pkg://mempo.verl_plugin.reward`).

verl 0.9.1 logs a plug-in that fails to import at DEBUG level and carries on, so a broken
install would silently train plain GRPO. This module therefore logs the failure at ERROR
(with the traceback, also on stderr) before re-raising, and `registration_status()` lets
tests and the launcher check that every registration happened:

    python -c "import verl, mempo.verl_plugin as p; print(p.registration_status())"
"""

from __future__ import annotations

import logging
import sys
import traceback

log = logging.getLogger(__name__)

ADV_ESTIMATOR_NAME = "mempo"
TRAINER_NAME = "mempo_sync"
AGENT_LOOP_NAME = "mem_agent"


def _register_all() -> None:
    """Import the modules whose decorators register MemPO's pieces in verl's registries."""
    from mempo.verl_plugin import agent_loop, estimator, trainer  # noqa: F401


def registration_status() -> dict[str, bool]:
    """Whether each MemPO name is present in verl's registries (in this process)."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    return {
        f"adv_estimator:{ADV_ESTIMATOR_NAME}": ADV_ESTIMATOR_NAME in ADV_ESTIMATOR_REGISTRY,
        f"trainer:{TRAINER_NAME}": TRAINER_NAME in TRAINER_REGISTRY,
        f"agent_loop:{AGENT_LOOP_NAME}": AGENT_LOOP_NAME in _agent_loop_registry,
    }


def assert_registered() -> None:
    """Raise RuntimeError naming every MemPO registration missing from verl."""
    missing = [name for name, ok in registration_status().items() if not ok]
    if missing:
        raise RuntimeError(
            f"MemPO verl plug-in not registered: {', '.join(missing)} "
            "(is mempo-pipeline installed in this environment? check `pip show mempo-pipeline`)"
        )


try:
    _register_all()
except Exception:
    # verl swallows this at DEBUG; make it impossible to miss.
    message = "mempo.verl_plugin failed to import: MemPO is NOT registered in verl"
    log.error(message, exc_info=True)
    print(f"ERROR {message}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    raise
