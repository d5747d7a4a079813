"""Promote a model version through the gate: `@challenger`, evidence tags, then `@champion`.

    mempo promote --model mempo-agent            # prints the decision as JSON

`promote` takes the newest version (or the one given), points `@challenger` at it and compares
it with `@champion` through `mempo.registry.gate.evaluate_gate`. The checks are written as
`promotion.*` tags on the challenger version whatever the outcome; `@champion` moves only when
all pass. Only aliases are used, never the deprecated stages. Promotions of one model are
serialised by `mempo.registry.store.promotion_lock`; a second promotion of the same version
is a no-op.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mempo.errors import MempoError
from mempo.registry.evidence import version_eval_sets, version_metrics
from mempo.registry.gate import GateConfig, evaluate_gate
from mempo.registry.store import mlflow_client, promotion_lock

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION = "champion"
CHALLENGER = "challenger"


@dataclass(frozen=True)
class PromotionDecision:
    """What `promote` decided and why (also written as `promotion.*` version tags)."""

    model: str
    challenger_version: str
    champion_version: str | None
    promoted: bool
    already_champion: bool
    checks: list[dict[str, Any]]
    primary_metric: str
    primary_delta: float | None
    decided_at: str

    def summary(self) -> str:
        verdict = "PROMOTED" if self.promoted else "REJECTED"
        if self.already_champion:
            verdict = "ALREADY CHAMPION"
        vs = f"champion v{self.champion_version}" if self.champion_version else "no champion"
        fails = [f"{c['name']} ({c['detail']})" for c in self.checks if not c["passed"]]
        why = "; failed: " + "; ".join(fails) if fails else ""
        return f"{self.model} v{self.challenger_version} vs {vs}: {verdict}{why}"


def has_version(name: str, version: str | int) -> bool:
    """Whether this tracking store has version `version` of model `name`."""
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client().get_model_version(name, str(version))
    except MlflowException:
        return False
    return True


def _newest_version(client: MlflowClient, name: str) -> str:
    versions = client.search_model_versions(f"name = '{name}'")
    if not versions:
        raise MempoError(f"model '{name}' has no registered versions (run `mempo register` first)")
    return str(max(int(v.version) for v in versions))


def _alias_version(client: MlflowClient, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def promote(
    name: str,
    gate: GateConfig,
    *,
    version: str | int | None = None,
    out: str | Path | None = None,
    lock_wait_s: float = 120.0,
) -> PromotionDecision:
    """Gate version `version` (default: the newest) of model `name` against `@champion`.

    Sets `@challenger`, writes the evidence as `promotion.*` tags on that version, and moves
    `@champion` only when `evaluate_gate` passes. Idempotent: if the version already is the
    champion nothing changes. Writes the decision JSON to `out` when given.
    """
    from mempo.io import write_json
    from mempo.tracking import log_json, stage_run

    client = mlflow_client()
    with promotion_lock(client, name, wait_s=lock_wait_s):
        challenger_v = str(version) if version is not None else _newest_version(client, name)
        challenger = client.get_model_version(name, challenger_v)
        champion_v = _alias_version(client, name, CHAMPION)
        now = datetime.now(UTC).isoformat(timespec="seconds")
        if champion_v == challenger_v:
            decision = PromotionDecision(
                name, challenger_v, champion_v, True, True,
                json.loads(challenger.tags.get("promotion.checks", "[]")), gate.primary_metric,
                None, challenger.tags.get("promotion.decided_at", now),
            )
        else:
            client.set_registered_model_alias(name, CHALLENGER, challenger_v)
            champion = client.get_model_version(name, champion_v) if champion_v else None
            result = evaluate_gate(
                version_metrics(challenger, client),
                version_metrics(champion, client) if champion is not None else None, gate,
                challenger_sets=version_eval_sets(challenger),
                champion_sets=version_eval_sets(champion) if champion is not None else None,
            )
            checks = [asdict(c) for c in result.checks]
            evidence = {
                "promotion.decision": "promoted" if result.passed else "rejected",
                "promotion.champion_version": champion_v or "none",
                "promotion.primary_metric": gate.primary_metric,
                "promotion.primary_delta": "none" if result.primary_delta is None else repr(result.primary_delta),
                "promotion.checks": json.dumps(checks, sort_keys=True),
                "promotion.gate": gate.to_json(),
                "promotion.decided_at": now,
            }
            # Evidence first: a crash after this still leaves the reasons on the version.
            for k, v in evidence.items():
                client.set_model_version_tag(name, challenger_v, k, v[:5000])
            if result.passed:
                client.set_registered_model_alias(name, CHAMPION, challenger_v)
                client.delete_registered_model_alias(name, CHALLENGER)
                if champion_v:
                    client.set_model_version_tag(name, champion_v, "promotion.superseded_by", challenger_v)
            decision = PromotionDecision(
                name, challenger_v, champion_v, result.passed, False, checks,
                gate.primary_metric, result.primary_delta, now,
            )
    with stage_run("promote", tags={"mempo.model_name": name,
                                     "promotion.decision": "promoted" if decision.promoted else "rejected",
                                     "promotion.challenger_version": challenger_v}):
        log_json(asdict(decision), "promotion.json")
    if out is not None:
        write_json(out, asdict(decision))
    return decision
