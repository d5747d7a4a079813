"""`mempo register` and `mempo promote`: the MLflow model registry (aliases, never stages)."""

from __future__ import annotations

import argparse
import json

from mempo.commands import params_from


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    reg = add_subparser(sub, "register", "register the trained policy as an MLflow model version")
    reg.add_argument("--name", default=None, help="registered model name (params: register.model_name)")
    reg.add_argument("--model-dir", default=None, help="HF model folder (params: register.model_dir)")
    reg.add_argument("--metrics", default=None, help="eval metrics.json (params: register.metrics)")
    reg.add_argument("--data", action="append", default=None, metavar="NAME=PATH",
                     help="an input to record as a data-version tag (repeatable; params: register.data)")
    reg.add_argument("--source-run-id", default=None,
                     help="training run id (default: the one the train stage recorded, or the pipeline run's)")
    reg.add_argument("--eval-run-id", default=None,
                     help="eval run id (default: the one the eval stage recorded, or the pipeline run's)")
    reg.add_argument("--out", default=None, help="folder for registered.json (params: register.out)")
    reg.set_defaults(handler=_register)

    pro = add_subparser(sub, "promote", "gate the newest version (@challenger) against @champion")
    pro.add_argument("--model", default=None, help="registered model name (params: register.model_name)")
    pro.add_argument("--version", default=None, help="version to gate (default: the newest)")
    pro.add_argument("--registered", default=None, metavar="FILE",
                     help="registered.json written by `mempo register`: gate exactly that name and version")
    pro.add_argument("--primary-metric", default=None, help="params: promote.primary_metric")
    pro.add_argument("--min-gain", type=float, default=None, help="params: promote.min_gain")
    pro.add_argument("--tolerance", type=float, default=None, help="params: promote.tolerance")
    pro.add_argument("--out", default=None, help="folder for decision.json (params: promote.out)")
    pro.add_argument("--fail-if-rejected", action="store_true",
                     help="exit 4 when the gate rejects the challenger (for schedulers that branch on it)")
    pro.set_defaults(handler=_promote)


def _register(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mempo.registry.gate import gate_from_params
    from mempo.registry.register import parse_data_args, register_model

    params = params_from(args, {
        "register.model_name": args.name, "register.model_dir": args.model_dir,
        "register.metrics": args.metrics, "register.out": args.out,
    })
    p = params.registration
    data = parse_data_args(args.data) if args.data else p.data
    result = register_model(
        p.model_name, p.model_dir, p.metrics, data=data,
        source_run_id=args.source_run_id, eval_run_id=args.eval_run_id,
        train_metrics_path=p.train_metrics or Path(p.model_dir).parent / "metrics.json",
        gate=gate_from_params(params.promote), params=p, out=Path(p.out) / "registered.json",
        headline_out=p.headline or Path(p.out) / "headline.json",
    )
    print(json.dumps(result.__dict__, sort_keys=True))
    print(f"registered {result.model_uri}")
    return 0


def _promote(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mempo.registry.gate import gate_from_params
    from mempo.registry.promote import promote
    from mempo.registry.register import read_registered

    params = params_from(args, {
        "register.model_name": args.model, "promote.primary_metric": args.primary_metric,
        "promote.min_gain": args.min_gain, "promote.tolerance": args.tolerance,
        "promote.out": args.out,
    })
    p = params.promote
    name, version = params.registration.model_name, args.version
    if args.registered:
        name, version = read_registered(args.registered)
    decision = promote(
        name, gate_from_params(p), version=version,
        out=Path(p.out) / "decision.json", lock_wait_s=p.lock_wait_s,
    )
    print(json.dumps({"promoted": decision.promoted, "challenger_version": decision.challenger_version,
                      "champion_version": decision.champion_version}, sort_keys=True))
    print(decision.summary())
    return 4 if (args.fail_if_rejected and not decision.promoted) else 0
