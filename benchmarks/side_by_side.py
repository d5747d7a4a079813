"""A pair of stages one after the other vs side by side (what `mempo pipeline run` does with
`pipeline.parallel_stages`), measured in the same run on this machine: the two SFT cold
starts (`--pair sft`: `sft`, `sft_full`) or the two GRPO stages (`--pair grpo`: `train`,
`train_full`).

Both runs execute dvc.yaml's own commands of the pair (read from dvc.yaml, the retriever
URL dropped: the stages open the index folder in-process), shortened to `--steps N`
optimiser steps and given output folders in the workdir; the inputs are a finished
pipeline's (`--root`: its outputs/policy and the teacher's episode records for SFT, its two
SFT checkpoints and prepared data for GRPO). Order: sequential, then side by side, then
sequential again, so a drift of the machine's speed shows up as a difference between the
two sequential runs.

    .venv/bin/python benchmarks/side_by_side.py --root <a finished make run> --steps 150
    .venv/bin/python benchmarks/side_by_side.py --root <a finished make run> --pair grpo --steps 6

Writes benchmarks/results/side_by_side.json (side_by_side_grpo.json for GRPO): the wall
times, the ratio sequential / side by side (2.0 would be perfect on 2 cores), each stage's
own seconds in both modes (how much running beside the other slowed it), and what that
predicts for the default run's two stages (their step counts at full length, from each
mode's seconds per step).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PAIRS = {"sft": ("sft", "sft_full"), "grpo": ("train", "train_full")}  # each stage writes outputs/<name>


def stage_command(name: str, steps: int, out: Path, teacher: Path) -> list[str]:
    """dvc.yaml's command of `name` with the step budget, the output folder and (SFT) the
    teacher's records overridden (placed after dvc.yaml's own `--set`s: the last value given
    wins)."""
    cmd = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][name]["cmd"]
    argv = shlex.split(cmd.split("\\${")[0])  # no retriever URL: SFT does not retrieve, GRPO opens the index
    assert argv[0] == "mempo" and "train" in argv, argv
    if name in PAIRS["grpo"]:
        over: dict[str, object] = {"train.steps": steps, "train.out": out, "train.resume": "never",
                                   "train.checkpoint_every": 10**6, "train.val_every": 0}
    else:
        over = {"sft.max_steps": steps, "sft.out": out, "sft.resume": "never", "sft.eval_every": 10**6,
                "sft.checkpoint_every": 10**6, "sft.trajectories": teacher / "train_episodes.jsonl",
                "sft.val_trajectories": teacher / "val_episodes.jsonl"}
    i = argv.index("train")
    sets = [x for k, v in over.items() for x in ("--set", f"{k}={v}")]
    return [str(Path(sys.executable).parent / "mempo"), *argv[1:i], *sets, *argv[i:]]


def run_stages(names: tuple[str, ...], side_by_side: bool, work: Path, root: Path, steps: int,
               teacher: Path) -> dict[str, float]:
    """Wall seconds of each stage and of the whole, run one after the other or all at once."""
    env = {**os.environ, "MEMPO_TRACKING": "0", "PYTHONPATH": str(REPO)}
    procs: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    times: dict[str, float] = {}

    def finish(name: str) -> None:
        p, start = procs[name]
        if p.wait() != 0:
            raise SystemExit(f"{name} failed: see {work / f'{name}.log'}")
        times[name] = time.perf_counter() - start

    t0 = time.perf_counter()
    for name in names:
        with open(work / f"{name}.log", "wb") as log:  # the child keeps its own copy of the handle
            p = subprocess.Popen(stage_command(name, steps, work / name, teacher), cwd=root, env=env, stdout=log,
                                 stderr=subprocess.STDOUT)
        procs[name] = (p, time.perf_counter())
        if not side_by_side:
            finish(name)
    for name in names:
        if name not in times:
            finish(name)
    times["wall"] = time.perf_counter() - t0
    for name in names:
        m = json.loads((work / name / "metrics.json").read_text())
        times[f"{name}_train_s"] = m["train_seconds"]
        times[f"{name}_steps"] = m["steps"]
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="a finished pipeline: outputs/policy and the teacher's records")
    ap.add_argument("--pair", choices=list(PAIRS), default="sft", help="the SFT or the GRPO stages")
    ap.add_argument("--teacher", default=None,
                    help="folder of {train,val}_episodes.jsonl (default: ROOT/outputs/teacher)")
    ap.add_argument("--steps", type=int, default=150, help="optimiser steps of each stage")
    ap.add_argument("--full-steps", type=int, nargs=2, default=None, metavar=("MEMORY", "FULL"),
                    help="the stages' steps at full length, for the prediction (default: the root's metrics.json)")
    ap.add_argument("--work", default=str(REPO / "outputs" / "bench-side-by-side"))
    ap.add_argument("--out", default=None, help="default: benchmarks/results/side_by_side[_grpo].json")
    a = ap.parse_args(argv)
    stages = PAIRS[a.pair]
    out_file = Path(a.out) if a.out else REPO / "benchmarks" / "results" / (
        "side_by_side.json" if a.pair == "sft" else f"side_by_side_{a.pair}.json")
    root = Path(a.root).resolve()
    teacher = Path(a.teacher).resolve() if a.teacher else root / "outputs" / "teacher"
    needs = ([root / "outputs" / "policy", teacher / "train_episodes.jsonl", teacher / "val_episodes.jsonl"]
             if a.pair == "sft" else
             [root / "outputs" / s / "model" for s in PAIRS["sft"]] + [root / "data" / "prepared", root / "outputs" / "index"])
    for need in needs:
        if not need.exists():
            raise SystemExit(f"missing: {need} (run `make run` in --root first"
                             + (", or pass --teacher)" if a.pair == "sft" else ")"))
    runs = []
    for i, parallel in enumerate((False, True, False)):
        work = Path(a.work) / a.pair / f"{i}-{'side' if parallel else 'seq'}"
        work.mkdir(parents=True, exist_ok=True)
        print(f"{'side by side' if parallel else 'one after the other'}: {', '.join(stages)}, {a.steps} steps each",
              flush=True)
        t = run_stages(stages, parallel, work, root, a.steps, teacher)
        print("  " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()), flush=True)
        runs.append({"side_by_side": parallel, **t})
    seq = [r for r in runs if not r["side_by_side"]]
    side = next(r for r in runs if r["side_by_side"])
    seq_wall = statistics.fmean(r["wall"] for r in seq)
    full_steps = a.full_steps or [json.loads((root / "outputs" / s / "metrics.json").read_text())["steps"]
                                  for s in stages]
    per_step = {mode: {s: statistics.fmean(r[f"{s}_train_s"] / r[f"{s}_steps"] for r in rs) for s in stages}
                for mode, rs in (("sequential", seq), ("side_by_side", [side]))}
    predicted = {"sequential_s": sum(per_step["sequential"][s] * n for s, n in zip(stages, full_steps, strict=True)),
                 "side_by_side_s": max(per_step["side_by_side"][s] * n for s, n in zip(stages, full_steps, strict=True))}
    out = {
        "benchmark": "side_by_side", "pair": a.pair, "stages": list(stages), "steps_each": a.steps,
        "machine": {"cpus": os.cpu_count(), "load_avg_at_end": list(os.getloadavg())},
        "runs": runs,
        "sequential_wall_s": seq_wall, "side_by_side_wall_s": side["wall"],
        "ratio": seq_wall / side["wall"],
        "sequential_drift": abs(seq[0]["wall"] - seq[1]["wall"]) / seq_wall,
        "slowdown_beside": {s: per_step["side_by_side"][s] / per_step["sequential"][s] for s in stages},
        "seconds_per_step": per_step,
        "predicted_full_length": {"steps": dict(zip(stages, full_steps, strict=True)), **predicted,
                                  "saved_s": predicted["sequential_s"] - predicted["side_by_side_s"]},
        "command": " ".join(["benchmarks/side_by_side.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(out, indent=2) + "\n")
    print(f"sequential {seq_wall:.0f} s, side by side {side['wall']:.0f} s: {out['ratio']:.2f}x; "
          f"full length predicted {predicted['sequential_s'] / 60:.0f} -> {predicted['side_by_side_s'] / 60:.0f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
