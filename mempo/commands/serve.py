"""`mempo serve retriever`: the Search-R1-compatible retrieval service over an index folder.

The bearer token comes from $MEMPO_RETRIEVER_TOKEN or a file (`--token-file`,
$MEMPO_RETRIEVER_TOKEN_FILE), never from a command-line value, which `ps` shows to everyone.
"""

from __future__ import annotations

import argparse

from mempo.commands import params_from
from mempo.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    serve = add_subparser(sub, "serve", "long-running services")
    ssub = serve.add_subparsers(dest="serve_command", metavar="SERVICE", required=True)
    r = add_subparser(ssub, "retriever", "serve an index over HTTP (POST /retrieve, /access; "
                      "GET /health, /ready, /metrics)")
    r.add_argument("--index", default=None, help="index folder (params: serve.index)")
    r.add_argument("--host", default=None, help="bind address (params: serve.host, 127.0.0.1); "
                   "another address needs a token")
    r.add_argument("--port", type=int, default=None, help="params: serve.port")
    r.add_argument("--encoder", default=None,
                   help="query encoder; default the index's (a mismatch is refused)")
    r.add_argument("--device", default=None, help="query encoder device (cpu | cuda)")
    r.add_argument("--encoder-backend", default=None,
                   help="torch | torch-int8 | onnx | onnx-int8 (params: serve.encoder_backend)")
    r.add_argument("--encoder-threads", type=int, default=None,
                   help="intra-op threads of the query encoder, 0 = all cores")
    r.add_argument("--no-batching", dest="batching", action="store_false", default=None,
                   help="one search per request (Search-R1 behaviour), for comparison")
    r.add_argument("--batch-window-ms", type=float, default=None)
    r.add_argument("--max-batch-queries", type=int, default=None)
    r.add_argument("--workers", type=int, default=None, help="batches searched at once")
    r.add_argument("--max-queue-queries", type=int, default=None,
                   help="queued queries before 503 (params: serve.max_queue_queries)")
    r.add_argument("--token-file", default=None,
                   help="file holding the bearer token clients must send (default: env "
                   "MEMPO_RETRIEVER_TOKEN, or the file named by MEMPO_RETRIEVER_TOKEN_FILE)")
    r.add_argument("--token", dest="token_value", default=None, help=argparse.SUPPRESS)
    r.add_argument("--allow-no-token", action="store_true",
                   help="serve a non-loopback address without a token (trusted networks only)")
    r.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from mempo.retrieval.auth import read_token
    from mempo.retrieval.contract import ServiceLimits
    from mempo.retrieval.serving import serve_retriever

    if args.token_value is not None:
        raise ConfigError("--token is not accepted: a token on the command line shows in `ps` "
                          "to every user. Set MEMPO_RETRIEVER_TOKEN in the environment or pass "
                          "--token-file PATH", field="--token")
    keys = ["index", "host", "port", "encoder", "device", "encoder_backend", "encoder_threads",
            "batching", "batch_window_ms", "max_batch_queries", "workers", "max_queue_queries"]
    p = params_from(args, {f"serve.{k}": getattr(args, k) for k in keys}).serve
    limits = ServiceLimits(**p.limits().model_dump(), token=read_token(token_file=args.token_file))
    serve_retriever(p.index, host=p.host, port=p.port, encoder=p.encoder or None,
                    device=p.device, encoder_backend=p.encoder_backend,
                    encoder_threads=p.encoder_threads, limits=limits,
                    graceful_timeout_s=p.graceful_timeout_s, allow_no_token=args.allow_no_token)
    return 0
