"""Ablations as DVC experiments: the pipeline with one setting changed, compared by `dvc exp show`.

    make ablate                                    # = python -m mempo.ablation (tiny profile)
    python -m mempo.ablation --dry-run             # print the dvc commands, run nothing
    python -m mempo.ablation --only no-mem-adv eps-none --profile none   # on params.yaml as it is
    dvc exp show --only-changed                    # the table again, later

Each ablation is one `dvc exp run --temp -n <name> -S key=value ...`: it runs in a temporary
copy of the workspace, and its params, dvc.lock and headline metrics
(`outputs/register/headline.json`) are kept as an experiment of the current commit. Stages
an ablation shares with an earlier run (world, index, data, policy, SFT) come from DVC's run
cache, so only train -> eval -> register run again. `--profile tiny` (the default) also sets
every key of the tiny profile (`params.tiny.yaml`), so the whole set runs
in minutes on a CPU; it proves the ablation wiring and the direction of effects only on a
model that small. Experiments log to this project's MLflow store (experiment
`mempo-ablations`) and register their models as `mempo-agent-ablation`, never as the
production model. Apply one with `dvc exp apply <name>`; drop them with `dvc exp remove -A`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mempo.config.hydra import hydra_value
from mempo.errors import ConfigError, MempoError

# name -> the params it changes (dotted keys). `mempo` is the method as configured: the row
# the others are read against.
ABLATIONS: dict[str, dict[str, Any]] = {
    "mempo": {},
    "no-mem-adv": {"mempo.lambda_mem": 0.0},        # outcome advantage only (plain GRPO, MEM1-style)
    "eps-previous": {"mempo.eps": "previous"},      # baseline: the previous turn's memory, not the full history
    "eps-none": {"mempo.eps": "none"},              # memory reward without a baseline
    "prob": {"mempo.form": "prob"},                 # probabilities instead of log-probabilities
}
# What experiments share: a separate registered model and MLflow experiment.
EXPERIMENT_SETTINGS: dict[str, Any] = {"register.model_name": "mempo-agent-ablation"}
MLFLOW_EXPERIMENT = "mempo-ablations"
# Columns `dvc exp show` keeps: the ablated params and the headline metrics.
SHOW_KEEP = r"^(Experiment|mempo\.lambda_mem|mempo\.eps|mempo\.form|em\..*|tokens\..*|train\.(reward|kl))$"


def experiment_commands(
    names: Sequence[str], profile: Mapping[str, Any] | None = None, dvc: str = "dvc"
) -> list[list[str]]:
    """One `dvc exp run --temp` command per ablation: the profile, then the ablation's changes."""
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        raise ConfigError(f"unknown ablation(s) {unknown}; choose from {list(ABLATIONS)}")
    cmds = []
    for name in names:
        settings = {**(profile or {}), **EXPERIMENT_SETTINGS, **ABLATIONS[name]}
        sets = [arg for k, v in settings.items() for arg in ("-S", f"{k}={hydra_value(v, quote_strings=True)}")]
        cmds.append([dvc, "exp", "run", "--temp", "-n", name, *sets])
    return cmds


def show_command(dvc: str = "dvc") -> list[str]:
    """`dvc exp show` narrowed to the ablated params and the headline metrics."""
    return [dvc, "exp", "show", "--no-pager", "--md", "--drop", ".*", "--keep", SHOW_KEEP]


def _env(root: Path) -> dict[str, str]:
    # The temporary workspaces are deleted afterwards: their runs go to this project's store.
    env = dict(os.environ)
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    env.setdefault("MLFLOW_ARTIFACTS_DESTINATION", str(root / "mlartifacts"))
    env["MLFLOW_EXPERIMENT_NAME"] = MLFLOW_EXPERIMENT
    env.pop("MEMPO_PARENT_RUN_ID", None)
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_ablations(
    root: str | Path = ".", names: Sequence[str] | None = None, *, profile: str = "tiny", dry_run: bool = False,
) -> str:
    """Run each ablation as a DVC experiment of the current commit; return the `dvc exp show` table.

    Raises `MempoError` naming the ablation whose experiment failed.
    """
    from mempo.config import profile_overrides
    from mempo.dvc_runner import dvc_executable
    from mempo.pipeline import TINY_PROFILE

    root = Path(root).resolve()
    if profile not in ("tiny", "none"):
        raise ConfigError(f"unknown profile '{profile}' (tiny | none)")
    overrides = profile_overrides(root / TINY_PROFILE) if profile == "tiny" else {}
    dvc = dvc_executable()
    cmds = experiment_commands(list(names or ABLATIONS), overrides, dvc)
    if dry_run:
        return "\n".join(" ".join(c) for c in [*cmds, show_command(dvc)])
    env = _env(root)
    for cmd in cmds:
        print(f"== ablation {cmd[cmd.index('-n') + 1]}", flush=True)
        proc = subprocess.run(cmd, cwd=root, env=env)
        if proc.returncode != 0:
            raise MempoError(f"ablation '{cmd[cmd.index('-n') + 1]}' failed (`dvc exp run` exit {proc.returncode})")
    proc = subprocess.run(show_command(dvc), cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise MempoError(f"`dvc exp show` failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m mempo.ablation`: run the ablations and print the comparison."""
    ap = argparse.ArgumentParser(prog="python -m mempo.ablation", description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help=f"ablations to run (default: all of {list(ABLATIONS)})")
    ap.add_argument("--profile", default="tiny", choices=["tiny", "none"],
                    help="tiny: the keys of params.tiny.yaml (minutes on a CPU); none: params.yaml as it is")
    ap.add_argument("--dry-run", action="store_true", help="print the dvc commands only")
    args = ap.parse_args(argv)
    try:
        print(run_ablations(".", args.only, profile=args.profile, dry_run=args.dry_run))
    except MempoError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
