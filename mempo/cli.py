"""The `mempo` command line: one subcommand per stage.

    mempo --help
    mempo world generate --out data/world --size small
    mempo --set mempo.lambda_mem=0 train grpo ...

Each stage's arguments live in `mempo/commands/<stage>.py`, which only parses them and
calls the stage's library function (imported lazily, so `mempo --help` stays fast).
Errors print one line naming the file, row or field and exit non-zero; `--verbose` shows
the traceback. SIGTERM (an Airflow timeout, a pod eviction, `kill`) is turned into an
exception in the main thread, like Ctrl-C: `with` blocks unwind (a stage's MLflow run ends
FAILED, child processes are stopped) and the exit status is 143 (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence

from mempo import __version__
from mempo.errors import MempoError

# One module per stage; each exposes `register(subparsers)`. Add a line when a stage lands.
COMMAND_MODULES = [
    "mempo.commands.world",
    "mempo.commands.pipeline",
    "mempo.commands.policy",
    "mempo.commands.train",
    "mempo.commands.registry",
    "mempo.commands.data",
    "mempo.commands.validate",
    "mempo.commands.corpus",
    "mempo.commands.index",
    "mempo.commands.serve",
    "mempo.commands.eval",
]


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mempo",
        description="MemPO pipeline: knowledge world, retrieval index and service, data prep, "
        "policy, SFT, GRPO + memory advantage, evaluation, registry.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"mempo {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument(
        "--params", default="params.yaml",
        help="params file (one section per stage); CLI flags override it",
    )
    parser.add_argument(
        "-s", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override any params key, e.g. --set mempo.lambda_mem=0 (repeatable)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def add_subparser(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A subparser with the project's help formatter (defaults shown)."""
    return sub.add_parser(name, help=help, description=help, formatter_class=_Formatter)


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that no `except
    Exception` in library code swallows it on the way out."""


def _again(signum: int, frame: object) -> None:
    # A second SIGTERM while unwinding must not cut the cleanup short (stopping children).
    print("mempo: already stopping", file=sys.stderr)


def _raise_terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, _again)
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises `Terminated` in the main thread (a no-op off it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # httpx logs every request at INFO: thousands of lines per stage that calls the retriever.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.parse_args([*list(argv or sys.argv[1:]), "--help"])
        return 2
    try:
        with sigterm_raises():
            rc = handler(args)
        return int(rc or 0)
    except Terminated:
        print("mempo: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except MempoError as e:
        if args.verbose:
            traceback.print_exc()
        print(f"mempo: error: {e.one_line()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("mempo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place that turns crashes into one line
        if args.verbose or os.environ.get("MEMPO_TRACEBACK"):
            traceback.print_exc()
        print(f"mempo: error: {type(e).__name__}: {e} (run with --verbose for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
