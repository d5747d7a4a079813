"""Classes built from a params section take their defaults from it: `TinyPolicySpec` from
`policy:` (`PolicyParams`), `GateConfig` from `promote:` (`PromoteParams`)."""

from __future__ import annotations

from dataclasses import asdict, fields

from mempo.config import PolicyParams, PromoteParams, load_params
from mempo.policy.tiny import TinyPolicySpec
from mempo.registry.gate import GateConfig, gate_from_params


def test_tiny_policy_spec_defaults_are_the_policy_section_defaults() -> None:
    assert TinyPolicySpec() == TinyPolicySpec.from_params(PolicyParams())
    defaults = PolicyParams()
    for f in fields(TinyPolicySpec):
        assert getattr(TinyPolicySpec(), f.name) == getattr(defaults, f.name), f.name


def test_tiny_policy_spec_from_params_yaml() -> None:
    policy = load_params(None, {"policy.copy_steps": 7, "policy.hidden_size": 64}).policy
    spec = TinyPolicySpec.from_params(policy)
    assert spec.copy_steps == 7 and spec.hidden_size == 64 and spec.vocab_size == policy.vocab_size


def test_gate_config_defaults_are_the_promote_section_defaults() -> None:
    assert GateConfig() == GateConfig.from_params(PromoteParams())
    defaults = PromoteParams().model_dump()
    for name, value in asdict(GateConfig()).items():
        expected = defaults[name]
        assert (list(value) if isinstance(value, tuple) else value) == expected, name


def test_gate_config_from_params_keeps_the_gate_keys_only() -> None:
    promote = load_params(None, {"promote.min_eval_n": 5, "promote.floors": {"memory/world/em": 0.2}}).promote
    gate = GateConfig.from_params(promote)
    assert gate.min_eval_n == 5 and dict(gate.floors) == {"memory/world/em": 0.2}
    assert gate.guard_metrics == tuple(promote.guard_metrics)
    assert gate_from_params(promote) == gate == GateConfig.from_params(promote.model_dump())
