"""Data preparation: FlashRAG QA sets -> verl-schema parquet both trainers read.

    mempo data prepare                        # params.yaml `data:`
    from mempo.data import prepare_data, load_prepared

See `prepare` for the steps (gates, dedup, leakage, compositions) and `schema` for the
columns and the loader (`load_prepared`).
"""

from __future__ import annotations

from mempo.data.prepare import PrepareResult, prepare_data, run_data_stage
from mempo.data.schema import AGENT_NAME, PREPARED_SCHEMA, PreparedTask, load_prepared, to_verl_row

__all__ = [
    "AGENT_NAME", "PREPARED_SCHEMA", "PrepareResult", "PreparedTask", "load_prepared",
    "prepare_data", "run_data_stage", "to_verl_row",
]
