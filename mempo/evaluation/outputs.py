"""The eval stage's output folder: samples.parquet, metrics.json, plots, report and eval.json.

    from mempo.evaluation.outputs import write_outputs, write_samples
    flat = write_outputs("outputs/eval", rows, meta)     # the whole folder, atomically
    write_samples("samples.parquet", rows)               # one row per sample, SAMPLE_COLUMNS

The contract of `samples.parquet` (column order and integer columns) is checked by the
eval-outputs Great Expectations suite (`mempo.validation`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mempo.evaluation.metrics import SAMPLE_COLUMNS, aggregate


def write_samples(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """`samples.parquet`: one row per sample, columns `SAMPLE_COLUMNS` in order (atomic)."""
    import pandas as pd

    from mempo.io import atomic_path

    frame = pd.DataFrame([{c: r.get(c) for c in SAMPLE_COLUMNS} for r in rows], columns=list(SAMPLE_COLUMNS))
    for col in ("turns", "searches", "peak_prompt_tokens", "total_prompt_tokens", "generated_tokens", "repeated_turns",
                "k"):
        frame[col] = frame[col].astype("int64")
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)
    return Path(path)


def write_outputs(
    out: str | Path,
    rows: list[dict[str, Any]],
    meta: Mapping[str, Any],
) -> dict[str, float | int]:
    """Write samples.parquet, metrics.json, plots, report.md/.html and eval.json into `out`
    (atomically: the folder is replaced whole). Returns the flat metrics."""
    from mempo.evaluation.report import write_plots, write_report
    from mempo.io import atomic_dir, write_json

    flat = aggregate(rows)
    with atomic_dir(out) as tmp:
        write_samples(tmp / "samples.parquet", rows)
        write_json(tmp / "metrics.json", flat)
        plots = write_plots(tmp / "plots", flat, rows)
        write_report(tmp, flat, header={k: v for k, v in meta.items() if not isinstance(v, dict | list)}, plots=plots,
                     rows=rows, policies=meta.get("policies"))
        write_json(tmp / "eval.json", dict(meta))
    return flat
