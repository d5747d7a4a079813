"""`eval.workers`: the (benchmark, agent) pairs of one evaluation in worker processes.

    from mempo.evaluation.workers import evaluate_in_workers
    rows = evaluate_in_workers(items, ["memory", "rag"], p, resolved, refs, settings, "fast", workers=2)

Each worker process (a "spawn" process: torch is not fork-safe) sets `eval.threads` torch
threads and builds its own engines once, as `mempo eval` in one process does
(`mempo.evaluation.engine.engines_for`: its own copy of the model(s) and the retriever), from
the model folders the parent resolved (a registry model is downloaded once, by the parent,
and lives until the parent's evaluation ends). A pair runs through
`mempo.evaluation.agent_runner.evaluate_items`, memory probe included, so its rows are those
of the single-process run; they come back in its order (benchmark, then agent) whatever
order the pairs finish in.

Scheduling: the pairs are queued costliest first and a worker takes the next one when it is
free (one pair at a time), so a long pair does not start last. The cost is an estimate,
`pair_cost`: items x objectives per item (k) x 3 for a multi-turn agent (several turns per
objective, longer prompts), x 1 for `rag` and `direct` (one turn).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from mempo.evaluation.agents import MULTI_TURN_AGENTS
from mempo.evaluation.settings import EvalSettings
from mempo.tasks import Task

log = logging.getLogger(__name__)

MULTI_TURN_COST = 3  # a multi-turn episode's cost relative to a one-turn baseline's (estimate)


def pair_cost(agent: str, items: Sequence[Task]) -> int:
    """The estimated cost of running `agent` on `items` (see the module doc)."""
    k = max((it.k for it in items), default=1)
    return len(items) * k * (MULTI_TURN_COST if agent in MULTI_TURN_AGENTS else 1)


def pair_order(
    benchmarks: Mapping[str, Sequence[Task]], agents: Sequence[str]
) -> list[tuple[str, str]]:
    """Every (benchmark, agent) pair, costliest first (ties: benchmark, then agent order)."""
    pairs = [(b, a) for b in benchmarks for a in agents]
    return sorted(pairs, key=lambda pair: -pair_cost(pair[1], benchmarks[pair[0]]))


# One worker process's state: set by `_init_worker`, its engines built by the first pair.
_state: dict[str, Any] = {}


def _init_worker(
    p: Any,
    resolved: Mapping[str, Any],
    refs: Mapping[str, str],
    settings: EvalSettings,
    decoder: str,
    benchmarks: Mapping[str, Sequence[Task]],
    parent: int,
) -> None:
    from mempo.training.runtime import die_with_parent, set_cpu_threads

    die_with_parent(parent)  # a killed `mempo eval` leaves no worker generating on

    os.environ["TQDM_DISABLE"] = "1"  # progress bars of several processes would interleave
    set_cpu_threads(p.threads)
    _state.update(
        p=p, resolved=resolved, refs=refs, settings=settings, decoder=decoder, benchmarks=benchmarks
    )


def _engines() -> Any:
    """This process's engines, built on first use and kept (with the retriever open) for the
    life of the process. Built here, not in the initializer: an error raised by an
    initializer breaks the pool without its message, one raised by a pair reaches the parent."""
    if "engines" not in _state:
        if "error" in _state:
            raise _state["error"]
        from mempo.evaluation.engine import engines_for

        cleanup = contextlib.ExitStack()
        atexit.register(cleanup.close)
        try:
            _state["engines"] = engines_for(
                _state["p"], _state["resolved"], _state["refs"], _state["decoder"], cleanup
            )
        except BaseException as e:
            _state["error"] = e
            raise
    return _state["engines"]


def _run_pair(bench: str, agent: str) -> tuple[list[dict[str, Any]], float]:
    """One pair in a worker: its sample rows and seconds (engine loading not included)."""
    from mempo.evaluation.agent_runner import evaluate_items

    try:
        engines = _engines()
        t0 = time.perf_counter()
        rows = evaluate_items(
            {bench: _state["benchmarks"][bench]}, [agent], engines, _state["settings"]
        )
        return rows, time.perf_counter() - t0
    except BaseException as e:
        # The parent re-raises the exception it unpickles; one that does not survive pickling
        # would break the pool instead, so send its type and message.
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        raise


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel the queued pairs and end the workers now (not after their current pair)."""
    pool.shutdown(wait=False, cancel_futures=True)
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14+
    if terminate is not None:
        terminate()
    else:
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
    pool.shutdown(wait=True)


def evaluate_in_workers(
    benchmarks: Mapping[str, Sequence[Task]],
    agents: Sequence[str],
    p: Any,
    resolved: Mapping[str, Any],
    refs: Mapping[str, str],
    settings: EvalSettings,
    decoder: str,
    workers: int,
) -> list[dict[str, Any]]:
    """`evaluate_items` with the pairs in `workers` processes; the same rows, in its order.

    Args:
        benchmarks: benchmark -> items, as `load_benchmarks` returns them.
        agents: the agents, in report order.
        p: the `eval:` section (backend, device, retriever, threads, ... of the engines).
        resolved: model reference -> `ResolvedModel` (local folders, resolved by the caller
            and alive until this returns); refs: agent -> model reference.
        settings, decoder: as the single-process run's.
        workers: processes (at most one per pair).

    Raises:
        The first exception a pair raised, as raised in its worker (type and message; the
        worker's traceback is its `__cause__`). The other pairs are cancelled.
    """
    order = pair_order(benchmarks, agents)
    n = min(workers, len(order))
    done: dict[tuple[str, str], list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    log.info(
        "eval: %d pairs in %d worker processes, %d torch thread(s) each", len(order), n, p.threads
    )
    pool = ProcessPoolExecutor(
        max_workers=n,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(p, dict(resolved), dict(refs), settings, decoder, dict(benchmarks), os.getpid()),
    )
    try:
        futures: dict[Future[Any], tuple[str, str]] = {
            pool.submit(_run_pair, b, a): (b, a) for b, a in order
        }
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                bench, agent = futures[fut]
                rows, seconds = fut.result()  # re-raises a worker's exception
                done[bench, agent] = rows
                log.info(
                    "eval %s on %s: %d samples in %.1f s, EM %.3f [%d/%d pairs, %.0f s]",
                    agent,
                    bench,
                    len(rows),
                    seconds,
                    sum(r["em"] for r in rows) / max(1, len(rows)),
                    len(done),
                    len(order),
                    time.perf_counter() - t0,
                )
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown(wait=True)
    return [row for bench in benchmarks for agent in agents for row in done[bench, agent]]
