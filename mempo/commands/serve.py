"""`mempo serve retriever`: the Search-R1-compatible retrieval service over an index folder."""

from __future__ import annotations

import argparse
import os

from mempo.commands import params_from


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    serve = add_subparser(sub, "serve", "long-running services")
    ssub = serve.add_subparsers(dest="serve_command", metavar="SERVICE", required=True)
    r = add_subparser(ssub, "retriever", "serve an index over HTTP (POST /retrieve, /access; "
                      "GET /health, /metrics)")
    r.add_argument("--index", default=None, help="index folder (params: serve.index)")
    r.add_argument("--host", default=None, help="bind address (params: serve.host, 127.0.0.1)")
    r.add_argument("--port", type=int, default=None, help="params: serve.port")
    r.add_argument("--encoder", default=None,
                   help="query encoder; default the index's (a mismatch is refused)")
    r.add_argument("--device", default=None, help="query encoder device (cpu | cuda)")
    r.add_argument("--no-batching", dest="batching", action="store_false", default=None,
                   help="one search per request (Search-R1 behaviour), for comparison")
    r.add_argument("--batch-window-ms", type=float, default=None)
    r.add_argument("--max-batch-queries", type=int, default=None)
    r.add_argument("--token", default=None,
                   help="require 'Authorization: Bearer TOKEN' (default: env MEMPO_RETRIEVER_TOKEN)")
    r.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from mempo.retrieval.server import ServiceLimits, serve_retriever

    keys = ["index", "host", "port", "encoder", "device", "batching", "batch_window_ms",
            "max_batch_queries"]
    p = params_from(args, {f"serve.{k}": getattr(args, k) for k in keys}).serve
    limits = ServiceLimits(**p.limits().model_dump(),
                           token=args.token or os.environ.get("MEMPO_RETRIEVER_TOKEN") or None)
    serve_retriever(p.index, host=p.host, port=p.port, encoder=p.encoder or None,
                    device=p.device, limits=limits, graceful_timeout_s=p.graceful_timeout_s)
    return 0
