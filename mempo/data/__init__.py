"""Data preparation: FlashRAG QA sets -> verl-schema parquet both trainers read.

    mempo data prepare                        # params.yaml `data:`
    from mempo.data import prepare_data, load_prepared

See `prepare` for the steps (gates, dedup, leakage, compositions), `schema` for the columns
and the loader (`load_prepared`), and `sft_split` for the SFT teacher's task split.

The names below load on first use, so `mempo.data.sft_split` imports without pydantic (the
bare GPU machine's smoke run composes SFT tasks with it, and has no pydantic).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_HOME = {
    "PrepareResult": "prepare", "prepare_data": "prepare", "run_data_stage": "prepare",
    "AGENT_NAME": "schema", "PREPARED_SCHEMA": "schema", "PreparedTask": "schema", "load_prepared": "schema",
    "to_verl_row": "schema",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'mempo.data' has no attribute {name!r}")
    return getattr(import_module(f"mempo.data.{_HOME[name]}"), name)
