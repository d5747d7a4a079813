"""What a longer RL budget changes: two learning studies on the same seeds that differ only in
`--rl-steps`, compared variant by variant and seed by seed.

    .venv/bin/python benchmarks/learning_budget.py benchmarks/results/learning_rl600_seeds1_2.json \\
        benchmarks/results/learning_rl300_seeds1_4.json --variants grpo mempo_half \\
        --out benchmarks/results/learning_rl600_vs_300.json

Has training converged at the shorter budget? The reward curve's slope says whether the
training reward still rises (`reward_trend`); this says whether the held-out test numbers
still move. Per variant, set (single, k2, k4) and metric (em, objective_em, forgetting_rate):
long - short, paired by seed (seed s of both studies starts from the same SFT checkpoint and
sees the same task order: with a constant RL learning rate the longer run passes through the
shorter run's end point) and by test task, with the two-level bootstrap of
`mempo.evaluation.stats.paired_bootstrap` (seeds only where a study has no per-task file).
With two variants A and B, also the gap A - B at each budget and how it changes
(`gap.change`: per task, (A - B) long - (A - B) short): does the memory advantage's lead grow,
hold or fade with more training? Only the seeds both studies ran are compared; studies that
differ in anything but the RL steps (their SFT start included) are refused with the file and
field named. `--out`
writes the JSON and beside it a forest plot.
"""

from __future__ import annotations

import argparse
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
    load_study,
)
from mempo.io import write_json  # noqa: E402

Runs = list[dict[str, float | None]]


def _runs(st: dict[str, Any], v: str, bench: str, m: str, seeds: list[int], two_level: bool) -> Runs:
    """Per seed, task -> value of variant v (from the per-task file), or one pseudo-task holding
    the seed's mean where a study of the comparison has none."""
    if not two_level:
        return [{"seed mean": st["per_seed"][v][bench][m].get(s)} for s in seeds]
    return [{t: r[m] for t, r in st["per_task"][(v, s, bench)].items()} for s in seeds]


def _diff(a: Runs, b: Runs) -> Runs:
    """Per seed and task, a - b (None where either is missing)."""
    return [{t: (va - vb if va is not None and (vb := rb.get(t)) is not None else None) for t, va in ra.items()}
            for ra, rb in zip(a, b, strict=True)]


def _interval(a: Runs, b: Runs, two_level: bool, n_boot: int) -> dict[str, float] | None:
    if two_level:
        return paired_bootstrap(a, b, n_boot)
    diffs = []
    for ra, rb in zip(a, b, strict=True):
        va, vb = ra.get("seed mean"), rb.get("seed mean")
        if va is not None and vb is not None:
            diffs.append(va - vb)
    return seed_bootstrap(diffs, n_boot)


def compare(long: dict[str, Any], short: dict[str, Any], variants: list[str], n_boot: int = 2000) -> dict[str, Any]:
    """Long - short per variant, and (two variants) the gap at each budget and its change."""
    check_same_settings(long["path"], long["config"], short["path"], short["config"], "only the RL steps may differ",
                        but=("rl_steps",))
    check_same_start([long, short])
    steps = (long["config"]["rl_steps"], short["config"]["rl_steps"])
    if steps[0] <= steps[1]:
        raise MempoError(f"{long['path']}: {steps[0]} RL steps, not more than {short['path']}'s {steps[1]}: "
                         "give the longer study first")
    seeds = [s for s in long["seeds"] if s in short["seeds"]]
    if not seeds:
        raise MempoError(f"{long['path']} (seeds {long['seeds']}) and {short['path']} (seeds {short['seeds']}) "
                         "share no seed: there is nothing to pair")
    two_level = long["per_task"] is not None and short["per_task"] is not None
    out: dict[str, Any] = {"rl_steps": {"long": steps[0], "short": steps[1]}, "variants": variants, "seeds": seeds,
                           "resampled": "seeds, then tasks within a seed" if two_level else "seeds only",
                           "studies": {"long": long["path"].name, "short": short["path"].name},
                           "more_steps": {v: {} for v in variants}, "reward_trend": {}}
    runs = {(which, v, bench, m): _runs(st, v, bench, m, seeds, two_level) for which, st in (("long", long), ("short", short))
            for v in variants for bench in BENCHES for m in METRICS}
    for v in variants:
        for bench in BENCHES:
            for m in METRICS:
                out["more_steps"][v][f"{bench}/{m}"] = _interval(runs["long", v, bench, m], runs["short", v, bench, m],
                                                                 two_level, n_boot)
        slopes = long["slopes"][v]
        if slopes is not None:
            out["reward_trend"][v] = {"seeds": len(seeds), **pool_slopes([slopes[s] for s in seeds if s in slopes],
                                                                         n_boot)}
    if len(variants) == 2:
        a, b = variants
        out["gap"] = {"long": {}, "short": {}, "change": {}}
        for bench in BENCHES:
            for m in METRICS:
                key = f"{bench}/{m}"
                gaps = {}
                for which in ("long", "short"):
                    ra, rb = runs[which, a, bench, m], runs[which, b, bench, m]
                    out["gap"][which][key] = _interval(ra, rb, two_level, n_boot)
                    gaps[which] = _diff(ra, rb)
                out["gap"]["change"][key] = _interval(gaps["long"], gaps["short"], two_level, n_boot)
    return out


def plot(out: dict[str, Any], path: Path) -> Path:
    """Long - short per variant (and the change of the gap) as a forest plot, objective EM and EM."""
    from mempo.training.plots import plot_forest

    keys = [f"{bench}/{m}" for bench in BENCHES for m in ("em", "objective_em")]  # those with a value
    rows = [(f"{v}: {key}", d, {}) for v in out["variants"] for key in keys
            if (d := out["more_steps"][v].get(key)) is not None]
    if "gap" in out:
        a, b = out["variants"]
        rows += [(f"gap {a} - {b} change: {key}", d, {}) for key in keys
                 if (d := out["gap"]["change"].get(key)) is not None]
    long, short = out["rl_steps"]["long"], out["rl_steps"]["short"]
    return plot_forest(rows, f"{long} - {short} RL steps ({len(out['seeds'])} paired seeds, 95% interval)", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("long", type=Path, help="learning.py --out file of the longer RL budget")
    ap.add_argument("short", type=Path, help="learning.py --out file of the shorter one, on (some of) the same seeds")
    ap.add_argument("--variants", nargs="+", required=True, help="variants both studies ran (two: also their gap)")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None, help="write the comparison here (JSON), and beside it a forest plot")
    args = ap.parse_args(argv)
    if not 1 <= len(args.variants) <= 2:
        ap.error("--variants: one or two")
    try:
        a, b = (args.variants * 2)[:2]
        out = compare(load_study(args.long, a, b), load_study(args.short, a, b), args.variants, args.bootstrap)
    except MempoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    long, short = out["rl_steps"]["long"], out["rl_steps"]["short"]
    print(f"{long} - {short} RL steps, seeds {out['seeds']} ({out['resampled']} resampled)")
    for v, diffs in out["more_steps"].items():
        for key, d in diffs.items():
            if d is not None:
                print(f"  {v:<11} {key:<24} {format_interval(d)}")
    if "gap" in out:
        a, b = out["variants"]
        print(f"gap {a} - {b}: at {short} steps, at {long}, and the change")
        for key, d in out["gap"]["change"].items():
            if d is not None:
                print(f"  {key:<24} {format_interval(out['gap']['short'][key])}  "
                      f"{format_interval(out['gap']['long'][key])}  change {format_interval(d)}")
    for v, t in out["reward_trend"].items():
        print(f"  reward slope /100 steps at {long} steps  {v:<11} {format_trend(t)} ({t['seeds']} seeds)")
    if args.out:
        write_json(args.out, out)
        print(f"wrote {args.out} and {plot(out, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
