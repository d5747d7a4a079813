"""Compare `mempo eval` outputs of several policies on the same tasks, paired by task.

    .venv/bin/python benchmarks/compare_evals.py --base e2=<eval dir> --runs e3=<dir> e4=<dir> \
        --agent memory --out benchmarks/results/sft_epochs.json --note "what was trained, how"

Each folder is a `mempo eval --out` folder (its `samples.parquet`); NAME=DIR1,DIR2 joins the
benchmarks of several folders of one policy. Per benchmark and policy:
n, EM, objective EM and all-correct (k > 1), format validity and the episode outcome shares
(`mempo.evaluation.outcomes`); per run, the paired difference from the base on EM (and on
objective EM for k > 1) over the tasks both evaluated, with a bootstrap 95 % interval over
tasks (`mempo.evaluation.stats.paired_bootstrap`, one seed: the interval is task-to-task only).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _named(spec: str) -> tuple[str, list[Path]]:
    name, sep, paths = spec.partition("=")
    if not sep or not name or not paths:
        raise argparse.ArgumentTypeError(f"'{spec}': expected NAME=EVAL_DIR[,EVAL_DIR...]")
    return name, [Path(p) for p in paths.split(",")]


def load_rows(folders: list[Path], agent: str) -> dict[str, dict[str, dict[str, Any]]]:
    """benchmark -> task id -> sample row of `agent` in each `folder/samples.parquet`
    (several folders: e.g. one `mempo eval` per benchmark of the same policy)."""
    import pandas as pd

    out: dict[str, dict[str, dict[str, Any]]] = {}
    for folder in folders:
        path = folder / "samples.parquet"
        if not path.is_file():
            raise SystemExit(f"error: {path}: no samples.parquet (not a `mempo eval --out` folder?)")
        frame = pd.read_parquet(path)
        frame = frame[frame["agent"] == agent]
        if frame.empty:
            raise SystemExit(f"error: {path}: no rows of agent '{agent}'")
        for row in frame.to_dict("records"):
            out.setdefault(str(row["benchmark"]), {})[str(row["id"])] = row
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None and not math.isnan(float(r[key]))]
    return statistics.fmean(values) if values else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from mempo.evaluation.outcomes import outcome_shares

    return {"n": len(rows), **{key: _mean(rows, key) for key in
            ("em", "objective_em", "all_correct", "format_valid", "turns", "peak_prompt_tokens")},
            "outcomes": outcome_shares(rows)}


def compare(base: tuple[str, list[Path]], runs: list[tuple[str, list[Path]]], agent: str, n_boot: int = 2000) -> dict[str, Any]:
    from mempo.evaluation.stats import paired_bootstrap

    base_rows = load_rows(base[1], agent)
    loaded = {name: load_rows(folder, agent) for name, folder in runs}
    result: dict[str, Any] = {}
    for bench, by_id in sorted(base_rows.items()):
        entry: dict[str, Any] = {base[0]: summarise(list(by_id.values()))}
        multi = any(float(r.get("k") or 1) > 1 for r in by_id.values())
        for name, rows in loaded.items():
            other = rows.get(bench, {})
            entry[name] = summarise(list(other.values()))
            for key in ("em", "objective_em") if multi else ("em",):
                diff = paired_bootstrap([{t: r[key] for t, r in other.items()}],
                                        [{t: r[key] for t, r in by_id.items()}], n_boot=n_boot)
                entry[name][f"{key}_minus_{base[0]}"] = diff
        result[bench] = entry
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=_named, required=True, help="NAME=EVAL_DIR[,EVAL_DIR...] the others are compared with")
    ap.add_argument("--runs", type=_named, nargs="+", required=True, help="NAME=EVAL_DIR[,EVAL_DIR...] ...")
    ap.add_argument("--agent", default="memory")
    ap.add_argument("--out", type=Path, required=True, help="JSON to write")
    ap.add_argument("--note", default="", help="what the policies are and how they were made")
    args = ap.parse_args(argv)
    result = {"agent": args.agent, "base": args.base[0], "runs": [n for n, _ in args.runs],
              "note": args.note, "benchmarks": compare(args.base, args.runs, args.agent)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.out)
    from mempo.evaluation.stats import format_interval

    for bench, entry in result["benchmarks"].items():
        for name in [args.base[0], *result["runs"]]:
            s = entry[name]
            line = f"{bench:10s} {name:6s} n={s['n']:4d} em={s['em'] or 0:.3f}"
            for key in ("em", "objective_em"):
                d = s.get(f"{key}_minus_{args.base[0]}")
                if d:
                    line += f"  {key} {format_interval(d)}"
            print(line)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
