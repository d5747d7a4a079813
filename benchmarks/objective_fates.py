"""Why multi-objective answers come out wrong: each objective's fate, per trained policy.

    .venv/bin/python benchmarks/objective_fates.py --from-pipeline <run> \\
        --workdirs <learning.py --workdir>/pipeline --variants grpo mempo_half --seeds 0 1 2 3 4 \\
        --out benchmarks/results/objective_fates.json

    .venv/bin/python benchmarks/objective_fates.py --start benchmarks/starts/c9cbcc85 \\
        --workdirs <learning.py --workdir>/full --variants grpo mempo_half --seeds 0 1 2 3

    .venv/bin/python benchmarks/objective_fates.py --study-sft --workdirs <learning.py --workdir>/full-sft-...

For the memory-format SFT checkpoint of a finished `make run` (`--from-pipeline`), a saved
start (`--start`, with the study's world from the first `--workdirs`) or the one a study trained
itself (`--study-sft`: the first `--workdirs`' sft-memory/model and world), and the RL
checkpoints a learning study kept (`<workdir>/rl-<variant>-seed<s>/model`, the first of
`--workdirs` that has it), greedy evaluation through `mempo eval`'s code on the learning study's
own held-out world-k2 and world-k4 tasks (`benchmarks/learning.py`'s `test_tasks`), then, per
objective of every task, where its answer ended up (`mempo.forgetting.objective_fates`): right;
never retrieved; retrieved but never written to a memory; in a memory, then dropped; in the last
memory and still answered wrong. With how the episode ended (answered, turn limit, context
limit), and in what order its memories took the objectives on (the question after "Now:",
`mempo.agent.teacher.objective_order`): all in order, in order but stopped early, skipped one,
went back, a question the task does not have, or none. Per variant: the shares per seed and their mean, per set and objective position.
Writes the JSON and beside it a plot (`.png`): the shares as stacked bars, and per objective
position the share right and the share never retrieved (`--replot JSON` redraws it from the
file). Jobs run in `--jobs` single-threaded processes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from mempo.errors import MempoError  # noqa: E402
from mempo.forgetting import FATES, MemoryStep, objective_fates  # noqa: E402
from mempo.io import weights_sha256, write_json  # noqa: E402
from mempo.training.runtime import die_with_parent  # noqa: E402

SETS = ("k2", "k4")


def row_fates(row: dict[str, Any], objectives: list[list[str]]) -> tuple[str, list[str]]:
    """How one evaluated episode ended (`episode_outcome`'s limits, else "answered") and each
    objective's fate (`objective_fates`)."""
    from mempo.evaluation.outcomes import episode_outcome
    from mempo.rewards import multi_objective_scores

    turns = json.loads(row["transcript"]) if row.get("transcript") else []
    steps = [MemoryStep(t.get("memory"), t.get("observation")) for t in turns]
    prediction = row.get("prediction") or None
    correct = multi_objective_scores(prediction, objectives).per_objective
    outcome = episode_outcome(row)
    ended = outcome if outcome in ("context limit", "turn limit", "no answer") else "answered"
    return ended, objective_fates(objectives, steps, correct)


ORDERS = ("all in order", "in order, stopped early", "skipped one", "went back", "miscopied", "no question")


def order_kind(order: list[int], k: int) -> str:
    """How an episode moved through its k objectives (`mempo.agent.teacher.objective_order`'s
    list): one of `ORDERS`, the first that applies from the end of the tuple backwards."""
    if not order:
        return ORDERS[5]
    if 0 in order:
        return ORDERS[4]
    if any(b < a for a, b in zip(order, order[1:], strict=False)):
        return ORDERS[3]
    if order[0] != 1 or any(b > a + 1 for a, b in zip(order, order[1:], strict=False)):
        return ORDERS[2]
    return ORDERS[0] if order[-1] == k else ORDERS[1]


def fate_shares(rows: list[dict[str, Any]], tasks: dict[str, Any]) -> dict[str, Any]:
    """Shares of objectives per fate (all positions, and per position), and of episodes per end
    and per order in which their memories took the objectives on (`order_kind`)."""
    from mempo.agent.teacher import objective_order

    by_pos: dict[int, Counter[str]] = {}
    ends: Counter[str] = Counter()
    orders: Counter[str] = Counter()
    for row in rows:
        task = tasks[row["id"]]
        ended, fates = row_fates(row, [list(o) for o in task.answer_lists])
        ends[ended] += 1
        memories = [t.get("memory") for t in json.loads(row["transcript"])] if row.get("transcript") else []
        orders[order_kind(objective_order(memories, [o.question for o in task.objectives]), len(task.objectives))] += 1
        for i, f in enumerate(fates):
            by_pos.setdefault(i + 1, Counter())[f] += 1
    total: Counter[str] = sum(by_pos.values(), Counter())
    n_obj = sum(total.values())
    return {"tasks": len(rows), "ended": {e: c / len(rows) for e, c in sorted(ends.items())},
            "order": {o: orders[o] / len(rows) for o in ORDERS},
            "fates": {f: total[f] / n_obj for f in FATES},
            "fates_by_objective": {str(p): {f: c[f] / sum(c.values()) for f in FATES} for p, c in sorted(by_pos.items())}}


def job(name: str, seed: int | None, model: Path, world: Path) -> tuple[str, int | None, dict[str, Any]]:
    import learning  # benchmarks/learning.py: the study's tasks, params and evaluation

    learning._quiet()
    a = argparse.Namespace(eval_single=500, eval_k2=200, eval_k4=100)
    tasks = {k: v for k, v in learning.test_tasks(world, a).items() if k in SETS}
    rows = learning.evaluate_rows(model, "memory", tasks, world / "corpus.jsonl", "cpu")
    by_id = {t.id: t for items in tasks.values() for t in items}
    return name, seed, {s: fate_shares([r for r in rows if r["benchmark"] == s], by_id) for s in SETS}


def start(a: argparse.Namespace) -> tuple[Path, Path]:
    """(world, memory SFT checkpoint): a finished pipeline's (`--from-pipeline`), or a saved
    start's (`--start`, checked against its hash and the world of the first --workdirs)."""
    import learning

    if a.from_pipeline:
        inputs = learning.pipeline_inputs(a.from_pipeline)
        return inputs["world"], inputs["sft-memory"]
    from mempo.training.starts import load_start

    flag = "--start" if a.start else "--study-sft"
    if not a.workdirs:
        raise MempoError(f"{flag} needs --workdirs: the first one's world/ is the study's world")
    world = a.workdirs[0] / "world"
    if a.start:
        return world, load_start(a.start, ["memory"], world)["memory"]["model"]
    sft = a.workdirs[0] / "sft-memory" / "model"
    if not (sft / "config.json").is_file():
        raise MempoError(f"--study-sft: no trained SFT checkpoint at {sft} (the study trains it first)")
    return world, sft


def models(a: argparse.Namespace, sft: Path) -> list[tuple[str, int | None, Path]]:
    """(variant, seed, model folder): the start's memory SFT checkpoint `sft`, then every variant x seed."""
    rl: list[tuple[str, int | None, Path]] = []
    for v in a.variants:
        for s in a.seeds:
            found = [m for w in a.workdirs if (m := w / f"rl-{v}-seed{s}" / "model").is_dir()]
            if not found:
                raise MempoError(f"no rl-{v}-seed{s}/model in {', '.join(map(str, a.workdirs)) or '(no --workdirs)'}")
            rl.append((v, s, found[0]))
    return [("sft", None, sft), *rl]


def summarise(results: list[tuple[str, int | None, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r[0] for r in results):
        runs = [(seed, res) for n, seed, res in results if n == name]
        per_set: dict[str, Any] = {}
        for s in SETS:
            def mean_of(get: Any, runs: list[tuple[int | None, dict[str, Any]]] = runs, s: str = s) -> float:
                return statistics.fmean(get(res[s]) for _, res in runs)
            keys = runs[0][1][s]
            per_set[s] = {
                "fates": {f: mean_of(lambda r, f=f: r["fates"][f]) for f in FATES},
                "fates_by_objective": {p: {f: mean_of(lambda r, p=p, f=f: r["fates_by_objective"][p][f]) for f in FATES}
                                       for p in keys["fates_by_objective"]},
                "order": {o: mean_of(lambda r, o=o: r["order"][o]) for o in ORDERS},
                "ended": {e: mean_of(lambda r, e=e: r["ended"].get(e, 0.0))
                          for e in sorted({e for _, res in runs for e in res[s]["ended"]})},
                "per_seed": {str(seed): res[s] for seed, res in runs},
            }
        out[name] = {"seeds": [seed for seed, _ in runs], **per_set}
    return out


def _stacked(ax: Any, names: list[str], shares: dict[str, dict[str, float]], kinds: tuple[str, ...],
             colors: list[str], title: str) -> None:
    """One bar per policy, stacked by `kinds` (`shares[name][kind]`)."""
    bottom = [0.0] * len(names)
    for kind, c in zip(kinds, colors, strict=False):
        vals = [shares[n][kind] for n in names]
        ax.bar(names, vals, bottom=bottom, color=c, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_title(title)
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)


def plot(summary: dict[str, Any], path: Path) -> Path:
    """The fates as stacked bars, right / never retrieved per objective position, and (files
    written since the order was measured) the order the memories took the objectives on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["#4c9a2a", "#d62728", "#ff7f0e", "#9467bd", "#8c564b"]
    with_order = all("order" in summary[n][s] for n in summary for s in SETS)
    fig, grid = plt.subplots(2 + with_order, len(SETS), figsize=(5.5 * len(SETS), 4.0 * (2 + with_order)),
                             sharey="row")
    axes, by_pos = grid[0], grid[1]
    names = sorted(summary, key=lambda n: n != "sft")  # the start first (a written JSON has its keys sorted)
    for ax, s in zip(axes, SETS, strict=True):
        _stacked(ax, names, {n: summary[n][s]["fates"] for n in names}, FATES, colors,
                 f"world-{s}: each objective's answer")
    axes[0].set_ylabel("share of objectives (mean over seeds)")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if with_order:
        for ax, s in zip(grid[2], SETS, strict=True):
            _stacked(ax, names, {n: summary[n][s]["order"] for n in names}, ORDERS,
                     ["#4c9a2a", "#a6d96a", "#ff7f0e", "#9467bd", "#8c564b", "#7f7f7f"],
                     f"world-{s}: objectives taken on (Now:)")
        grid[2][0].set_ylabel("share of episodes (mean over seeds)")
        grid[2][-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    # Per objective position: which of a task's objectives the policies get right, and which they never see.
    line_colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, s in zip(by_pos, SETS, strict=True):
        for name, c in zip(names, line_colors, strict=False):
            per = summary[name][s]["fates_by_objective"]
            pos = sorted(per, key=int)
            ax.plot([int(p) for p in pos], [per[p]["right"] for p in pos], "-o", color=c, label=f"{name}: right")
            ax.plot([int(p) for p in pos], [per[p]["never retrieved"] for p in pos], "--x", color=c,
                    label=f"{name}: never retrieved")
        ax.set_title(f"world-{s}: per objective position")
        ax.set_xlabel("objective")
        ax.set_xticks(range(1, 1 + max(len(summary[n][s]["fates_by_objective"]) for n in names)))
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    by_pos[0].set_ylabel("share of that objective (mean over seeds)")
    by_pos[-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--replot", type=Path, metavar="JSON",
                       help="only redraw the plot of a file this script wrote (beside it, .png)")
    where.add_argument("--from-pipeline", type=Path, metavar="ROOT",
                       help="a finished make run (world, corpus, memory SFT checkpoint)")
    where.add_argument("--start", type=Path, metavar="DIR",
                       help="a saved SFT start (benchmarks/starts/<sha>); the world is the first --workdirs' world/")
    where.add_argument("--study-sft", action="store_true",
                       help="the memory SFT checkpoint the first --workdirs' study trained (sft-memory/model), "
                            "with its world/")
    ap.add_argument("--workdirs", type=Path, nargs="+", default=[],
                    help="learning.py workdirs (…/pipeline) holding rl-<variant>-seed<s>/model")
    ap.add_argument("--variants", nargs="*", default=["grpo", "mempo_half"])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "objective_fates.json")
    a = ap.parse_args(argv)
    if a.replot:
        try:  # the plot is saved only once drawn, so a file it cannot read leaves no .png behind
            png = plot(json.loads(a.replot.read_text())["results"], a.replot)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: {a.replot}: not an objective_fates.py output ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        print(f"wrote {png}")
        return 0
    a.from_pipeline = a.from_pipeline and a.from_pipeline.resolve()
    try:
        world, sft = start(a)
        todo = models(a, sft)
    except MempoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = []
    with ProcessPoolExecutor(max_workers=a.jobs, mp_context=mp.get_context("spawn"),
                             initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        futures = [pool.submit(job, n, s, m, world) for n, s, m in todo]
        for i, fut in enumerate(futures, 1):
            results.append(fut.result())
            n, s, res = results[-1]
            print(f"[{time.perf_counter() - t0:6.0f}s] {n} seed {s}: k2 " + ", ".join(
                f"{f} {v:.2f}" for f, v in res["k2"]["fates"].items()) + f" ({i}/{len(todo)})", flush=True)
    summary = summarise(results)
    out = {"benchmark": "objective_fates", "sets": list(SETS), "fates": list(FATES),
           "config": {"variants": a.variants, "seeds": a.seeds, "tasks": {"k2": 200, "k4": 100}, "greedy": True,
                      "start": {"memory": weights_sha256(todo[0][2])}},  # as learning.py's config.start
           "results": summary, "total_seconds": round(time.perf_counter() - t0, 1)}
    write_json(a.out, out)
    png = plot(summary, a.out)
    for n, r in summary.items():
        for s in SETS:
            print(f"{n:12s} {s}: " + ", ".join(f"{f} {v:.3f}" for f, v in r[s]["fates"].items())
                  + " | ended " + ", ".join(f"{e} {v:.3f}" for e, v in r[s]["ended"].items())
                  + " | order " + ", ".join(f"{o} {v:.3f}" for o, v in r[s]["order"].items()))
    print(f"wrote {a.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
