"""Pool learning studies run on different seeds into one paired comparison of two variants.

    .venv/bin/python benchmarks/learning_pool.py benchmarks/results/learning_rl120.json \\
        benchmarks/results/learning_rl120_seeds5_9.json --pair mempo_half grpo \\
        --out benchmarks/results/learning_rl120_pooled.json

A replication of `benchmarks/learning.py` on new seeds (same RL budget, batch, rollouts and
test-task counts) adds seeds to a comparison instead of standing beside it. Per set (single,
k2, k4) and metric (em, objective_em, forgetting_rate): each study's own paired difference
A - B, and the pooled one over all seeds of all studies with a 95% bootstrap interval. Where
every study has its per-task file (`<study>.per_task.jsonl.gz`, written by learning.py), the
interval is the study's own two-level bootstrap (seeds, then tasks within each seed:
`mempo.evaluation.stats.paired_bootstrap`); otherwise it resamples the per-seed differences
only (`seed_bootstrap`), and the output says so (`resampled`): that interval is for the test
tasks the seeds shared, not for new tasks. Studies that differ in a setting, or that share a
seed, are refused with the file and field named. Whether the gain grows with k: per seed, the
k=4 difference minus the k=2 one (`k4_minus_k2`, seeds resampled). One study alone gives a pair its own summary
did not compare (e.g. `--pair mempo_half full`). The two variants' reward trends (per-seed
slopes of the training reward, `mempo.evaluation.stats.curve_slopes`) pool too, where every
study has them (a one-seed study from before them: from its curve). `--out` writes the JSON
and beside it a forest plot of the pooled differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mempo.errors import MempoError  # noqa: E402
from mempo.evaluation.stats import (  # noqa: E402
    curve_slopes,
    format_interval,
    format_trend,
    paired_bootstrap,
    pool_slopes,
    seed_bootstrap,
    seed_contrast,
)
from mempo.io import iter_jsonl, write_json  # noqa: E402

BENCHES = ("single", "k2", "k4")
METRICS = ("em", "objective_em", "forgetting_rate")
SAME = ("rl_steps", "batch_questions", "n_rollouts", "eval_tasks", "policy")  # what must match to pool


def load_study(path: Path, a: str, b: str) -> dict[str, Any]:
    """The study's settings, the seeds both variants ran, and per seed and set its per-seed
    values (and per-task values, where its per-task file exists)."""
    try:
        study = json.loads(path.read_text())
        seeds = study["config"]["seeds"]
        results = study["results"]
        for v in (a, b):
            if v not in seeds or v not in results:
                raise MempoError(f"{path}: no variant '{v}' (it has: {', '.join(sorted(seeds))})")
        per_seed = {v: {bench: {m: dict(zip(seeds[v], results[v][bench][m]["per_seed"], strict=True))
                                for m in METRICS} for bench in BENCHES} for v in (a, b)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MempoError(f"{path}: not a learning study result ({type(e).__name__}: {e})") from e
    common = [s for s in seeds[a] if s in seeds[b]]
    side = path.with_suffix(".per_task.jsonl.gz")
    per_task: dict[tuple[str, int, str], dict[str, dict[str, Any]]] | None = None
    if side.exists():
        per_task = {}
        for n, row in iter_jsonl(side):  # malformed lines: DataError naming the file and line
            try:
                per_task.setdefault((row["variant"], int(row["seed"]), row["bench"]), {})[row["task"]] = row
            except (ValueError, KeyError, TypeError) as e:
                raise MempoError(f"{side}: row {n}: {type(e).__name__}: {e}") from e
        missing = [f"{v} seed {s} {bench}" for v in (a, b) for s in common for bench in BENCHES
                   if (v, s, bench) not in per_task]
        if missing:
            raise MempoError(f"{side}: no per-task rows for {', '.join(missing[:4])}")
    return {"path": path, "config": study["config"], "seeds": common, "per_seed": per_seed, "per_task": per_task,
            "slopes": {v: reward_slopes(study, v) for v in (a, b)}}


def reward_slopes(study: dict[str, Any], v: str) -> dict[int, dict[str, float | None]] | None:
    """Per seed, the slopes of variant v's training reward (`curve_slopes`): the study's own
    `reward_trend`, or, for a study from before it that ran v on one seed, its curve (the mean
    over one seed is that seed's curve). None where neither is there."""
    trend = (study.get("reward_trend") or {}).get(v)
    if trend:
        return {int(s): d for s, d in trend["per_seed"].items()}
    seeds, curve = study["config"]["seeds"].get(v, []), (study.get("curves") or {}).get(v)
    if len(seeds) == 1 and curve:
        return {seeds[0]: curve_slopes([row.get("reward_mean") for row in curve])}
    return None


def check_poolable(studies: list[dict[str, Any]]) -> None:
    first = studies[0]
    for st in studies[1:]:
        for key in SAME:
            if st["config"].get(key) != first["config"].get(key):
                raise MempoError(f"{st['path']}: config.{key} is {st['config'].get(key)!r}, but "
                                 f"{first['path']} has {first['config'].get(key)!r}: not the same experiment")
    names = [st["path"].name for st in studies]
    if len(set(names)) < len(names):
        raise MempoError(f"two studies share a file name ({', '.join(names)}): the output names them by it")
    seen: dict[int, Path] = {}
    for st in studies:
        for s in st["seeds"]:
            if s in seen:
                raise MempoError(f"{st['path']}: seed {s} is also in {seen[s]}: pooled seeds must be distinct")
            seen[s] = st["path"]


def pool(studies: list[dict[str, Any]], a: str, b: str, n_boot: int = 2000) -> dict[str, Any]:
    check_poolable(studies)
    two_level = all(st["per_task"] is not None for st in studies)
    seeds = [s for st in studies for s in st["seeds"]]
    out: dict[str, Any] = {"pair": [a, b], "seeds": seeds,
                           "resampled": "seeds, then tasks within a seed" if two_level else "seeds only",
                           "studies": {}, "pooled": {}}
    seed_diffs: dict[str, dict[int, float]] = {}
    for st in studies:
        out["studies"][st["path"].name] = {"seeds": st["seeds"], "per_task": st["per_task"] is not None}
    for bench in BENCHES:
        for m in METRICS:
            key = f"{bench}/{m}"
            diffs = {}
            for st in studies:
                for s in st["seeds"]:
                    va, vb = st["per_seed"][a][bench][m].get(s), st["per_seed"][b][bench][m].get(s)
                    if va is not None and vb is not None:
                        diffs[s] = va - vb
            seed_diffs[key] = diffs
            for st in studies:
                d = [diffs[s] for s in st["seeds"] if s in diffs]
                out["studies"][st["path"].name][key] = statistics.fmean(d) if d else None
            if two_level:
                runs = {v: [{t: r[m] for t, r in st["per_task"][(v, s, bench)].items()}
                            for st in studies for s in st["seeds"]] for v in (a, b)}
                out["pooled"][key] = paired_bootstrap(runs[a], runs[b], n_boot)
            else:
                out["pooled"][key] = seed_bootstrap([diffs[s] for s in seeds if s in diffs], n_boot)
    # is the gain larger on the longer tasks? per seed, (A - B at k4) - (A - B at k2); seeds
    # resampled (the k2 and k4 tasks differ, so there is no task pairing to resample)
    out["k4_minus_k2"] = {}
    for m in ("objective_em", "forgetting_rate"):
        out["k4_minus_k2"][m] = seed_contrast(seed_diffs[f"k4/{m}"], seed_diffs[f"k2/{m}"], n_boot)
    # has each variant's training reward stopped rising? (per-seed slopes, all studies' seeds)
    out["reward_trend"] = {}
    for v in (a, b):
        if all(st["slopes"][v] is not None for st in studies):
            per = [st["slopes"][v][s] for st in studies for s in st["seeds"] if s in st["slopes"][v]]
            out["reward_trend"][v] = {"seeds": len(per), **pool_slopes(per, n_boot)}
    return out


def plot(out: dict[str, Any], path: Path) -> Path:
    """The pooled differences as a forest plot: one row per set and metric, the pooled mean
    with its 95% interval, each study's own mean as a small mark beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mempo.io import atomic_path

    keys = [k for k, d in out["pooled"].items() if d is not None]
    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(keys) + 1.4), dpi=100)
    for row, key in enumerate(reversed(keys)):
        d = out["pooled"][key]
        ax.errorbar([d["mean"]], [row], xerr=[[d["mean"] - d["ci95_low"]], [d["ci95_high"] - d["mean"]]],
                    fmt="o", color="black", capsize=3)
        for i, (name, st) in enumerate(out["studies"].items()):
            if st.get(key) is not None:
                ax.plot([st[key]], [row + 0.22], marker="|", markersize=8, linestyle="none", color=f"C{i}",
                        label=None if row else Path(name).stem)
    ax.axvline(0.0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(keys)), list(reversed(keys)))
    a, b = out["pair"]
    ax.set_xlabel(f"{a} - {b} (pooled over {len(out['seeds'])} seeds, 95% interval)")
    ax.grid(axis="x", alpha=0.3)
    if len(out["studies"]) > 1:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="study means", title_fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("studies", nargs="+", type=Path, help="learning.py --out files (one study alone: a pair its own summary did not compare)")
    ap.add_argument("--pair", nargs=2, required=True, metavar=("A", "B"), help="variants: the difference A - B")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None,
                    help="write the pooled comparison here (JSON), and beside it the forest plot (.png)")
    args = ap.parse_args(argv)
    try:
        a, b = args.pair
        out = pool([load_study(p, a, b) for p in args.studies], a, b, args.bootstrap)
    except MempoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a} - {b}, {len(out['seeds'])} seeds ({out['resampled']} resampled)")
    for key, d in out["pooled"].items():
        if d is not None:
            per = "  ".join(f"{v[key]:+.3f}" if v.get(key) is not None else "-" for v in out["studies"].values())
            print(f"  {key:<24} {format_interval(d)}   per study: {per}")
    for m, d in out["k4_minus_k2"].items():
        print(f"  {'gain k4 - gain k2, ' + m:<24} {format_interval(d)}   (seeds resampled)")
    for v, t in out["reward_trend"].items():
        print(f"  reward slope /100 steps  {v:<11} {format_trend(t)} ({t['seeds']} seeds)")
    if args.out:
        write_json(args.out, out)
        print(f"wrote {args.out} and {plot(out, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
