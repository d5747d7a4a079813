"""`mempo validate --suite NAME --data PATH`: run one data contract (params: `validate:`)."""

from __future__ import annotations

import argparse

from mempo.commands import params_from

SUITE_NAMES = ("corpus", "qa", "prepared", "eval")


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    p = add_subparser(sub, "validate", "check a data contract (Great Expectations); exit 3 on failure")
    p.add_argument("--suite", required=True, choices=SUITE_NAMES, help="which contract")
    p.add_argument("--data", required=True,
                   help="file or folder (prepared: a parquet or the data folder; eval: the eval folder)")
    p.add_argument("--report", default=None,
                   help="report folder; passed.json only on success (default: an ad-hoc folder, "
                   "<validate.out>/adhoc/<suite>/<file>-<hash>, never the pipeline's <validate.out>/<suite>)")
    p.add_argument("--eval-set", dest="eval_sets", action="append", default=None,
                   help="prepared: evaluation set for the leakage check (default: data.eval_sets; repeatable)")
    p.add_argument("--no-leakage-check", action="store_true", help="prepared: skip the leakage check")
    p.set_defaults(handler=_validate)


def _validate(args: argparse.Namespace) -> int:
    from mempo.validation import adhoc_report_dir, validate_data

    params = params_from(args)
    eval_sets = [] if args.no_leakage_check else (args.eval_sets or params.data.eval_sets)
    reports = validate_data(
        args.suite, args.data, params.validation,
        report_dir=args.report or adhoc_report_dir(params.validation, args.suite, args.data),
        eval_sets=eval_sets if args.suite == "prepared" else (),
    )
    for r in reports:
        print(f"contract {r.suite} passed on {r.data}: {r.rows} rows, {len(r.outcomes)} expectations"
              f" (report: {r.report_dir})")
    return 0
