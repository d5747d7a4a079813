"""`mempo pipeline run`: the whole default pipeline (`dvc repro`), as `make run` does;
`mempo pipeline run --params params.tiny.yaml` on the tiny profile."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    p = add_subparser(sub, "pipeline", "run the whole pipeline locally (dvc repro)")
    psub = p.add_subparsers(dest="pipeline_command", metavar="ACTION", required=True)
    run = add_subparser(psub, "run", "dvc repro every stage under one MLflow parent run, gate "
                        "promotion, then print where the outputs are")
    run.add_argument("--force", action="store_true",
                     help="run every stage (with targets: every stage they need) once, even if up to date")
    run.add_argument("--no-promote", action="store_true", help="skip the promotion gate (params: pipeline.promote)")
    run.add_argument("--params", metavar="PROFILE", default=None,
                     help="a params profile (e.g. params.tiny.yaml: only the keys it changes) written into "
                          "params.yaml before the run, as `dvc exp run -S` does: comments kept, validated first; "
                          "`git checkout params.yaml` undoes it")
    run.add_argument("targets", nargs="*", help="stage names (default: all)")
    run.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from mempo.pipeline import run_pipeline, summarize

    result = run_pipeline(".", force=args.force, targets=args.targets or None,
                          promote=False if args.no_promote else None, params_profile=args.params)
    ran = ", ".join(result.ran) if result.ran else "nothing (up to date)"
    print(f"\npipeline finished in {result.seconds:.0f} s; stages run: {ran}")
    if result.restored:
        print(f"restored from DVC's run cache (not run): {', '.join(result.restored)}")
    print("\n".join(summarize(".", result)))
    return 0
