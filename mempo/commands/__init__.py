"""CLI argument parsing, one module per stage. Logic lives in the library, not here."""

from __future__ import annotations

import argparse
from typing import Any

from mempo.config import Params, load_params, parse_override


def params_from(args: argparse.Namespace, flags: dict[str, Any] | None = None) -> Params:
    """Load params.yaml with `--set` overrides, then the command's own flags on top.

    `flags` maps dotted params keys to flag values; unset flags (None) keep the params value.
    """
    overrides = dict(parse_override(o) for o in getattr(args, "overrides", []) or [])
    overrides.update({k: v for k, v in (flags or {}).items() if v is not None})
    return load_params(args.params, overrides=overrides)
