"""What the evaluated agents run on: the model's generator and tokenizer, the retriever, and
(backend hf) the model itself for the memory probe.

    from mempo.evaluation.engine import load_engine
    engine = load_engine(Path("outputs/train/model"), Path("outputs/train/model"),
                         retriever="data/world/corpus.jsonl")
    engine = load_engine(path, path, backend="openai", openai_url="http://127.0.0.1:8000/v1")

`engines_for(p, resolved, ...)` builds one engine per distinct model reference of an `eval:`
section (each agent may run the policy trained for it), sharing one retriever.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mempo.errors import ConfigError

# The context each agent runs in; a policy trained in the same one runs in its own format.
AGENT_CONTEXT = {"memory": "memory", "full_context": "full", "external_memory": "external",
                 "rag": "single-turn", "direct": "single-turn"}


@dataclass
class Engine:
    """What the agents run on: a generator, its tokenizer, the retriever, and (hf) the model."""

    generator: Any
    tokenizer: Any
    retriever: Any | None
    model: Any | None = None  # a transformers model, for the memory probe (None: probe skipped)
    # A TurnPolicy used by the multi-turn agents instead of the generator (e.g. the scripted
    # teacher as a reference policy); None: the generator, batched by GeneratorPolicy.
    turn_policy: Any | None = None
    # The model reference (a path or models:/...) and the context it was trained in
    # ("memory" | "full", from its policy.json; None when unknown): the report tells an agent
    # run on a policy trained for its own format from a cross-format row.
    policy: str = ""
    policy_context: str | None = None


def policy_context(model_dir: str | Path) -> str | None:
    """The context a policy was trained in ("memory" | "full"), from its `policy.json`
    (written by the SFT and GRPO stages); None for a model without one (a base model)."""
    f = Path(model_dir) / "policy.json"
    if not f.is_file():
        return None
    try:
        manifest = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    ctx = manifest.get("context")
    if ctx is None and manifest.get("kind") in ("sft", "grpo"):
        return "memory"  # trained before the context was recorded: the trainers only had memory
    return ctx if ctx in ("memory", "full") else None


def load_engine(
    model_path: Path,
    tokenizer_path: Path,
    *,
    backend: str = "hf",
    device: str = "cpu",
    openai_url: str | None = None,
    served_model: str = "policy",
    retriever: str | None = None,
    concurrency: int = 16,
    load_model_for_probe: bool = True,
    decoder: str = "fast",
    prefix_cache_mb: int = 0,
) -> Engine:
    """Tokenizer + generator (+ model for hf) + retriever for an evaluation. `decoder`
    ("fast" | "hf", `rollout.decoder`) picks the in-process generator of backend hf, with
    `prefix_cache_mb` (`rollout.prefix_cache_mb`) for the fast one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mempo.agent.generation import OpenAIGenerator, make_generator

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    model = None
    if backend == "hf":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(device).eval()
        generator: Any = make_generator(model, tokenizer, decoder, batch_size=concurrency,
                                        prefix_cache_mb=prefix_cache_mb)
    elif backend == "openai":
        if not openai_url:
            raise ConfigError("backend 'openai' needs eval.openai_url", field="eval.openai_url")
        generator = OpenAIGenerator(openai_url, served_model, tokenizer, max_concurrency=concurrency)
    else:
        raise ConfigError(f"unknown backend '{backend}' (hf | openai)", field="eval.backend")
    r = None
    if retriever:
        from mempo.retrieval import open_retriever

        r = open_retriever(retriever)
    return Engine(generator=generator, tokenizer=tokenizer, retriever=r, model=model if load_model_for_probe else None)


def engines_for(p: Any, resolved: Mapping[str, Any], refs: Mapping[str, str], decoder: str,
                cleanup: contextlib.ExitStack) -> dict[str, Engine]:
    """agent -> engine for the `eval:` section `p`: one engine per model reference the agents
    use (`refs`: agent -> reference, `resolved`: reference -> `ResolvedModel`), and one
    retriever shared by all (opened unless every agent is `direct`, closed by `cleanup`)."""
    engines_by_ref = {ref: load_engine(
        m.path, m.tokenizer_path, backend=p.backend, device=p.device, openai_url=p.openai_url,
        served_model=p.served_model, concurrency=p.rollout_params().max_concurrent_episodes, decoder=decoder,
        prefix_cache_mb=p.rollout_params().prefix_cache_mb) for ref, m in resolved.items()
        if ref in refs.values()}
    if any(a != "direct" for a in p.agents):
        from mempo.retrieval import open_retriever

        shared = open_retriever(p.retriever)
        cleanup.callback(shared.close)
        for e in engines_by_ref.values():
            e.retriever = shared
    for ref, e in engines_by_ref.items():
        e.policy, e.policy_context = ref, policy_context(resolved[ref].path)
    return {a: engines_by_ref[refs[a]] for a in p.agents}
