"""`mempo world generate`: the offline knowledge world (corpus + QA sets)."""

from __future__ import annotations

import argparse
import json

from mempo.commands import params_from


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    world = add_subparser(sub, "world", "the generated knowledge world (default data)")
    wsub = world.add_subparsers(dest="world_command", metavar="ACTION", required=True)
    gen = add_subparser(wsub, "generate", "generate a seeded fictional encyclopedia with QA sets")
    gen.add_argument("--out", default=None, help="output folder (params: world.out)")
    gen.add_argument("--seed", type=int, default=None, help="random seed (params: world.seed)")
    gen.add_argument("--size", choices=["tiny", "small", "medium"], default=None,
                     help="tiny for tests, small for the default run, medium for benchmarks (params: world.size)")
    gen.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from mempo.world import generate_world

    p = params_from(args, {"world.out": args.out, "world.seed": args.seed, "world.size": args.size}).world
    manifest = generate_world(p.out, size=p.size, seed=p.seed)
    print(json.dumps({k: manifest[k] for k in ("size", "seed", "passages", "questions")}))
    print(f"world written to {p.out}")
    return 0
