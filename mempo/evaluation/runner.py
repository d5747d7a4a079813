"""`mempo eval`: every requested agent on every requested benchmark, one model, one retriever.

    from mempo.config import load_params
    result = run_eval(load_params("params.yaml").eval, load_params("params.yaml").benchmarks)
    result.metrics["memory/world/em"], result.out     # outputs/eval/{metrics.json, report.md, ...}

    mempo eval --model outputs/train/model --benchmarks world world-k4 --limit 20
    mempo eval --model models:/mempo-agent@champion --retriever http://127.0.0.1:8013

Writes into `out` (atomically, the whole folder at once): `samples.parquet` (one row per
agent x benchmark x question, columns `mempo.evaluation.metrics.SAMPLE_COLUMNS`), the flat
`metrics.json` (`agent/benchmark/metric`), `plots/*.png`, `report.md` and `report.html`, and
`eval.json` (the settings, model version, seeds and counts). Everything is logged to an
MLflow `eval` stage run, with the per-sample answers also scored by `mlflow.genai.evaluate`
code scorers (the same `mempo.rewards` functions).

Deterministic: greedy decoding by default (temperature 0), world-k* tasks composed with
`seed`, benchmarks truncated to the first `limit` items, so two models see identical inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mempo.datasets import QAItem
from mempo.errors import ConfigError, MempoError
from mempo.evaluation.agents import (
    AGENTS,
    MULTI_TURN_AGENTS,
    ExternalMemoryContext,
    forced_answer_text,
    single_turn_messages,
    turn_transcript,
)
from mempo.evaluation.benchmarks import load_benchmarks
from mempo.evaluation.metrics import SAMPLE_COLUMNS, aggregate, answer_scores

log = logging.getLogger(__name__)

CONTEXT_OF_AGENT = {"memory": "memory", "full_context": "full", "external_memory": "external"}


@dataclass
class EvalSettings:
    """The knobs of one evaluation (the `eval:` params section, minus model/benchmark choice).

    Attributes:
        max_turns: turns per objective; a k-objective task gets `min(k * max_turns, max_turns_cap)`.
        max_prompt_tokens: the eval-time context window: an episode whose next prompt is
            longer stops there, is recorded as truncated and scored as wrong.
        max_new_tokens: tokens generated per turn.
        max_obs_tokens: a tool result is cut to this many tokens before it enters a prompt.
        temperature: 0 = greedy.
    """

    concurrency: int = 16
    max_prompt_tokens: int = 4096
    seed: int = 0
    max_turns: int = 6
    max_turns_cap: int = 64
    topk: int = 3
    max_new_tokens: int = 160
    max_obs_tokens: int = 256
    temperature: float = 0.0
    memory_probe: bool = True
    external_memory_encoder: str = "hashing"
    external_memory_snippets: int = 3

    @classmethod
    def from_params(cls, p: Any) -> EvalSettings:
        """From an `EvalParams` (or anything with the same attributes)."""
        return cls(**{name: getattr(p, name) for name in cls.__dataclass_fields__})

    def rollout_config(self) -> Any:
        """The rollout limits: `max_turns` per objective, capped at `max_turns_cap`."""
        from mempo.agent.rollout import RolloutConfig

        return RolloutConfig(max_turns=self.max_turns_cap, turns_per_objective=self.max_turns,
                             max_prompt_tokens=self.max_prompt_tokens,
                             max_concurrent_episodes=self.concurrency)


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


@dataclass
class EvalResult:
    """What `run_eval` wrote."""

    out: Path
    metrics: dict[str, float | int]
    rows: list[dict[str, Any]] = field(repr=False)
    meta: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None


# ---------------------------------------------------------------------------- agents


class _TimedPolicy:
    """Wraps a TurnPolicy to stamp when each episode asks for its first turn (latency)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.started: dict[str, float] = {}

    async def respond(self, request: Any) -> Any:
        self.started.setdefault(request.episode_id, time.perf_counter())
        return await self.inner.respond(request)


def sampling_params(settings: EvalSettings, stop: Sequence[str] | None = None) -> Any:
    """Generation settings for evaluation: greedy unless `temperature` > 0 (then seeded)."""
    from mempo.agent.generation import SamplingParams

    kw: dict[str, Any] = dict(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        seed=settings.seed if settings.temperature > 0 else None,
        logprobs=False,
    )
    if stop is not None:
        kw["stop"] = tuple(stop)
    return SamplingParams(**kw)


def _base_row(agent: str, bench: str, item: QAItem, k: int, engine: Engine) -> dict[str, Any]:
    return {
        "agent": agent, "policy": engine.policy, "benchmark": bench, "id": item.id, "question": item.question,
        "golden_answers": list(item.golden_answers), "k": k,
    }


def _finish_row(row: dict[str, Any], item: QAItem, prediction: str | None, truncated: bool) -> dict[str, Any]:
    scores = answer_scores(None if truncated else prediction, item.golden_answers, item.metadata)
    row.update(scores)
    row["prediction"] = prediction or ""
    row["truncated"] = float(truncated)
    for col in SAMPLE_COLUMNS:
        row.setdefault(col, "" if col in ("policy", "final_memory", "transcript", "error", "prediction") else float("nan"))
    return row


def run_multi_turn(
    agent: str,
    bench: str,
    items: Sequence[QAItem],
    engine: Engine,
    settings: EvalSettings,
    k: int = 1,
) -> list[dict[str, Any]]:
    """Episodes of a multi-turn agent (memory, full_context, external_memory) through the core
    rollout loop; one sample row per item (see `mempo.evaluation.metrics.SAMPLE_COLUMNS`)."""
    from mempo.agent.rollout import GeneratorPolicy, arun_episodes
    from mempo.agent.tools import ToolConfig, ToolEnv
    from mempo.forgetting import SEEN, episode_forgot

    if engine.retriever is None:
        raise MempoError(f"agent '{agent}' needs a retriever (eval.retriever)")
    policy = _TimedPolicy(engine.turn_policy or GeneratorPolicy(
        engine.generator, sampling_params(settings), max_batch=settings.concurrency))
    env = ToolEnv(engine.retriever, engine.tokenizer,
                  ToolConfig(topk=settings.topk, observation_max_tokens=settings.max_obs_tokens))
    config = settings.rollout_config()
    ended: dict[str, float] = {}
    context: Any = CONTEXT_OF_AGENT[agent]
    if agent == "external_memory":
        from mempo.evaluation.vector_store import make_encoder

        encoder = make_encoder(settings.external_memory_encoder)

        def external_memory(question: str, system_prompt: str) -> ExternalMemoryContext:
            return ExternalMemoryContext(question, encoder, settings.external_memory_snippets, system_prompt)

        context = external_memory

    episodes = asyncio.run(arun_episodes(
        list(items), policy, env, engine.tokenizer, context=context, config=config,
        on_episode=lambda ep: ended.__setitem__(ep.episode_id, time.perf_counter()),
        progress=True,
    ))
    rows = []
    for item, ep in zip(items, episodes, strict=True):
        row = _base_row(agent, bench, item, k, engine)
        if agent == "memory" and len(ep.objectives) > 1:
            steps = ep.memory_steps()
            row["forgetting_rate"] = float(episode_forgot(ep.objectives, steps))
            row["forgetting_rate_seen"] = float(episode_forgot(ep.objectives, steps, SEEN))
        prompts = ep.prompt_tokens
        memories = [t.memory for t in ep.turns if t.memory is not None]
        row.update(
            format_valid=float(ep.format_valid),
            turns=ep.num_turns,
            searches=sum(1 for t in ep.turns if t.action in ("search", "access") and t.valid),
            peak_prompt_tokens=max(prompts, default=0),
            total_prompt_tokens=sum(prompts),
            generated_tokens=ep.response_tokens,
            latency_s=ended.get(ep.episode_id, 0.0) - policy.started.get(ep.episode_id, ended.get(ep.episode_id, 0.0)),
            hit_turn_limit=float(ep.hit_turn_limit),
            prompt_tokens_by_turn=list(prompts),
            final_memory=memories[-1] if memories else "",
            transcript=json.dumps([
                {**turn_transcript(t.parsed, t.observation, t.prompt_length), "observation": t.observation}
                for t in ep.turns
            ], ensure_ascii=False),
            error="context window exceeded" if ep.hit_context_limit else "",
        )
        rows.append(_finish_row(row, item, ep.final_answer, truncated=ep.hit_context_limit))
    return rows


def run_single_turn(
    agent: str,
    bench: str,
    items: Sequence[QAItem],
    engine: Engine,
    settings: EvalSettings,
    k: int = 1,
) -> list[dict[str, Any]]:
    """The `direct` and `rag` baselines: one turn per item (see `mempo.evaluation.agents`),
    forced to an answer when the model searched instead; batched `concurrency` at a time."""
    from mempo.agent.format import format_observation, parse_turn, render_prompt
    from mempo.evaluation.agents import forced_answer_prefix
    from mempo.retrieval.base import format_passages

    tok = engine.tokenizer
    observations: list[str | None] = [None] * len(items)
    if agent == "rag":
        if engine.retriever is None:
            raise MempoError("agent 'rag' needs a retriever (eval.retriever)")
        hits = engine.retriever.search([it.question for it in items], topk=settings.topk) if items else []
        observations = [format_observation(format_passages(h) if h else "No results.", tok, settings.max_obs_tokens)
                        for h in hits]
    messages = [single_turn_messages(it.question, obs) for it, obs in zip(items, observations, strict=True)]
    prompts = [tok.encode(render_prompt(tok, m), add_special_tokens=False) for m in messages]
    latency = [0.0] * len(items)

    def generate(idx: list[int], prompt_of: dict[int, list[int]], sampling: Any, desc: str) -> dict[int, Any]:
        from tqdm.auto import tqdm

        out: dict[int, Any] = {}
        for start in tqdm(range(0, len(idx), settings.concurrency), desc=desc, leave=False):
            batch = idx[start:start + settings.concurrency]
            t0 = time.perf_counter()
            gens = engine.generator.generate([prompt_of[i] for i in batch], sampling)
            dt = time.perf_counter() - t0
            for i, g in zip(batch, gens, strict=True):
                out[i] = g
                latency[i] += dt
        return out

    fits = [i for i, p in enumerate(prompts) if len(p) <= settings.max_prompt_tokens]
    first = generate(fits, dict(enumerate(prompts)), sampling_params(settings), f"{agent} ({bench})")
    parsed_first = {i: parse_turn(g.text) for i, g in first.items()}
    # Turns that did not answer continue from their own memory and reasoning into `<answer> `.
    prefixes = {i: forced_answer_prefix(p) for i, p in parsed_first.items() if p.action != "answer"}
    forced_prompts = {i: tok.encode(render_prompt(tok, messages[i], prefixes[i]), add_special_tokens=False)
                      for i in prefixes}
    forced_fits = [i for i in prefixes if len(forced_prompts[i]) <= settings.max_prompt_tokens]
    forced = generate(forced_fits, forced_prompts, sampling_params(settings),
                      f"{agent} ({bench}, answers)")

    rows = []
    for i, item in enumerate(items):
        row = _base_row(agent, bench, item, k, engine)
        g1 = first.get(i)
        truncated = g1 is None or (i in prefixes and i not in forced)
        lengths = [len(prompts[i])] + ([len(forced_prompts[i])] if i in forced_prompts else [])
        answer: str | None = None
        valid = False
        final_text = ""
        if not truncated and g1 is not None:
            if i in forced:
                final_text = prefixes[i] + forced[i].text
                final = parse_turn(final_text)
                answer = final.argument if final.action == "answer" else forced_answer_text(forced[i].text)[0]
            else:
                final_text, final = g1.text, parsed_first[i]
                answer = final.argument
            valid = parsed_first[i].valid and final.valid and final.action == "answer"
        parsed = parse_turn(final_text)
        row.update(
            format_valid=float(valid),
            turns=0 if g1 is None else 1,
            searches=int(agent == "rag"),
            peak_prompt_tokens=max(lengths),
            total_prompt_tokens=sum(lengths),
            generated_tokens=sum(len(g.token_ids) for g in (g1, forced.get(i)) if g is not None),
            latency_s=latency[i],
            hit_turn_limit=0.0,
            prompt_tokens_by_turn=lengths,
            final_memory="",
            transcript=json.dumps([{
                **turn_transcript(parsed, observations[i], max(lengths)),
                "forced_answer": i in prefixes, "first_response": None if g1 is None else g1.text,
                "observation": observations[i],
            }], ensure_ascii=False),
            error="context window exceeded" if truncated else "",
        )
        rows.append(_finish_row(row, item, answer, truncated=truncated))
    return rows


def add_memory_probe(rows: list[dict[str, Any]], engine: Engine, batch_size: int = 16) -> None:
    """Set `memory_probe` = P(gold answer | question, final memory) on rows with a memory.

    P is `mempo.advantage.answer_probability` (geometric-mean token probability of the
    first gold answer, teacher-forced after the answer-probe prompt). Rows without a memory,
    or without a local model (backend openai), keep NaN.
    """
    if engine.model is None:
        return
    from mempo.advantage import answer_probability
    from mempo.agent.format import (
        ANSWER_PROBE_PREFIX,
        answer_continuation,
        answer_probe_messages,
        render_prompt,
    )

    todo = [r for r in rows if r["agent"] in MULTI_TURN_AGENTS and r.get("final_memory")]
    if not todo:
        return
    prompts = [render_prompt(engine.tokenizer, answer_probe_messages(r["question"], r["final_memory"]),
                             ANSWER_PROBE_PREFIX) for r in todo]
    answers = [answer_continuation(r["golden_answers"][0]) for r in todo]
    probs = answer_probability(engine.model, engine.tokenizer, prompts, answers, batch_size=batch_size).prob
    for r, p in zip(todo, probs.tolist(), strict=True):
        r["memory_probe"] = float(p)


def evaluate_items(
    benchmarks: Mapping[str, Sequence[QAItem]],
    agents: Sequence[str],
    engine: Engine | Mapping[str, Engine],
    settings: EvalSettings,
    on_pair: Callable[[str, str, list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every agent on every benchmark; returns all sample rows (benchmark, then agent order).

    `engine`: one engine for every agent, or agent -> engine (each agent on its own policy)."""
    unknown = [a for a in agents if a not in AGENTS]
    if unknown:
        raise ConfigError(f"unknown agent(s) {unknown}; choose from {list(AGENTS)}", field="eval.agents")
    engines = {a: engine for a in agents} if isinstance(engine, Engine) else dict(engine)
    rows: list[dict[str, Any]] = []
    for bench, items in benchmarks.items():
        k = max((int(it.metadata.get("k", 1) or 1) for it in items), default=1)
        for agent in agents:
            t0 = time.perf_counter()
            run = run_multi_turn if agent in MULTI_TURN_AGENTS else run_single_turn
            pair = run(agent, bench, items, engines[agent], settings, k)
            if settings.memory_probe:
                add_memory_probe(pair, engines[agent])
            log.info("eval %s on %s: %d samples in %.1f s, EM %.3f", agent, bench, len(pair),
                     time.perf_counter() - t0,
                     sum(r["em"] for r in pair) / max(1, len(pair)))
            if on_pair is not None:
                on_pair(agent, bench, pair)
            rows.extend(pair)
    return rows


# ---------------------------------------------------------------------------- outputs


def write_samples(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """`samples.parquet`: one row per sample, columns `SAMPLE_COLUMNS` in order (atomic)."""
    import pandas as pd

    from mempo.io import atomic_path

    frame = pd.DataFrame([{c: r.get(c) for c in SAMPLE_COLUMNS} for r in rows], columns=list(SAMPLE_COLUMNS))
    for col in ("turns", "searches", "peak_prompt_tokens", "total_prompt_tokens", "generated_tokens", "k"):
        frame[col] = frame[col].astype("int64")
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)
    return Path(path)


def genai_subset(rows: Sequence[Mapping[str, Any]], per_agent: int) -> list[Mapping[str, Any]]:
    """The first rows of each (agent, benchmark), about `per_agent` rows per agent in all."""
    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    per_pair = max(1, per_agent // max(1, len(benches)))
    taken: dict[tuple[str, str], int] = {}
    out = []
    for r in rows:
        key = (r["agent"], r["benchmark"])
        if taken.get(key, 0) < per_pair:
            taken[key] = taken.get(key, 0) + 1
            out.append(r)
    return out


def genai_scores(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Score samples with `mlflow.genai.evaluate` and code scorers (EM, F1, substring EM, the
    `mempo.rewards` functions through `answer_scores`), one evaluation per agent in a nested
    MLflow run `genai-<agent>`; each sample becomes an MLflow trace with its assessments.

    Runs offline against sqlite with no LLM judge. It logs a trace per sample (about 0.3 s
    each on sqlite here), which is why the runner scores a subset (`mlflow_genai_samples`).
    Rows may carry `_objectives` (per-objective gold lists) for multi-objective tasks.

    Returns `{agent: {"em": mean, "f1": mean, "substring_em": mean}}` as MLflow computed them.
    """
    import os

    import mlflow
    from mlflow.genai.scorers import scorer

    from mempo.evaluation.metrics import answer_scores as _scores

    def _score(name: str) -> Any:
        def fn(outputs: dict[str, Any], expectations: dict[str, Any]) -> float:
            objectives = expectations.get("objectives")
            meta = {"objectives": [{"golden_answers": o} for o in objectives]} if objectives else None
            return float(_scores(outputs.get("prediction") or None, expectations["golden_answers"], meta)[name])

        fn.__name__ = name
        return scorer(fn)

    scorers = [_score("em"), _score("f1"), _score("substring_em")]
    out: dict[str, dict[str, float]] = {}
    # sqlite serialises writers: parallel trace logging only exhausts the connection pool.
    saved = {k: os.environ.get(k) for k in ("MLFLOW_GENAI_EVAL_MAX_WORKERS", "MLFLOW_GENAI_EVAL_MAX_SCORER_WORKERS")}
    if mlflow.get_tracking_uri().startswith("sqlite"):
        for k in saved:
            os.environ.setdefault(k, "1")
    try:
        for agent in dict.fromkeys(r["agent"] for r in rows):
            data = []
            for r in rows:
                if r["agent"] != agent:
                    continue
                expectations: dict[str, Any] = {"golden_answers": list(r["golden_answers"])}
                if r.get("_objectives"):
                    expectations["objectives"] = [list(o) for o in r["_objectives"]]
                data.append({
                    "inputs": {"question": r["question"], "benchmark": r["benchmark"], "id": r["id"]},
                    "outputs": {"prediction": "" if r["truncated"] else r["prediction"]},
                    "expectations": expectations,
                })
            with mlflow.start_run(run_name=f"genai-{agent}", nested=True):
                res = mlflow.genai.evaluate(data=data, scorers=scorers)
            out[agent] = {m.split("/")[0]: float(v) for m, v in res.metrics.items() if m.endswith("/mean")}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def write_outputs(
    out: str | Path,
    rows: list[dict[str, Any]],
    meta: Mapping[str, Any],
) -> dict[str, float | int]:
    """Write samples.parquet, metrics.json, plots, report.md/.html and eval.json into `out`
    (atomically: the folder is replaced whole). Returns the flat metrics."""
    from mempo.evaluation.report import write_plots, write_report
    from mempo.io import atomic_dir, write_json

    flat = aggregate(rows)
    with atomic_dir(out) as tmp:
        write_samples(tmp / "samples.parquet", rows)
        write_json(tmp / "metrics.json", flat)
        plots = write_plots(tmp / "plots", flat, rows)
        write_report(tmp, flat, header={k: v for k, v in meta.items() if not isinstance(v, dict | list)}, plots=plots,
                     rows=rows, policies=meta.get("policies"))
        write_json(tmp / "eval.json", dict(meta))
    return flat


# ---------------------------------------------------------------------------- engine

# The context each agent runs in; a policy trained in the same one runs in its own format.
AGENT_CONTEXT = {"memory": "memory", "full_context": "full", "external_memory": "external",
                 "rag": "single-turn", "direct": "single-turn"}


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
) -> Engine:
    """Tokenizer + generator (+ model for hf) + retriever for an evaluation. `decoder`
    ("fast" | "hf", `agent.decoder`) picks the in-process generator of backend hf."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mempo.agent.generation import OpenAIGenerator, make_generator

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    model = None
    if backend == "hf":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(device).eval()
        generator: Any = make_generator(model, tokenizer, decoder, batch_size=concurrency)
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


def run_eval(p: Any, benchmarks: Any, *, engine: Engine | None = None, track: bool = True,
             decoder: str = "fast") -> EvalResult:
    """The `eval` stage: load benchmarks, resolve the model, run the agents, write and log outputs.

    Args:
        p: the `eval:` params section (`mempo.config.EvalParams`).
        benchmarks: the `benchmarks:` section (`BenchmarksParams`) or a name -> path mapping.
        engine: an already built engine (tests, `mempo ask` reuse); built from `p` otherwise.
        track: log to an MLflow `eval` stage run (also off with MEMPO_TRACKING=0).
        decoder: the in-process generator when the engine is built here (`agent.decoder`).
    """
    from mempo.evaluation.model_ref import resolved_model

    settings = EvalSettings.from_params(p)
    paths = benchmarks.paths() if hasattr(benchmarks, "paths") else dict(benchmarks)
    unknown = [a for a in p.agents if a not in AGENTS]
    if unknown:
        raise ConfigError(f"unknown agent(s) {unknown}; choose from {list(AGENTS)}", field="eval.agents")
    # Fail on a missing benchmark file before any model is loaded.
    items = load_benchmarks(list(p.benchmarks), paths, limit=p.limit, seed=p.seed)
    needs_retriever = any(a != "direct" for a in p.agents)

    # Each agent runs the policy trained for it (eval.models), else eval.model.
    refs = {a: p.models.get(a, p.model) for a in p.agents}
    with contextlib.ExitStack() as cleanup:
        resolved = {ref: cleanup.enter_context(resolved_model(ref)) for ref in dict.fromkeys([p.model, *refs.values()])}
        model = resolved[p.model]
        if engine is None:
            engines_by_ref = {ref: load_engine(
                m.path, m.tokenizer_path, backend=p.backend, device=p.device, openai_url=p.openai_url,
                served_model=p.served_model, concurrency=p.concurrency, decoder=decoder) for ref, m in resolved.items()
                if ref in refs.values()}
            if needs_retriever:
                from mempo.retrieval import open_retriever

                shared = open_retriever(p.retriever)
                cleanup.callback(shared.close)
                for e in engines_by_ref.values():
                    e.retriever = shared
            for ref, e in engines_by_ref.items():
                e.policy, e.policy_context = ref, policy_context(resolved[ref].path)
            engines: Engine | dict[str, Engine] = {a: engines_by_ref[refs[a]] for a in p.agents}
        else:
            engines = engine
        meta: dict[str, Any] = {
            **model.describe(),
            "policies": {a: {"model": refs[a], "trained_context": policy_context(resolved[refs[a]].path),
                             "agent_context": AGENT_CONTEXT[a]} for a in p.agents},
            "backend": p.backend,
            "decoder": decoder if p.backend == "hf" else "",
            "retriever": p.retriever if needs_retriever else "",
            "agents": ", ".join(p.agents),
            "benchmarks": ", ".join(f"{b} ({len(v)})" for b, v in items.items()),
            "limit": p.limit,
            "seed": p.seed,
            "decoding": "greedy" if p.temperature == 0 else f"temperature {p.temperature}",
            "max_prompt_tokens": p.max_prompt_tokens,
            "max_turns": f"{p.max_turns} per objective, cap {p.max_turns_cap}",
            "settings": settings.__dict__,
        }
        from mempo.tracking import log_metrics, log_plot, stage_run

        # Lineage: each source file once (the world-k* tasks are composed from `world`).
        sources = dict.fromkeys("world" if n.startswith("world-k") else n for n in items)
        data = {f"benchmark_{n}": paths[n] for n in sources}
        run_cm: Any = (
            stage_run("eval", params=p, data=data, tags={f"mempo.{k}": v for k, v in model.describe().items()})
            if track else contextlib.nullcontext(None)
        )
        with run_cm as run:
            run_id = getattr(getattr(run, "info", None), "run_id", None)
            t0 = time.perf_counter()
            rows = evaluate_items(items, p.agents, engines, settings)
            meta["wall_s"] = round(time.perf_counter() - t0, 1)
            meta["samples"] = len(rows)
            if run_id is not None:
                meta["mlflow_run_id"] = run_id  # `mempo register` links the model to this run
            flat = write_outputs(p.out, rows, meta)
            if run_id is not None:
                import mlflow

                log_metrics(flat)
                out = Path(p.out)
                for name in ("metrics.json", "report.md", "report.html", "samples.parquet", "eval.json"):
                    mlflow.log_artifact(str(out / name))
                log_plot(out / "plots")
                if p.mlflow_genai_samples > 0:
                    _check_genai(rows, items, p.mlflow_genai_samples)
    return EvalResult(out=Path(p.out), metrics=flat, rows=rows, meta=meta, run_id=run_id)


def _check_genai(rows: list[dict[str, Any]], items: Mapping[str, Sequence[QAItem]], per_agent: int) -> None:
    """Score a subset with `mlflow.genai.evaluate` and check it agrees with our own numbers."""
    by_id = {(b, it.id): it for b, its in items.items() for it in its}
    subset = [dict(r) for r in genai_subset(rows, per_agent)]
    for r in subset:
        objs = by_id[(r["benchmark"], r["id"])].metadata.get("objectives")
        r["_objectives"] = [o["golden_answers"] for o in objs] if objs else None
    genai = genai_scores(subset)
    for agent, scores in genai.items():
        mine = [r for r in subset if r["agent"] == agent]
        for metric, value in scores.items():
            own = sum(r[metric] for r in mine) / len(mine)
            if not math.isclose(own, value, abs_tol=1e-9):
                raise MempoError(f"mlflow.genai.evaluate {agent}/{metric} = {value} disagrees with {own}")
