"""The verl Hydra config's `mempo:` block, generated from the params models.

The plug-in (`mempo.verl_plugin`) reads its settings from the Hydra `mempo:` section of
configs/verl/mempo_trainer.yaml; the launcher (`mempo train verl`) fills it from params.yaml.
Both use `HYDRA_MEMPO_KEYS` below, and the committed block is what `hydra_mempo_block()`
writes from the params defaults (tests/test_config_hydra.py fails when they drift). After
changing a default or a key here, regenerate it:

    python -m mempo.config.hydra configs/verl/mempo_trainer.yaml
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Hydra `mempo.<key>` -> (params section, field, the comment written above it).
HYDRA_MEMPO_KEYS: dict[str, tuple[str, str, str]] = {
    "lambda_mem": ("mempo", "lambda_mem", "weight of the memory advantage A^M on <mem> tokens (params: mempo.lambda_mem, "
                                          "or verl.lambda_mem when set)"),
    "eps": ("mempo", "eps", "memory-reward baseline: full_context (the method's) | previous | none"),
    "form": ("mempo", "form", "logprob (the method's): mean log P(a*|q,mem_t) - mean log P(a*|full history) | "
                              "prob (ablation)"),
    "norm_by_std": ("mempo", "norm_by_std", "divide A^T and A^M by the group std"),
    "mem_adv_group": ("mempo", "mem_adv_group", "normalise A^M within (prompt group, turn index): per_turn | per_group"),
    "adv_eps": ("mempo", "adv_eps", "added to the std in both normalisations"),
    "mem_adv_min_std": ("mempo", "mem_adv_min_std", "floor of the std that divides A^M: memories that all score "
                                                    "about the same get A^M ~ 0"),
    "final_memory": ("mempo", "final_memory", "score | skip: each episode's last memory (read by no later turn) "
                                              "gets no A^M and is left out of its normalisation | closing: the "
                                              "last memories of episodes that answered normalised among "
                                              "their task's"),
    "rm_max": ("mempo", "rm_max", "upper bound of the memory reward R^M (null = none); 0 with eps full_context: a "
                                  "memory can lose against the history it replaces, never gain"),
    "max_turns": ("rollout", "max_turns", "turns per episode (params: rollout.max_turns)"),
    "max_new_tokens": ("rollout", "max_new_tokens", "tokens generated per turn (params: rollout.max_new_tokens); "
                                                    "also capped by data.max_response_length"),
    "check_masks": ("rollout", "check_masks", "verify each <mem> token mask decodes to the memory text"),
    "probe_concurrency": ("verl", "probe_concurrency", "memory-probe requests in flight per agent-loop worker, all "
                          "its episodes together (each is a full prefill with full-vocabulary prompt log-probs: "
                          "SGLang cannot reuse the prefix cache for them); params: verl.probe_concurrency"),
    "max_tool_failure_rate": ("verl", "max_tool_failure_rate", "rollout health, checked every step by the "
                              "mempo_sync trainer (params: verl.*): abort when more retrieval calls fail, or more "
                              "rollout sessions are missing, than these fractions (judged over at least "
                              "min_health_samples calls / sessions)"),
    "max_failed_session_rate": ("verl", "max_failed_session_rate", ""),
    "min_health_samples": ("verl", "min_health_samples", ""),
    "multi_rule": ("mempo", "multi_rule", "reward kwargs of mempo.rewards.compute_score"),
    "format_rule": ("mempo", "format_rule", ""),
    "format_penalty": ("mempo", "format_penalty", ""),
    "no_answer_penalty": ("mempo", "no_answer_penalty", ""),
}
BEGIN = "# MemPO's own settings (read by the plug-in; the launcher fills them from params.yaml)."
GENERATED_NOTE = "# Generated from the params models by `python -m mempo.config.hydra`: edit mempo/config, not here."


def hydra_mempo_values(params: Any) -> dict[str, Any]:
    """The Hydra `mempo:` values of `params` (a `Params`); `verl.lambda_mem` wins when set."""
    out = {key: getattr(getattr(params, section), field) for key, (section, field, _) in HYDRA_MEMPO_KEYS.items()}
    if params.verl.lambda_mem is not None:
        out["lambda_mem"] = params.verl.lambda_mem
    out["lambda_mem"] = float(out["lambda_mem"])
    return out


def _wrap(comment: str, width: int = 98) -> list[str]:
    lines, cur = [], ""
    for word in comment.split():
        if cur and len(cur) + 1 + len(word) > width - 4:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    if cur:
        lines.append(cur)
    return [f"  # {line}" for line in lines]


def hydra_mempo_block(params: Any | None = None) -> str:
    """The `mempo:` block (YAML text) for `params` (default: the params defaults)."""
    import yaml

    from mempo.config.loading import Params

    values = hydra_mempo_values(params if params is not None else Params())
    out = [BEGIN, GENERATED_NOTE, "mempo:"]
    for key, (_, _, comment) in HYDRA_MEMPO_KEYS.items():
        out += _wrap(comment)
        dumped = yaml.safe_dump({key: values[key]}, default_flow_style=False).strip()
        out.append(f"  {dumped}")
    return "\n".join(out) + "\n"


def with_generated_block(text: str, block: str | None = None) -> str:
    """`text` (the Hydra config) with everything from the `BEGIN` line on replaced by the block."""
    if BEGIN not in text:
        raise ValueError(f"no line {BEGIN!r}: the generated block must end the file")
    return text[:text.index(BEGIN)] + (block if block is not None else hydra_mempo_block())


def write_hydra_config(path: str | Path) -> Path:
    """Rewrite the `mempo:` block of the Hydra config at `path` from the params defaults."""
    path = Path(path)
    path.write_text(with_generated_block(path.read_text(encoding="utf-8")), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(write_hydra_config(sys.argv[1] if len(sys.argv) > 1 else "configs/verl/mempo_trainer.yaml"))


# A string Hydra reads back as the same string when written bare (paths, names), unless it
# looks like a number, a bool or null.
_PLAIN = re.compile(r"[A-Za-z0-9_./-]+")
_LOOKS_TYPED = re.compile(r"[-+]?[0-9][0-9_.eE+-]*|true|false|null|nan|inf", re.IGNORECASE)


def hydra_value(value: Any, quote_strings: bool = False) -> str:
    """`value` in Hydra's override grammar (verl's command line, `dvc exp run -S`): bools,
    null and numbers bare; lists `[a,b]` and mappings `{k:v}` element by element; strings
    quoted when they would not read back as the same string (always with `quote_strings`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_value(v, quote_strings)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v, quote_strings) for v in value) + "]"
    text = str(value)
    if not quote_strings and _PLAIN.fullmatch(text) and not _LOOKS_TYPED.fullmatch(text):
        return text
    text = text.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"
