"""Data contracts (Great Expectations 1.x): corpus, qa, prepared, eval.

    mempo validate --suite corpus --data data/world/corpus.jsonl
    mempo validate --suite qa --data data/world/qa/train.jsonl
    mempo validate --suite prepared --data data/prepared          # train, val, sft, sft_val.parquet
    mempo validate --suite eval --data outputs/eval

    from mempo.validation import validate_data
    report = validate_data("qa", "data/world/qa/train.jsonl", params.validation)

A failed contract writes its report (`REPORT_DIR/report.json`, `REPORT_DIR/docs/index.html`)
and raises `ValidationFailed` (exit code 3) naming the failed expectations with sample rows;
only a passing one writes `REPORT_DIR/passed.json`, the marker later stages depend on.
See `contracts` for what each suite checks and `runner` for how.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mempo.config import ValidateParams
from mempo.io import atomic_dir, sha256_file, write_json
from mempo.validation.contracts import SUITES, build_contract
from mempo.validation.runner import MARKER, REPORT, ContractReport, run_contract

__all__ = ["MARKER", "REPORT", "SUITES", "ContractReport", "adhoc_report_dir", "eval_questions", "validate_data"]

ADHOC = "adhoc"


def adhoc_report_dir(params: ValidateParams, suite: str, data: str | Path) -> Path:
    """Where a check without an explicit report folder writes: `<out>/adhoc/<suite>/<name>-<hash>/`.

    Never the pipeline's own `<out>/<suite>/` (a DVC output the index and data stages depend
    on): an ad-hoc check of another file must not replace its report or `passed.json`. The
    hash of the resolved data path keeps reports of different files apart.
    """
    import hashlib

    resolved = str(Path(data).resolve())
    tag = hashlib.sha256(resolved.encode("utf-8")).hexdigest()[:8]
    return Path(params.out) / ADHOC / suite / f"{Path(data).name}-{tag}"


def eval_questions(paths: Sequence[str | Path]) -> list[str]:
    """Every question of the evaluation sets (and of each multi-objective task's objectives)."""
    from mempo.datasets import load_qa

    out: list[str] = []
    for p in paths:
        for item in load_qa(p):
            out.extend(o.question for o in item.objectives)
    return out


def validate_data(
    suite: str,
    data: str | Path,
    params: ValidateParams | None = None,
    report_dir: str | Path | None = "default",
    eval_sets: Sequence[str | Path] = (),
    raise_on_failure: bool = True,
) -> list[ContractReport]:
    """Run the contract `suite` on `data`; returns one report per file checked.

    `data` for `prepared` may be a folder (every `*.parquet` in it is checked, each into
    `REPORT_DIR/<stem>/`); for `eval` a folder with `samples.parquet` and `metrics.json`.
    `report_dir="default"` means `params.out/<suite>`; None writes no report. `eval_sets`
    (FlashRAG files) feed the prepared contract's leakage expectation.

    Raises:
        ValidationFailed: a contract failed (after its report is written).
        DataError: the data cannot be opened at all.
    """
    params = params or ValidateParams()
    data = Path(data)
    base = Path(params.out) / suite if report_dir == "default" else (
        None if report_dir is None else Path(report_dir))
    if base is not None:
        # Any earlier verdict is void from here on, even if this run cannot read the data.
        (base / MARKER).unlink(missing_ok=True)
    normalize, questions = None, []
    if suite == "prepared" and eval_sets:
        from mempo.rewards import normalize_answer

        normalize, questions = normalize_answer, eval_questions(eval_sets)
    targets = [data]
    if suite == "prepared" and data.is_dir():
        targets = sorted(data.glob("*.parquet"))
        if not targets:
            from mempo.errors import DataError

            raise DataError("no .parquet files in folder", path=data)
    if base is None or not data.is_dir():
        return [run_contract(build_contract(suite, t, params, questions, normalize), base,
                             params.sample_rows, raise_on_failure) for t in targets]
    # A folder: one sub-report per file, and one marker for the folder, written only when
    # every file passed; the folder is replaced whole so no stale marker survives a failure.
    reports = []
    with atomic_dir(base) as tmp:
        for target in targets:
            contract = build_contract(suite, target, params, questions, normalize)
            report = run_contract(contract, tmp / target.stem, params.sample_rows, raise_on_failure=False)
            report.report_dir = str(base / target.stem)
            reports.append(report)
        if all(r.success for r in reports):
            write_json(tmp / MARKER, {
                "suite": suite, "data": str(data),
                "files": {Path(r.data).name: {"rows": r.rows, "sha256": sha256_file(r.data)} for r in reports},
            })
    failed = [r for r in reports if not r.success]
    if failed and raise_on_failure:
        raise failed[0].error()
    return reports
