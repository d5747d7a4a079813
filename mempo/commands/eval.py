"""`mempo eval` (agents x benchmarks -> metrics, samples, plots, report) and `mempo ask` (one episode)."""

from __future__ import annotations

import argparse
import os

from mempo.commands import params_from


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    ev = add_subparser(sub, "eval", "evaluate a model: the MemPO memory agent against its baselines")
    ev.add_argument("--model", default=None,
                    help="HF model folder or models:/NAME@alias | models:/NAME/VERSION (params: eval.model)")
    ev.add_argument("--benchmarks", nargs="+", default=None, metavar="NAME",
                    help="world, world-k{1,2,4,8,16}, nq, triviaqa, popqa, hotpotqa, 2wiki, musique, "
                         "bamboogle, or a custom name from `benchmarks:` (params: eval.benchmarks)")
    ev.add_argument("--agents", nargs="+", default=None, metavar="AGENT",
                    help="memory full_context external_memory rag direct (params: eval.agents)")
    ev.add_argument("--out", default=None, help="output folder (params: eval.out)")
    ev.add_argument("--retriever", default=None,
                    help="index folder, corpus .jsonl, or http://host:port of `mempo serve retriever` "
                         "(default: $MEMPO_RETRIEVER_URL when the pipeline serves one, else params: eval.retriever)")
    ev.add_argument("--backend", choices=["hf", "openai"], default=None, help="params: eval.backend")
    ev.add_argument("--openai-url", default=None, help="backend openai: server base URL (params: eval.openai_url)")
    ev.add_argument("--served-model", default=None, help="backend openai: served model name (params: eval.served_model)")
    ev.add_argument("--concurrency", type=int, default=None, help="episodes in flight (params: eval.rollout.max_concurrent_episodes)")
    ev.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="eval-time context window; longer episodes are truncated and scored wrong "
                         "(params: eval.rollout.max_prompt_tokens)")
    ev.add_argument("--limit", type=int, default=None, help="items per benchmark (params: eval.limit)")
    ev.add_argument("--seed", type=int, default=None, help="params: eval.seed")
    ev.add_argument("--device", default=None, help="cpu | cuda (params: eval.device)")
    ev.add_argument("--decoder", choices=["fast", "hf"], default=None,
                    help="in-process generator for backend hf (params: eval.rollout.decoder, else rollout.decoder)")
    ev.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    ev.set_defaults(handler=_eval)

    ask = add_subparser(sub, "ask", "run one episode and print it turn by turn (memory, reasoning, search, titles, answer)")
    ask.add_argument("question", help="the question (several: join them with '; ')")
    ask.add_argument("--model", default=None, help="HF model folder or models:/NAME@alias (params: eval.model)")
    ask.add_argument("--retriever", default=None, help="index folder, corpus .jsonl or http URL (params: eval.retriever)")
    ask.add_argument("--full-context", action="store_true", help="the full-history agent instead of the memory agent")
    ask.add_argument("--gold", nargs="+", default=None, help="accepted answers, to print EM / F1")
    ask.add_argument("--backend", choices=["hf", "openai"], default=None, help="params: eval.backend")
    ask.add_argument("--openai-url", default=None, help="params: eval.openai_url")
    ask.add_argument("--served-model", default=None, help="params: eval.served_model")
    ask.add_argument("--max-turns", type=int, default=None, help="turns per objective (params: eval.rollout.turns_per_objective)")
    ask.add_argument("--device", default=None, help="params: eval.device")
    ask.add_argument("--decoder", choices=["fast", "hf"], default=None, help="params: eval.rollout.decoder, else rollout.decoder")
    ask.set_defaults(handler=_ask)


# Exported by `mempo pipeline run` while its retrieval service is up (see mempo.pipeline).
ENV_RETRIEVER_URL = "MEMPO_RETRIEVER_URL"


def _retriever_flag(value: str | None) -> str | None:
    """--retriever, else the pipeline's service URL from MEMPO_RETRIEVER_URL, else None (params)."""
    return value or os.environ.get(ENV_RETRIEVER_URL) or None


def _eval(args: argparse.Namespace) -> int:
    from mempo.evaluation.report import format_value
    from mempo.evaluation.runner import run_eval

    params = params_from(args, {
        "eval.model": args.model, "eval.benchmarks": args.benchmarks, "eval.agents": args.agents,
        "eval.out": args.out, "eval.retriever": _retriever_flag(args.retriever), "eval.backend": args.backend,
        "eval.openai_url": args.openai_url, "eval.served_model": args.served_model,
        "eval.rollout.max_concurrent_episodes": args.concurrency,
        "eval.rollout.max_prompt_tokens": args.max_prompt_tokens,
        "eval.limit": args.limit, "eval.seed": args.seed, "eval.device": args.device,
        "eval.rollout.decoder": args.decoder,
    })
    result = run_eval(params.eval, params.benchmarks, track=not args.no_track)
    benches = list(params.eval.benchmarks)
    print(f"{'EM':<16}" + "".join(f"{b:>11}" for b in benches))
    for agent in params.eval.agents:
        cells = "".join(f"{format_value(result.metrics.get(f'{agent}/{b}/em', float('nan'))):>11}" for b in benches)
        print(f"{agent:<16}{cells}")
    print(f"report: {result.out / 'report.md'} (and report.html); samples: {result.out / 'samples.parquet'}")
    return 0


def _ask(args: argparse.Namespace) -> int:
    from mempo.evaluation.ask import ask, format_episode
    from mempo.evaluation.engine import load_engine
    from mempo.evaluation.model_ref import resolved_model
    from mempo.evaluation.settings import EvalSettings
    from mempo.training.runtime import set_cpu_threads

    params = params_from(args, {
        "eval.model": args.model, "eval.retriever": _retriever_flag(args.retriever), "eval.backend": args.backend,
        "eval.openai_url": args.openai_url, "eval.served_model": args.served_model,
        "eval.rollout.turns_per_objective": args.max_turns, "eval.device": args.device,
        "eval.rollout.decoder": args.decoder,
    })
    p = params.eval
    set_cpu_threads(p.threads)
    with resolved_model(p.model) as model:
        engine = load_engine(model.path, model.tokenizer_path, backend=p.backend, device=p.device,
                             openai_url=p.openai_url, served_model=p.served_model, retriever=p.retriever,
                             concurrency=1, decoder=p.rollout_params().decoder)
        episode = ask(args.question, engine, EvalSettings.from_params(p), full_context=args.full_context,
                      gold=args.gold)
    print(format_episode(episode, gold=args.gold))
    return 0
