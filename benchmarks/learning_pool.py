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
tasks the seeds shared, not for new tasks. Studies that differ in a setting, share a seed, or
start RL from different SFT checkpoints (`mempo.evaluation.studies.check_same_start`) are
refused with the file and field named. Whether the gain grows with k: per seed, the
k=4 difference minus the k=2 one (`k4_minus_k2`, seeds resampled). One study alone gives a pair its own summary
did not compare (e.g. `--pair mempo_half full`). A study run in parts, a variant trained later from
the same start beside the baselines already run, is named `first.json+second.json` and reads as
one study (`mempo.evaluation.studies.join_parts`: the same weights digest, settings and seeds):

    .venv/bin/python benchmarks/learning_pool.py \
        benchmarks/results/learning_rl120_start2.json+benchmarks/results/learning_rl120_retain.json \
        --pair mempo_retain grpo

The two variants' reward trends (per-seed slopes of the training reward,
`mempo.evaluation.stats.curve_slopes`) pool too, where every study has them (a one-seed study
from before them: from its curve). `--out` writes the JSON and beside it a forest plot of the
pooled differences.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mempo.errors import MempoError  # noqa: E402
from mempo.evaluation.stats import (  # noqa: E402
    format_interval,
    format_trend,
    paired_bootstrap,
    pool_slopes,
    seed_bootstrap,
    seed_contrast,
)
from mempo.evaluation.studies import (  # noqa: E402
    BENCHES,
    METRICS,
    check_same_settings,
    check_same_start,
    load_study,
)
from mempo.io import write_json  # noqa: E402


def check_poolable(studies: list[dict[str, Any]]) -> None:
    first = studies[0]
    for st in studies[1:]:
        check_same_settings(st["path"], st["config"], first["path"], first["config"], "not the same experiment")
    check_same_start(studies)
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
    from mempo.training.plots import plot_forest

    rows = [(key, d, {Path(name).stem: st[key] for name, st in out["studies"].items() if st.get(key) is not None})
            for key, d in out["pooled"].items() if d is not None]
    a, b = out["pair"]
    return plot_forest(rows, f"{a} - {b} (pooled over {len(out['seeds'])} seeds, 95% interval)", path,
                       legend_title="study means")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("studies", nargs="+", type=Path, help="learning.py --out files (one study alone: a pair its own summary did not compare; "
                         "a.json+b.json: the parts of one study)")
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
