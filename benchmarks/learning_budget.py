"""What a longer RL budget (or another RL mixture, or a params override) changes: two learning
studies on the same seeds that differ only in `--rl-steps` (or, `--setting rl_mix`, in
`--rl-mix`; `--setting rl_set`, in `--rl-set`), compared variant by variant and seed by seed.

    .venv/bin/python benchmarks/learning_budget.py benchmarks/results/learning_rl600_seeds1_2.json \\
        benchmarks/results/learning_rl300_seeds1_4.json --variants grpo mempo_half \\
        --out benchmarks/results/learning_rl600_vs_300.json
    .venv/bin/python benchmarks/learning_budget.py benchmarks/results/learning_rl300_start3_mixk4.json \\
        benchmarks/results/learning_rl300_start3.json --setting rl_mix --variants mempo_half grpo

Has training converged at the shorter budget? The reward curve's slope says whether the
training reward still rises (`reward_trend`); this says whether the held-out test numbers
still move. Per variant, set (single, k2, k4) and metric (em, objective_em, forgetting_rate):
long - short, paired by seed (seed s of both studies starts from the same SFT checkpoint and
sees the same task order: with a constant RL learning rate the longer run passes through the
shorter run's end point) and by test task, with the two-level bootstrap of
`mempo.evaluation.stats.paired_bootstrap` (seeds only where a study has no per-task file).
With two variants A and B, also the gap A - B at each budget and how it changes
(`gap.change`: per task, (A - B) long - (A - B) short): does the memory advantage's lead grow,
hold or fade with more training? With `--setting rl_mix` / `rl_set` the same for two RL
mixtures or overrides (the changed study first): a seed
pairs the SFT start and the seed's draws, but not the task order (the mixtures' rows differ);
the test tasks pair exactly. Only the seeds both studies ran are compared; studies that
differ in anything but the RL steps (their SFT start included) are refused with the file and
field named. `--out`
writes the JSON and beside it a forest plot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NamedTuple

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


class Setting(NamedTuple):
    """What two compared studies differ in, as a comparison names it."""

    first: str  # the first study's name in the output
    second: str  # the second study's
    diff_key: str  # the key of first - second
    called: str  # what the setting is called in the refusal of studies that differ in more


SETTINGS = {"rl_steps": Setting("long", "short", "more_steps", "the RL steps"),
            "rl_mix": Setting("mix", "base", "with_mix", "the RL mixture"),
            "rl_set": Setting("set", "base", "with_set", "the --rl-set overrides")}
# What a study without config.<setting> trained RL with (learning.py records rl_mix / rl_set only where given).
DEFAULTS = {"rl_mix": "params.yaml's data.compositions", "rl_set": "params.yaml"}
DEFAULT_LABELS = {"params.yaml's data.compositions": "the default mixture", "params.yaml": "params.yaml"}


def compare(long: dict[str, Any], short: dict[str, Any], variants: list[str], n_boot: int = 2000,
            setting: str = "rl_steps") -> dict[str, Any]:
    """First - second per variant, and (two variants) the gap in each study and its change. The
    studies differ only in `setting`: the RL steps (the longer first), the RL mixture (`--rl-mix`)
    or the params overrides (`--rl-set`), the study that changed it first."""
    x, y, diff_key, called = SETTINGS[setting]
    check_same_settings(long["path"], long["config"], short["path"], short["config"], f"only {called} may differ",
                        but=(setting,))
    check_same_start([long, short])
    values = tuple(st["config"].get(setting) or DEFAULTS.get(setting) for st in (long, short))
    if setting == "rl_steps" and values[0] <= values[1]:
        raise MempoError(f"{long['path']}: {values[0]} RL steps, not more than {short['path']}'s {values[1]}: "
                         "give the longer study first")
    if setting != "rl_steps" and values[0] == values[1]:
        raise MempoError(f"{long['path']} and {short['path']} both trained RL on {_describe(values[0])}: "
                         "nothing to compare")
    seeds = [s for s in long["seeds"] if s in short["seeds"]]
    if not seeds:
        raise MempoError(f"{long['path']} (seeds {long['seeds']}) and {short['path']} (seeds {short['seeds']}) "
                         "share no seed: there is nothing to pair")
    two_level = long["per_task"] is not None and short["per_task"] is not None
    out: dict[str, Any] = {setting: {x: values[0], y: values[1]}, "variants": variants, "seeds": seeds,
                           "resampled": "seeds, then tasks within a seed" if two_level else "seeds only",
                           "studies": {x: long["path"].name, y: short["path"].name},
                           diff_key: {v: {} for v in variants}, "reward_trend": {}}
    runs = {(which, v, bench, m): _runs(st, v, bench, m, seeds, two_level) for which, st in ((x, long), (y, short))
            for v in variants for bench in BENCHES for m in METRICS}
    for v in variants:
        for bench in BENCHES:
            for m in METRICS:
                out[diff_key][v][f"{bench}/{m}"] = _interval(runs[x, v, bench, m], runs[y, v, bench, m],
                                                             two_level, n_boot)
        slopes = long["slopes"][v]
        if slopes is not None:
            out["reward_trend"][v] = {"seeds": len(seeds), **pool_slopes([slopes[s] for s in seeds if s in slopes],
                                                                         n_boot)}
    if len(variants) == 2:
        a, b = variants
        out["gap"] = {x: {}, y: {}, "change": {}}
        for bench in BENCHES:
            for m in METRICS:
                key = f"{bench}/{m}"
                gaps = {}
                for which in (x, y):
                    ra, rb = runs[which, a, bench, m], runs[which, b, bench, m]
                    out["gap"][which][key] = _interval(ra, rb, two_level, n_boot)
                    gaps[which] = _diff(ra, rb)
                out["gap"]["change"][key] = _interval(gaps[x], gaps[y], two_level, n_boot)
    return out


def _setting(out: dict[str, Any]) -> tuple[str, Setting]:
    """The setting a comparison (`compare`'s) is of, and its names."""
    setting = next(k for k in SETTINGS if k in out)
    return setting, SETTINGS[setting]


def _describe(value: Any) -> str:
    """A setting's value as the command line gives it (a mixture as K:SHARE ...)."""
    if isinstance(value, list):
        return " ".join(f"{c['k']}:{c['share']:g}" for c in value)
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items())
    return DEFAULT_LABELS.get(value, str(value))


def title(out: dict[str, Any]) -> str:
    setting, names = _setting(out)
    x, y = names.first, names.second
    first, second = (_describe(out[setting][w]) for w in (x, y))
    return f"{first} - {second} RL steps" if setting == "rl_steps" else f"RL on {first} - on {second}"


def plot(out: dict[str, Any], path: Path) -> Path:
    """First - second per variant (and the change of the gap) as a forest plot, objective EM and EM."""
    from mempo.training.plots import plot_forest

    diff_key = _setting(out)[1].diff_key
    keys = [f"{bench}/{m}" for bench in BENCHES for m in ("em", "objective_em")]  # those with a value
    rows = [(f"{v}: {key}", d, {}) for v in out["variants"] for key in keys
            if (d := out[diff_key][v].get(key)) is not None]
    if "gap" in out:
        a, b = out["variants"]
        rows += [(f"gap {a} - {b} change: {key}", d, {}) for key in keys
                 if (d := out["gap"]["change"].get(key)) is not None]
    n = len(out["seeds"])
    return plot_forest(rows, f"{title(out)} ({n} paired seed{'s' if n > 1 else ''}, 95% interval)", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("long", type=Path, help="learning.py --out file of the longer RL budget (--setting rl_mix / "
                                            "rl_set: of the study run with --rl-mix / --rl-set)")
    ap.add_argument("short", type=Path, help="learning.py --out file of the shorter one (rl_mix / rl_set: of the "
                                             "study without, or with others), on (some of) the same seeds")
    ap.add_argument("--variants", nargs="+", required=True, help="variants both studies ran (two: also their gap)")
    ap.add_argument("--setting", choices=list(SETTINGS), default="rl_steps",
                    help="what the two studies differ in (default: the RL steps)")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None, help="write the comparison here (JSON), and beside it a forest plot")
    args = ap.parse_args(argv)
    if not 1 <= len(args.variants) <= 2:
        ap.error("--variants: one or two")
    try:
        a, b = (args.variants * 2)[:2]
        out = compare(load_study(args.long, a, b), load_study(args.short, a, b), args.variants, args.bootstrap,
                      args.setting)
    except MempoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _, (x, y, diff_key, _) = _setting(out)
    print(f"{title(out)}, seeds {out['seeds']} ({out['resampled']} resampled)")
    for v, diffs in out[diff_key].items():
        for key, d in diffs.items():
            if d is not None:
                print(f"  {v:<11} {key:<24} {format_interval(d)}")
    if "gap" in out:
        a, b = out["variants"]
        print(f"gap {a} - {b}: {y}, {x}, and the change")
        for key, d in out["gap"]["change"].items():
            if d is not None:
                print(f"  {key:<24} {format_interval(out['gap'][y][key])}  "
                      f"{format_interval(out['gap'][x][key])}  change {format_interval(d)}")
    for v, t in out["reward_trend"].items():
        print(f"  reward slope /100 steps ({x})  {v:<11} {format_trend(t)} ({t['seeds']} seeds)")
    if args.out:
        write_json(args.out, out)
        print(f"wrote {args.out} and {plot(out, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
