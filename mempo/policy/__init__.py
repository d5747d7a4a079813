"""Policies the trainers start from: the offline tiny model, SmolLM2 from GGUF, or a base model.

See `mempo.policy.bootstrap` and `mempo.policy.tiny` (run with `mempo policy bootstrap --help`).
"""

from mempo.policy.bootstrap import (
    POLICY_MANIFEST,
    bootstrap_policy,
    bootstrap_smollm2,
    check_base_model,
    find_smollm2_gguf,
    resolve_policy_path,
)
from mempo.policy.tiny import TinyPolicySpec, bootstrap_tiny

__all__ = [
    "POLICY_MANIFEST",
    "TinyPolicySpec",
    "bootstrap_policy",
    "bootstrap_smollm2",
    "bootstrap_tiny",
    "check_base_model",
    "find_smollm2_gguf",
    "resolve_policy_path",
]
