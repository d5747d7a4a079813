"""Paired comparisons of two trained variants: mean difference and a bootstrap interval.

    d = paired_bootstrap(mempo_runs, grpo_runs, n_boot=2000)
    d["mean"], d["ci95_low"], d["ci95_high"]

`a_runs[s]` and `b_runs[s]` map task id -> per-task value (EM, objective EM, ...) of seed s
for the two variants, evaluated on the same tasks. The difference is paired twice: by seed
(both variants of seed s share the SFT start and the task order) and by task. The interval
resamples seeds with replacement, then tasks within each drawn seed (a two-level bootstrap),
so it reflects both seed-to-seed and task-to-task variation.

Where only per-seed values survive (studies from before the per-task files),
`seed_bootstrap(diffs)` resamples the per-seed differences alone: its interval speaks for the
task set the seeds were evaluated on, not for new tasks.

Seeds from different SFT starts (`strata`, one label per seed) are resampled within their own
start: the interval is then for these starts, each with its number of seeds, and the draws with
one stratum are exactly those without one.

`curve_slopes(rewards)` says whether a training curve has flattened: the least-squares slope
of its first and second half, per 100 steps; `pool_slopes` pools them over seeds.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence


def _strata(labels: Sequence[Hashable]) -> list[list[int]]:
    """The positions of each label's items, labels in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for i, label in enumerate(labels):
        groups.setdefault(label, []).append(i)
    return list(groups.values())


def _check_strata(strata: Sequence[Hashable] | None, n: int) -> Sequence[Hashable]:
    if strata is None:
        return [0] * n
    if len(strata) != n:
        raise ValueError(f"{len(strata)} strata labels for {n} seeds: one label per seed")
    return strata


def paired_bootstrap(
    a_runs: Sequence[Mapping[str, float | None]],
    b_runs: Sequence[Mapping[str, float | None]],
    n_boot: int = 2000,
    seed: int = 0,
    strata: Sequence[Hashable] | None = None,
) -> dict[str, float] | None:
    """Mean over seeds of the mean per-task difference a - b, with a 95% percentile interval.

    Tasks missing from either side, or valued None, are skipped. Returns None when no seed
    has a task in common. `strata`: one label per seed (its SFT start); seeds are resampled
    within their label. Keys: mean, ci95_low, ci95_high, seeds, tasks_per_seed (and strata,
    where there are several).
    """
    if len(a_runs) != len(b_runs):
        raise ValueError(f"{len(a_runs)} runs of a but {len(b_runs)} of b: seeds must pair")
    labels = _check_strata(strata, len(a_runs))
    pairs: list[list[float]] = []
    kept: list[Hashable] = []
    for ra, rb, label in zip(a_runs, b_runs, labels, strict=True):
        diffs = [float(va) - float(vb) for t, va in ra.items()
                 if va is not None and (vb := rb.get(t)) is not None]
        if diffs:
            pairs.append(diffs)
            kept.append(label)
    if not pairs:
        return None
    rng = random.Random(seed)
    where = _strata(kept)

    def mean_of(groups: Sequence[Sequence[float]]) -> float:
        return statistics.fmean(statistics.fmean(g) for g in groups)

    boots = []
    for _ in range(max(1, n_boot)):
        groups = [pairs[idx[rng.randrange(len(idx))]] for idx in where for _ in idx]
        boots.append(mean_of([[g[rng.randrange(len(g))] for _ in g] for g in groups]))
    return {"mean": mean_of(pairs), **_percentile_95(boots), "seeds": len(pairs),
            "tasks_per_seed": statistics.fmean(len(g) for g in pairs), **_n_strata(where)}


def _n_strata(where: list[list[int]]) -> dict[str, int]:
    return {"strata": len(where)} if len(where) > 1 else {}


def _percentile_95(boots: list[float]) -> dict[str, float]:
    boots = sorted(boots)
    return {"ci95_low": boots[int(0.025 * (len(boots) - 1))], "ci95_high": boots[int(round(0.975 * (len(boots) - 1)))]}


def seed_bootstrap(diffs: Sequence[float], n_boot: int = 2000, seed: int = 0,
                   strata: Sequence[Hashable] | None = None) -> dict[str, float] | None:
    """Mean of per-seed differences with a 95% percentile interval over seeds resampled with
    replacement (within their `strata` label, one per seed, where given). Returns None for no
    seeds. Keys: mean, ci95_low, ci95_high, seeds (and strata, where there are several)."""
    vals = [float(d) for d in diffs]
    if not vals:
        return None
    where = _strata(_check_strata(strata, len(vals)))
    rng = random.Random(seed)
    boots = [statistics.fmean(vals[idx[rng.randrange(len(idx))]] for idx in where for _ in idx)
             for _ in range(max(1, n_boot))]
    return {"mean": statistics.fmean(vals), **_percentile_95(boots), "seeds": len(vals), **_n_strata(where)}


def seed_contrast(high: Mapping[int, float], low: Mapping[int, float], n_boot: int = 2000) -> dict[str, float] | None:
    """Per seed, high[s] - low[s] (e.g. the MemPO - GRPO difference at k=4 minus the one at
    k=2: does the gain grow with k?), over the seeds both have, by `seed_bootstrap`."""
    return seed_bootstrap([high[s] - low[s] for s in high if s in low], n_boot)


def curve_slopes(values: Sequence[float | None]) -> dict[str, float | None]:
    """A training curve's trend in its first and second half: least-squares slope per 100 steps
    (`early`, `late`; steps valued None are left out). A curve has flattened when its late
    slope is near 0 while its early one was not; pooled over seeds with `pool_slopes`."""
    half = len(values) // 2
    out: dict[str, float | None] = {}
    for name, part in (("early", values[:half]), ("late", values[half:])):
        pts = [(i, float(v)) for i, v in enumerate(part) if v is not None]
        if len(pts) < 3:
            out[name] = None
            continue
        xs, ys = [i for i, _ in pts], [y for _, y in pts]
        x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - x_mean) ** 2 for x in xs)
        out[name] = 100 * sum((x - x_mean) * (y - y_mean) for x, y in pts) / sxx
    return out


FLAT_TOLERANCE = 0.02  # reward per 100 steps: a curve within it is not worth more steps


def slopes_over_seeds(curves: Mapping[int, Sequence[float | None]], n_boot: int = 2000) -> dict[str, object]:
    """`curve_slopes` of each seed's curve, pooled by `pool_slopes`. Keys: per_seed, early, late, verdict."""
    per_seed = {int(s): curve_slopes(c) for s, c in sorted(curves.items())}
    return {"per_seed": per_seed, **pool_slopes(per_seed.values(), n_boot)}


def pool_slopes(per_seed: Iterable[Mapping[str, float | None]], n_boot: int = 2000,
                tolerance: float = FLAT_TOLERANCE) -> dict[str, object]:
    """Each half's slope (from `curve_slopes`) as a mean over seeds with a 95% seed bootstrap
    interval, and what the late one says: `flat` (its interval within +-tolerance per 100 steps,
    even where it excludes 0), else `rising` / `falling` (its interval above / below 0),
    `undecided` (neither, or one seed only: too few seeds or too noisy a curve to tell), None
    (no slope). Keys: early, late, verdict."""
    rows = list(per_seed)
    out: dict[str, object] = {}
    for half in ("early", "late"):
        out[half] = seed_bootstrap([v for r in rows if (v := r.get(half)) is not None], n_boot)
    late = out["late"]
    if late is None:
        out["verdict"] = None
    elif late["seeds"] < 2:  # type: ignore[index]
        out["verdict"] = "undecided"  # one seed's slope has no interval over seeds
    else:
        lo, hi = late["ci95_low"], late["ci95_high"]  # type: ignore[index]
        # flat first: a slope that is surely above 0 but surely below the tolerance is too small
        # to be worth more steps (an equivalence test); rising / falling only beyond it
        out["verdict"] = ("flat" if -tolerance <= lo and hi <= tolerance else "rising" if lo > 0
                          else "falling" if hi < 0 else "undecided")
    return out


def format_interval(d: Mapping[str, float] | None) -> str:
    """'+0.041 [+0.015, +0.068]' for a result of the bootstraps above ('-' for None)."""
    if d is None:
        return "-"
    return f"{d['mean']:+.3f} [{d['ci95_low']:+.3f}, {d['ci95_high']:+.3f}]"


def format_trend(t: Mapping[str, object]) -> str:
    """'first half +0.043 [...]  second half +0.045 [...]  rising' for a `pool_slopes` result."""
    return (f"first half {format_interval(t['early'])}  second half {format_interval(t['late'])}  "  # type: ignore[arg-type]
            f"{t['verdict'] or '-'}")
