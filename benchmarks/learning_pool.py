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
one study (`mempo.evaluation.studies.join_parts`: the same weights digest, settings and seeds;
only the paired variants are taken from the parts, so two parts that each ran GRPO still join for
a pair of their other variants):

    .venv/bin/python benchmarks/learning_pool.py \
        benchmarks/results/learning_rl120_start2.json+benchmarks/results/learning_rl120_retain.json \
        --pair mempo_retain grpo

Parts run on two machines whose CPU kernels evaluate the same SFT weights differently (the start's
own rows differ, so they are refused as parts of one start) join with `--across-machines`, on the
weights' sha256 alone; the output lists the start rows that differ (`across_machines`), since
each pair then carries the machines' difference as well as the variants':

    .venv/bin/python benchmarks/learning_pool.py --across-machines --pair mempo_half_skip grpo \
        benchmarks/results/learning_rl300_queue_mixk4.json+benchmarks/results/learning_rl300_queue_mixk4_skip.json

A part run with another `--rl-set` (another reward setting, the same budgets, mixture and test
tasks) joins when labelled, `part.json@label`: its RL variants are named `variant@label`, so one
variant pairs with itself under the two settings; the output lists the settings that differ
(`settings_differ`):

    .venv/bin/python benchmarks/learning_pool.py --pair grpo@nap grpo \
        benchmarks/results/learning_rl300_start3_mixk4_skip.json+benchmarks/results/learning_rl300_mixk4_nap_c9cbcc85.json@nap

Studies from different SFT starts are refused unless `--across-starts`: then each start's
seeds are resampled within that start (a stratified bootstrap). The pooled mean weighs every
seed alike, and the interval is for these starts with their numbers of seeds, not for a new
start. The output lists each start's own means:

    .venv/bin/python benchmarks/learning_pool.py benchmarks/results/learning_rl300.json \
        benchmarks/results/learning_rl300_seeds1_4.json benchmarks/results/learning_rl300_seed5.json \
        benchmarks/results/learning_rl300_start3.json --pair mempo_half grpo --across-starts

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
)
from mempo.evaluation.studies import (  # noqa: E402
    BENCHES,
    METRICS,
    check_same_settings,
    check_same_start,
    group_by_start,
    load_study,
)
from mempo.io import write_json  # noqa: E402


def check_poolable(studies: list[dict[str, Any]], across_starts: bool = False) -> list[list[dict[str, Any]]]:
    """Refuse studies that are not one experiment; returns them grouped by RL start (one group
    unless `across_starts`). Seeds must be distinct within a start: seed s from another start is
    another run."""
    first = studies[0]
    for st in studies[1:]:
        check_same_settings(st["path"], st["config"], first["path"], first["config"], "not the same experiment")
    groups = group_by_start(studies) if across_starts else [studies]
    if not across_starts:
        try:
            check_same_start(studies)
        except MempoError as e:
            raise MempoError(f"{e}, or pool across starts with --across-starts") from e
    names = [st["path"].name for st in studies]
    if len(set(names)) < len(names):
        raise MempoError(f"two studies share a file name ({', '.join(names)}): the output names them by it")
    for group in groups:
        seen: dict[int, Path] = {}
        for st in group:
            for s in st["seeds"]:
                if s in seen:
                    raise MempoError(f"{st['path']}: seed {s} is also in {seen[s]}: pooled seeds of one start "
                                     "must be distinct")
                seen[s] = st["path"]
    return groups


def start_label(group: list[dict[str, Any]], i: int) -> str:
    """A start's short name: its memory checkpoint's weights digest, else its position."""
    digest = next((st["start"]["weights sha256 of sft-memory"] for st in group
                   if st["start"].get("weights sha256 of sft-memory")), None)
    return digest[:8] if digest else f"start{i + 1}"


def _start_means(starts: dict[str, dict[str, Any]], key: str, values: dict[int, float], strata: list[int]) -> None:
    """Each start's own mean of `values` (unit index -> value) as `starts[label][key]`, starts in
    the order of `strata`'s labels (None for a start with no value)."""
    for g, st in enumerate(starts.values()):
        d = [v for i, v in values.items() if strata[i] == g]
        st[key] = statistics.fmean(d) if d else None


def pool(studies: list[dict[str, Any]], a: str, b: str, n_boot: int = 2000,
         across_starts: bool = False) -> dict[str, Any]:
    """The pooled paired difference a - b. `across_starts`: studies from different SFT starts
    pool too, each seed resampled within its start (stratified): the interval is for these
    starts, not for a new one."""
    groups = check_poolable(studies, across_starts)
    two_level = all(st["per_task"] is not None for st in studies)
    # the pooled units: (start, seed, study), start by start
    units = [(g, s, st) for g, group in enumerate(groups) for st in group for s in st["seeds"]]
    labels = [start_label(group, g) for g, group in enumerate(groups)]
    strata = [g for g, _, _ in units]
    several = len(groups) > 1
    out: dict[str, Any] = {"pair": [a, b],
                           "seeds": [f"{labels[g]}/{s}" if several else s for g, s, _ in units],
                           "resampled": ("seeds, then tasks within a seed" if two_level else "seeds only")
                                        + ("; each seed within its start" if several else ""),
                           "studies": {}, "pooled": {}}
    drift = {str(st["path"].name): st["across_machines"] for st in studies if st.get("across_machines")}
    if drift:
        out["across_machines"] = drift
    differ = {str(st["path"].name): st["settings_differ"] for st in studies if st.get("settings_differ")}
    if differ:
        out["settings_differ"] = differ
    if across_starts:
        out["starts"] = {labels[g]: {"studies": [st["path"].name for st in group],
                                     "seeds": [s for st in group for s in st["seeds"]]}
                         for g, group in enumerate(groups)}
    unit_diffs: dict[str, dict[int, float]] = {}
    for st in studies:
        out["studies"][st["path"].name] = {"seeds": st["seeds"], "per_task": st["per_task"] is not None}
    for bench in BENCHES:
        for m in METRICS:
            key = f"{bench}/{m}"
            diffs = {}
            for i, (_, s, st) in enumerate(units):
                va, vb = st["per_seed"][a][bench][m].get(s), st["per_seed"][b][bench][m].get(s)
                if va is not None and vb is not None:
                    diffs[i] = va - vb
            unit_diffs[key] = diffs
            for st in studies:
                d = [diffs[i] for i, (_, _, u) in enumerate(units) if u is st and i in diffs]
                out["studies"][st["path"].name][key] = statistics.fmean(d) if d else None
            if across_starts:
                _start_means(out["starts"], key, diffs, strata)
            if two_level:
                runs = {v: [{t: r[m] for t, r in st["per_task"][(v, s, bench)].items()} for _, s, st in units]
                        for v in (a, b)}
                out["pooled"][key] = paired_bootstrap(runs[a], runs[b], n_boot, strata=strata)
            else:
                out["pooled"][key] = seed_bootstrap(list(diffs.values()), n_boot,
                                                    strata=[strata[i] for i in diffs])
    # is the gain larger on the longer tasks? per seed, (A - B at k4) - (A - B at k2); seeds
    # resampled (the k2 and k4 tasks differ, so there is no task pairing to resample)
    out["k4_minus_k2"] = {}
    for m in ("objective_em", "forgetting_rate"):
        hi, lo = unit_diffs[f"k4/{m}"], unit_diffs[f"k2/{m}"]
        both = [i for i in hi if i in lo]
        out["k4_minus_k2"][m] = seed_bootstrap([hi[i] - lo[i] for i in both], n_boot,
                                               strata=[strata[i] for i in both])
        if across_starts:
            _start_means(out["starts"], f"k4_minus_k2/{m}", {i: hi[i] - lo[i] for i in both}, strata)
    # has each variant's training reward stopped rising? (per-seed slopes, all studies' seeds)
    out["reward_trend"] = {}
    for v in (a, b):
        if all(st["slopes"][v] is not None for st in studies):
            per = [st["slopes"][v][s] for _, s, st in units if s in st["slopes"][v]]
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
    ap.add_argument("--across-starts", action="store_true",
                    help="pool studies from different SFT starts too, resampling each seed within its start "
                         "(the interval is for these starts; without it, studies of another start are refused)")
    ap.add_argument("--across-machines", action="store_true",
                    help="join the parts of one study (a.json+b.json) on their SFT weights' sha256 alone, when "
                         "their machines evaluate the same weights differently (the differing start rows are listed)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the pooled comparison here (JSON), and beside it the forest plot (.png)")
    args = ap.parse_args(argv)
    try:
        a, b = args.pair
        out = pool([load_study(p, a, b, args.across_machines) for p in args.studies], a, b, args.bootstrap,
                   args.across_starts)
    except MempoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a} - {b}, {len(out['seeds'])} seeds (resampled: {out['resampled']})")
    for name, rows in (out.get("across_machines") or {}).items():
        for part, keys in rows.items():
            print(f"  across machines ({name}): {Path(part).name}'s start evaluates differently: "
                  + ", ".join(f"{k} {x} vs {y}" for k, (x, y) in list(keys.items())[:4])
                  + (f" (+{len(keys) - 4} more)" if len(keys) > 4 else ""))
    for name, rows in (out.get("settings_differ") or {}).items():
        for part, keys in rows.items():
            print(f"  settings differ ({name}): {Path(part).name}: "
                  + ", ".join(f"{k} {x} vs {y}" for k, (x, y) in keys.items()))
    for key, d in out["pooled"].items():
        if d is not None:
            per = "  ".join(f"{v[key]:+.3f}" if v.get(key) is not None else "-" for v in out["studies"].values())
            print(f"  {key:<24} {format_interval(d)}   per study: {per}")
    for m, d in out["k4_minus_k2"].items():
        print(f"  {'gain k4 - gain k2, ' + m:<24} {format_interval(d)}   (seeds resampled)")
    for name, st in (out.get("starts") or {}).items():
        print(f"  start {name}: {len(st['seeds'])} seeds, k2 / k4 objective EM "
              + " / ".join("-" if st.get(k) is None else f"{st[k]:+.3f}" for k in ("k2/objective_em", "k4/objective_em"))
              + f", gain k4 - gain k2 {st['k4_minus_k2/objective_em']:+.3f}")
    for v, t in out["reward_trend"].items():
        print(f"  reward slope /100 steps  {v:<11} {format_trend(t)} ({t['seeds']} seeds)")
    if args.out:
        write_json(args.out, out)
        print(f"wrote {args.out} and {plot(out, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
