"""`mempo data prepare`: QA sets -> verl-schema train/val parquet (params: `data:`), and the
SFT teacher's task split sft/sft_val parquet (the `sft:` task-mix keys)."""

from __future__ import annotations

import argparse
import json

from mempo.commands import params_from


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    data = add_subparser(sub, "data", "training data: verl-schema parquet from FlashRAG QA sets")
    dsub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = add_subparser(dsub, "prepare", "dedup, leakage check, multi-objective mixes, verl parquet, gates")
    prep.add_argument("--out", default=None, help="output folder (params: data.out)")
    prep.add_argument("--seed", type=int, default=None, help="composition/shuffle seed (params: data.seed)")
    prep.add_argument("--leakage", choices=["drop", "fail"], default=None,
                      help="questions also in an eval set: drop them or fail (params: data.leakage)")
    prep.add_argument("--no-gate", dest="gate", action="store_false", default=None,
                      help="skip the qa/prepared contracts (params: data.gate)")
    prep.set_defaults(handler=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from mempo.data import run_data_stage

    params = params_from(args, {"data.out": args.out, "data.seed": args.seed,
                                "data.leakage": args.leakage, "data.gate": args.gate})
    result = run_data_stage(params.data, params.validation, params)
    print(json.dumps({"rows": result.rows, "dropped": result.summary["dropped"]}))
    print(f"data written to {result.out}")
    return 0
