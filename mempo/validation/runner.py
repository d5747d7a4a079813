"""Run a contract with Great Expectations 1.x and write its report.

One ephemeral GE context per run (nothing persisted outside the report folder): a pandas
data source, one dataframe asset and suite per batch, one validation per frame (a chunk of
a streamed corpus is one GE batch). Results are aggregated per expectation over all frames.

The report folder is replaced as a whole (`atomic_dir`):

    REPORT_DIR/report.json        every expectation: success, counts, sample failing rows
    REPORT_DIR/docs/index.html    GE data docs (suites and every validation run)
    REPORT_DIR/passed.json        ONLY when every expectation passed: the marker later
                                  stages depend on (DVC), with the data's fingerprint

On failure the report is still written (so a person can read it), `passed.json` is not, and
`ValidationFailed` names the data file, the first failing row and field, and every failed
expectation with sample rows.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from mempo.errors import DataError, ValidationFailed
from mempo.io import atomic_dir, sha256_file, write_json
from mempo.validation.contracts import Check, Contract

log = logging.getLogger(__name__)
# GE logs hundreds of INFO lines about its own decorators; keep its warnings only.
logging.getLogger("great_expectations").setLevel(logging.WARNING)

MARKER = "passed.json"
REPORT = "report.json"


@dataclass
class ExpectationOutcome:
    """One expectation aggregated over every frame of its batch."""

    batch: str
    expectation: str
    description: str
    kwargs: dict[str, Any]
    success: bool = True
    element_count: int = 0
    unexpected_count: int = 0
    missing_count: int = 0
    observed_value: Any = None
    sample_rows: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def summary(self) -> str:
        """`description: N rows (e.g. line 3 id=x; ...)` for the one-line error."""
        if self.error:
            return f"{self.description}: raised {self.error}"
        if self.sample_rows:
            shown = "; ".join(
                " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
                         for k, v in r.items() if v is not None)
                for r in self.sample_rows[:3])
            return f"{self.description}: {self.unexpected_count} rows (e.g. {shown})"
        if self.observed_value is not None:
            return f"{self.description}: observed {self.observed_value}"
        return f"{self.description}: {self.unexpected_count} rows"

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch, "expectation": self.expectation, "description": self.description,
            "kwargs": self.kwargs, "success": self.success, "element_count": self.element_count,
            "unexpected_count": self.unexpected_count, "missing_count": self.missing_count,
            "observed_value": self.observed_value, "sample_rows": self.sample_rows, "error": self.error,
        }


@dataclass
class ContractReport:
    """What `run_contract` found. `success` is True only if every expectation passed."""

    suite: str
    data: str
    success: bool
    rows: int
    frames: int
    outcomes: list[ExpectationOutcome]
    report_dir: str | None = None

    @property
    def failed(self) -> list[ExpectationOutcome]:
        return [o for o in self.outcomes if not o.success]

    def to_dict(self) -> dict[str, Any]:
        import great_expectations as gx

        return {
            "suite": self.suite, "data": self.data, "success": self.success, "rows": self.rows,
            "frames": self.frames, "great_expectations": gx.__version__,
            "expectations": [o.to_dict() for o in self.outcomes],
            "failed": [o.summary() for o in self.failed], "docs": "docs/index.html",
        }

    def error(self) -> ValidationFailed:
        """The `ValidationFailed` for a failed report (first failing row and field named)."""
        failed = self.failed
        first = failed[0]
        row = next((r.get("line") for o in failed for r in o.sample_rows if "line" in r), None)
        where = f"; report: {Path(self.report_dir) / REPORT}" if self.report_dir else ""
        msg = (f"contract '{self.suite}' failed: {len(failed)} of {len(self.outcomes)} expectations — "
               + " | ".join(o.summary() for o in failed) + where)
        err = ValidationFailed(msg, path=self.data, row=row, field=first.kwargs.get("column"))
        err.report = self  # type: ignore[attr-defined]
        return err


def _plain(v: Any) -> Any:
    """JSON-safe Python values from numpy / pandas scalars (NaN and NA become None)."""
    if v is None:
        return None
    if hasattr(v, "item") and not isinstance(v, list | dict | str):
        try:
            v = v.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    try:
        import pandas as pd

        if v is pd.NA:
            return None
    except ImportError:  # pragma: no cover
        pass
    return v


def _make_expectation(check: Check) -> Any:
    import great_expectations.expectations as gxe

    cls = getattr(gxe, check.kind)
    return cls(**check.kwargs, description=check.description)


def _context(docs_dir: Path | None) -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    # The default ephemeral context makes a temp docs folder it never deletes; ours writes
    # data docs only into the report folder.
    config = DataContextConfig(store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False))
    ctx = gx.get_context(mode="ephemeral", project_config=config)
    # tqdm bars for every metric would drown the logs; this module shows one bar per batch.
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    if docs_dir is None:
        return ctx
    ctx.add_data_docs_site(site_name="mempo", site_config={
        "class_name": "SiteBuilder",
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(Path(docs_dir).resolve())},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
    })
    return ctx


def _validate(contract: Contract, docs_dir: Path | None, sample_rows: int) -> tuple[list[ExpectationOutcome], int]:
    import great_expectations as gx

    ctx = _context(docs_dir)
    source = ctx.data_sources.add_pandas("mempo")
    outcomes: list[ExpectationOutcome] = []
    n_frames = 0
    for spec in contract.batches:
        batch_def = source.add_dataframe_asset(spec.name).add_batch_definition_whole_dataframe("frame")
        suite = ctx.suites.add(gx.ExpectationSuite(name=f"{contract.suite}.{spec.name}"))
        ids = [suite.add_expectation(_make_expectation(check)).id for check in spec.checks]
        vd = ctx.validation_definitions.add(gx.ValidationDefinition(
            data=batch_def, suite=suite, name=f"{contract.suite}.{spec.name}"))
        mine = [ExpectationOutcome(spec.name, _snake(c.kind), c.description, _plain(c.kwargs))
                for c in spec.checks]
        outcomes.extend(mine)
        result_format = {"result_format": "SUMMARY", "partial_unexpected_count": sample_rows,
                         "unexpected_index_column_names": spec.index_columns}
        for df in tqdm(spec.frames(), desc=f"validate {contract.suite}.{spec.name}", unit="batch",
                       disable=None, leave=False):
            n_frames += 1
            result = vd.run(batch_parameters={"dataframe": df}, result_format=result_format)
            # GE does not keep the suite's order in its results; match them by expectation id.
            by_id = {res.expectation_config.id: res for res in result.results}
            for out, exp_id in zip(mine, ids, strict=True):
                _merge(out, by_id[exp_id], sample_rows)
    if docs_dir is not None:
        ctx.build_data_docs(site_names=["mempo"])
    _name_duplicate_ids(contract, outcomes)
    return outcomes, n_frames


def _name_duplicate_ids(contract: Contract, outcomes: list[ExpectationOutcome]) -> None:
    """Replace id hashes in duplicate-id samples by the ids themselves (a second read)."""
    dup = [o for o in outcomes if o.kwargs.get("column") == "key_hash" and o.sample_rows]
    if not dup or contract.ids_at is None:
        return
    lines = {int(r["line"]) for o in dup for r in o.sample_rows if r.get("line") is not None}
    ids = contract.ids_at(lines)
    for o in dup:
        o.sample_rows = [{"line": r.get("line"), "id": ids.get(int(r["line"]))} if "line" in r else r
                         for r in o.sample_rows]


def _snake(kind: str) -> str:
    name = kind[len("Expect"):] if kind.startswith("Expect") else kind
    return "expect" + "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


def _merge(out: ExpectationOutcome, res: Any, sample_rows: int) -> None:
    exc = res.exception_info or {}
    if isinstance(exc, dict) and exc.get("raised_exception"):
        out.success = False
        out.error = str(exc.get("exception_message"))[:500]
        return
    r = res.result or {}
    out.success = out.success and bool(res.success)
    out.element_count += int(r.get("element_count") or 0)
    out.unexpected_count += int(r.get("unexpected_count") or 0)
    out.missing_count += int(r.get("missing_count") or 0)
    if "observed_value" in r:
        out.observed_value = _plain(r["observed_value"])
    room = sample_rows - len(out.sample_rows)
    if room > 0:
        out.sample_rows.extend(_plain(x) for x in (r.get("partial_unexpected_index_list") or [])[:room])


def run_contract(
    contract: Contract,
    report_dir: str | Path | None,
    sample_rows: int = 20,
    raise_on_failure: bool = True,
) -> ContractReport:
    """Validate `contract.data`; write the report folder; raise `ValidationFailed` on failure.

    `report_dir=None` writes no report (an in-process gate that only needs the verdict).
    """
    if not contract.data.exists():
        raise DataError("file not found", path=contract.data)
    started = _dt.datetime.now(_dt.UTC)
    if report_dir is None:
        outcomes, n_frames = _validate(contract, None, sample_rows)
        report = ContractReport(contract.suite, str(contract.data), all(o.success for o in outcomes),
                                contract.rows_read(), n_frames, outcomes)
    else:
        report_dir = Path(report_dir)
        with atomic_dir(report_dir) as tmp:
            outcomes, n_frames = _validate(contract, tmp / "docs", sample_rows)
            report = ContractReport(contract.suite, str(contract.data), all(o.success for o in outcomes),
                                    contract.rows_read(), n_frames, outcomes, str(report_dir))
            body = report.to_dict()
            body["started"] = started.isoformat(timespec="seconds")
            write_json(tmp / REPORT, body)
            if report.success:
                write_json(tmp / MARKER, {
                    "suite": contract.suite, "data": str(contract.data), "rows": report.rows,
                    "sha256": sha256_file(contract.data), "expectations": len(outcomes),
                })
    log.info("contract %s on %s: %s (%d rows, %d expectations, %d failed)", contract.suite,
             contract.data, "passed" if report.success else "FAILED", report.rows,
             len(report.outcomes), len(report.failed))
    if not report.success and raise_on_failure:
        raise report.error()
    return report
