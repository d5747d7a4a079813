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

The parts live in one module each: `settings` (EvalSettings, sampling), `engine` (model,
generator, retriever), `agent_runner` (episodes -> sample rows), `probe` (the memory probe),
`outputs` (the output folder), `genai` (the MLflow GenAI cross-check), `workers` (the pairs
in `eval.workers` processes). This module is the stage that strings them together.

Deterministic: greedy decoding by default (temperature 0; a turn whose prompt its episode
already had is sampled at `eval.rollout.repeat_temperature` from a seed of `seed`, the episode
and the turn), world-k* tasks composed with `seed`, benchmarks truncated to the first `limit`
items, so two models see identical inputs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mempo.errors import ConfigError
from mempo.evaluation.agent_runner import evaluate_items
from mempo.evaluation.agents import AGENTS
from mempo.evaluation.benchmarks import load_benchmarks
from mempo.evaluation.engine import AGENT_CONTEXT, Engine, engines_for, policy_context
from mempo.evaluation.outputs import write_outputs
from mempo.evaluation.settings import EvalSettings
from mempo.evaluation.workers import evaluate_in_workers
from mempo.tasks import Task


@dataclass
class EvalResult:
    """What `run_eval` wrote."""

    out: Path
    metrics: dict[str, float | int]
    rows: list[dict[str, Any]] = field(repr=False)
    meta: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None


def run_eval(p: Any, benchmarks: Any, *, engine: Engine | None = None, track: bool = True,
             decoder: str | None = None) -> EvalResult:
    """The `eval` stage: load benchmarks, resolve the model, run the agents, write and log outputs.

    Args:
        p: the `eval:` params section (`mempo.config.EvalParams`).
        benchmarks: the `benchmarks:` section (`BenchmarksParams`) or a name -> path mapping.
        engine: an already built engine (tests, `mempo ask` reuse), run in this process;
            built from `p` otherwise (in each of `eval.workers` processes when > 1).
        track: log to an MLflow `eval` stage run (also off with MEMPO_TRACKING=0).
        decoder: the in-process generator when the engine is built here (None: the
            resolved `eval.rollout` / `rollout.decoder`).
    """
    from mempo.evaluation.model_ref import resolved_model
    from mempo.tracking import stage_run
    from mempo.training.runtime import set_cpu_threads

    settings = EvalSettings.from_params(p)
    decoder = decoder or settings.rollout.decoder
    set_cpu_threads(p.threads)
    paths = benchmarks.paths() if hasattr(benchmarks, "paths") else dict(benchmarks)
    unknown = [a for a in p.agents if a not in AGENTS]
    if unknown:
        raise ConfigError(f"unknown agent(s) {unknown}; choose from {list(AGENTS)}", field="eval.agents")
    # Fail on a missing benchmark file before any model is loaded.
    items = load_benchmarks(list(p.benchmarks), paths, limit=p.limit, seed=p.seed)

    # Each agent runs the policy trained for it (eval.models), else eval.model.
    refs = {a: p.models.get(a, p.model) for a in p.agents}
    # eval.workers > 1: the pairs in worker processes, each building its own engines.
    workers = 1 if engine is not None else min(p.workers, len(items) * len(p.agents))
    with contextlib.ExitStack() as cleanup:
        resolved = {ref: cleanup.enter_context(resolved_model(ref)) for ref in dict.fromkeys([p.model, *refs.values()])}
        model = resolved[p.model]
        engines = engine if engine is not None or workers > 1 else engines_for(p, resolved, refs, decoder, cleanup)
        meta = _meta(p, settings, items, model.describe(), {a: resolved[r].path for a, r in refs.items()}, decoder,
                     workers)
        # Lineage: each source file once (the world-k* tasks are composed from `world`).
        sources = dict.fromkeys("world" if n.startswith("world-k") else n for n in items)
        run_cm: Any = (
            stage_run("eval", params=p, data={f"benchmark_{n}": paths[n] for n in sources},
                      tags={f"mempo.{k}": v for k, v in model.describe().items()})
            if track else contextlib.nullcontext(None)
        )
        with run_cm as run:
            run_id = getattr(getattr(run, "info", None), "run_id", None)
            t0 = time.perf_counter()
            if workers > 1:
                rows = evaluate_in_workers(items, p.agents, p, resolved, refs, settings, decoder, workers)
            else:
                rows = evaluate_items(items, p.agents, engines, settings)
            meta["wall_s"] = round(time.perf_counter() - t0, 1)
            meta["samples"] = len(rows)
            if run_id is not None:
                meta["mlflow_run_id"] = run_id  # `mempo register` links the model to this run
            flat = write_outputs(p.out, rows, meta)
            if run_id is not None:
                _log_outputs(Path(p.out), flat, rows, items, p.mlflow_genai_samples)
    return EvalResult(out=Path(p.out), metrics=flat, rows=rows, meta=meta, run_id=run_id)


def _meta(p: Any, settings: EvalSettings, items: Mapping[str, Sequence[Task]], model: Mapping[str, Any],
          policy_paths: Mapping[str, Path], decoder: str, workers: int = 1) -> dict[str, Any]:
    """`eval.json`: the model, each agent's policy and context, the settings and the counts
    (`workers`: the processes that ran the pairs, 1 = the evaluating process)."""
    needs_retriever = any(a != "direct" for a in p.agents)
    r = settings.rollout
    return {
        **model,
        "policies": {a: {"model": p.models.get(a, p.model), "trained_context": policy_context(policy_paths[a]),
                         "agent_context": AGENT_CONTEXT[a]} for a in p.agents},
        "backend": p.backend,
        "decoder": decoder if p.backend == "hf" else "",
        "workers": workers,
        "retriever": p.retriever if needs_retriever else "",
        "agents": ", ".join(p.agents),
        "benchmarks": ", ".join(f"{b} ({len(v)})" for b, v in items.items()),
        "limit": p.limit,
        "seed": p.seed,
        "decoding": (f"temperature {r.temperature}" if r.temperature > 0 else "greedy" if not r.repeat_temperature
                     else f"greedy; a prompt seen before in the episode sampled at temperature {r.repeat_temperature}"),
        "max_prompt_tokens": r.max_prompt_tokens,
        "max_turns": f"{r.turns_per_objective} per objective, cap {r.max_turns}",
        "settings": settings.describe(),
    }


def _log_outputs(out: Path, flat: Mapping[str, float | int], rows: list[dict[str, Any]],
                 items: Mapping[str, Sequence[Task]], genai_samples: int) -> None:
    """Log the metrics, the output files and plots to the active run; cross-check a subset
    with `mlflow.genai.evaluate` when `genai_samples` > 0."""
    import mlflow

    from mempo.evaluation.genai import check_genai
    from mempo.tracking import log_metrics, log_plot

    log_metrics(dict(flat))
    for name in ("metrics.json", "report.md", "report.html", "samples.parquet", "eval.json"):
        mlflow.log_artifact(str(out / name))
    log_plot(out / "plots")
    if genai_samples > 0:
        check_genai(rows, items, genai_samples)
