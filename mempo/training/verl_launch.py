"""`mempo train verl`: launch MemPO on verl 0.9.1 (Ray + GPUs, SGLang rollouts), then merge.

    mempo train verl --policy outputs/sft/model --data data/prepared \
        --retriever http://10.0.0.5:8013 --nnodes 2 --gpus-per-node 8 --ray-address auto
    mempo train verl --dry-run          # print the command and overrides, start nothing

What it does, in order:
1. checks the installed verl against `configs/verl/REQUIRED_VERL.txt` and that the plug-in
   registers (`mempo.verl_plugin.assert_registered`), so a broken install fails here, not
   hours later as plain GRPO;
2. checks the inputs: the policy folder and the data stage's `train.parquet` / `val.parquet`;
3. writes the run's tool config (`<out>/verl/retrieval_tool.yaml`, `retriever` set);
4. runs `python -m verl.trainer.main_ppo --config-path configs/verl --config-name
   mempo_trainer` with Hydra overrides from params.yaml (`verl:`, `mempo:`, `agent:`,
   `train.lambda_mem`) and the Ray runtime env carrying `MLFLOW_TRACKING_URI` (and
   `MLFLOW_RUN_ID` when a pipeline stage run is open) plus `VERL_USE_EXTERNAL_MODULES=
   mempo.verl_plugin`, which makes every Ray worker import the plug-in even where the
   entry point metadata is missing. With `ray_address` set, `RAY_ADDRESS` points verl's
   `ray.init()` at the existing cluster; without it verl starts a local head;
5. merges the newest checkpoint (`trainer.default_local_dir`, verl's tracker file) into an
   HF folder `<out>/model` with `python -m verl.model_merger merge --backend fsdp`, so the
   register stage reads it exactly like the local trainer's output; writes
   `<out>/verl/launch.json` (command, overrides, checkpoint, exit code).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mempo.errors import ConfigError, DataError, MempoError
from mempo.io import atomic_dir, write_json, write_text

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "verl" / "mempo_trainer.yaml"
REQUIRED_VERL = REPO_ROOT / "configs" / "verl" / "REQUIRED_VERL.txt"

# params.yaml keys forwarded into the Hydra `mempo:` section (section, key).
# Unquoted Hydra override values: these characters only, and nothing Hydra would read as
# a number, bool or null.
_PLAIN = re.compile(r"[A-Za-z0-9_./-]+")
_LOOKS_TYPED = re.compile(r"[-+]?[0-9][0-9_.eE+-]*|true|false|null|nan|inf", re.IGNORECASE)

_MEMPO_KEYS = ("eps", "form", "norm_by_std", "mem_adv_group", "adv_eps", "mem_adv_min_std", "multi_rule",
               "format_rule", "format_penalty")


@dataclass
class VerlRunPlan:
    """Everything `launch_verl` will run (also what `--dry-run` prints).

    Attributes:
        command: argv of the training process.
        env: environment variables set for it (on top of the current environment).
        overrides: the Hydra overrides inside `command`.
        out: output folder; checkpoints in `checkpoint_dir`, merged model in `model_dir`.
        tool_config: the run's tool config path (written by `launch_verl`).
        tool_settings: its `retriever` etc.
    """

    command: list[str]
    env: dict[str, str]
    overrides: list[str]
    out: Path
    checkpoint_dir: Path
    model_dir: Path
    tool_config: Path
    tool_settings: dict[str, Any] = field(default_factory=dict)

    def shell(self) -> str:
        """The command as one copy-pasteable shell line (env vars first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.command)}".strip()


def hydra_value(value: Any) -> str:
    """Render a Python value for a Hydra command-line override (strings quoted when needed)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    text = str(value)
    if _PLAIN.fullmatch(text) and not _LOOKS_TYPED.fullmatch(text):
        return text  # paths and names stay readable; Hydra parses them as strings
    text = text.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def required_verl_version(path: Path = REQUIRED_VERL) -> str:
    """The pinned version from REQUIRED_VERL.txt (its first line, `verl==X.Y.Z`)."""
    first = path.read_text(encoding="utf-8").splitlines()[0].strip()
    if not first.startswith("verl=="):
        raise ConfigError(f"first line must be verl==VERSION, got {first!r}", path=path)
    return first.split("==", 1)[1]


def check_verl_install(path: Path = REQUIRED_VERL) -> str:
    """Raise ConfigError unless the installed verl is the pinned one and MemPO registered in it."""
    try:
        import verl
    except ImportError as e:
        raise ConfigError(f"verl is not installed ({e}); install {path.read_text().splitlines()[0]}") from e
    want = required_verl_version(path)
    if verl.__version__ != want:
        raise ConfigError(f"installed verl {verl.__version__} but MemPO is pinned to {want}", path=path)
    import mempo.verl_plugin as plugin

    try:
        plugin.assert_registered()
    except RuntimeError as e:
        raise ConfigError(str(e)) from e
    return verl.__version__


def plan_verl_run(params: Any, config: str | Path | None = None, python: str | None = None,
                  mlflow_run_id: str | None = None) -> VerlRunPlan:
    """Build the training command from params (no side effects).

    Args:
        params: `mempo.config.Params` (uses `verl`, `mempo`, `agent` and `train.lambda_mem`).
        config: the Hydra overlay (default: params.verl.config).
        python: interpreter for the training process (default: this one).
        mlflow_run_id: an open MLflow run verl's tracker should log into (`MLFLOW_RUN_ID`).
    """
    vp = params.verl
    cfg = Path(config or vp.config)
    if not cfg.is_absolute():
        cfg = (Path.cwd() / cfg) if (Path.cwd() / cfg).exists() else REPO_ROOT / cfg
    out = Path(vp.out).resolve()
    checkpoint_dir = out / "verl" / "checkpoints"
    tool_config = out / "verl" / "retrieval_tool.yaml"
    data = Path(vp.data).resolve()
    mp, ap = params.mempo, params.agent
    train = getattr(params, "train", None)
    lambda_mem = vp.lambda_mem if vp.lambda_mem is not None else getattr(train, "lambda_mem", 1.0)
    pairs: list[tuple[str, Any]] = [
        ("actor_rollout_ref.model.path", str(Path(vp.policy).resolve())),
        ("data.train_files", str(data / "train.parquet")),
        ("data.val_files", str(data / "val.parquet")),
        ("actor_rollout_ref.rollout.multi_turn.tool_config_path", str(tool_config)),
        ("trainer.default_local_dir", str(checkpoint_dir)),
        ("trainer.nnodes", vp.nnodes),
        ("trainer.n_gpus_per_node", vp.n_gpus_per_node),
        ("trainer.experiment_name", vp.experiment_name),
        ("trainer.total_epochs", vp.total_epochs),
        ("actor_rollout_ref.rollout.n", vp.n_rollouts),
        ("data.train_batch_size", vp.train_batch_size),
        ("actor_rollout_ref.actor.optim.lr", vp.lr),
        ("mempo.lambda_mem", float(lambda_mem)),
        ("mempo.max_turns", ap.max_turns),
        ("mempo.max_new_tokens", ap.max_new_tokens),
        ("mempo.check_masks", ap.check_masks),
        ("actor_rollout_ref.rollout.temperature", ap.temperature),
        ("actor_rollout_ref.rollout.top_p", ap.top_p),
    ]
    pairs += [(f"mempo.{k}", getattr(mp, k)) for k in _MEMPO_KEYS]
    if vp.total_training_steps:
        pairs.append(("trainer.total_training_steps", vp.total_training_steps))
    overrides = [f"{k}={hydra_value(v)}" for k, v in pairs]

    env = {"VERL_USE_EXTERNAL_MODULES": "mempo.verl_plugin", "TOKENIZERS_PARALLELISM": "false"}
    runtime_env = dict(env)
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "HF_HUB_OFFLINE",
                "TRANSFORMERS_OFFLINE"):
        if os.environ.get(key):
            runtime_env[key] = os.environ[key]
    if "MLFLOW_TRACKING_URI" not in runtime_env:
        from mempo.tracking import tracking_uri

        runtime_env["MLFLOW_TRACKING_URI"] = tracking_uri()
    if mlflow_run_id:
        runtime_env["MLFLOW_RUN_ID"] = mlflow_run_id
    env["MLFLOW_TRACKING_URI"] = runtime_env["MLFLOW_TRACKING_URI"]
    if runtime_env.get("MLFLOW_RUN_ID"):
        env["MLFLOW_RUN_ID"] = runtime_env["MLFLOW_RUN_ID"]
    # Ray workers (possibly on other nodes) get these through the job's runtime env.
    overrides += [f"++ray_kwargs.ray_init.runtime_env.env_vars.{k}={hydra_value(v)}"
                  for k, v in sorted(runtime_env.items())]
    if vp.ray_address:
        env["RAY_ADDRESS"] = vp.ray_address
    overrides += list(vp.overrides)

    command = [python or sys.executable, "-m", "verl.trainer.main_ppo",
               "--config-path", str(cfg.parent.resolve()), "--config-name", cfg.stem, *overrides]
    tool_settings = {"retriever": vp.retriever}
    return VerlRunPlan(command, env, overrides, out, checkpoint_dir, out / "model", tool_config, tool_settings)


def write_tool_config(plan: VerlRunPlan, template: Path | None = None) -> Path:
    """Write the run's tool config: the template with `retriever` set (atomic)."""
    template = template or DEFAULT_CONFIG.parent / "retrieval_tool.yaml"
    doc = yaml.safe_load(template.read_text(encoding="utf-8"))
    for tool in doc.get("tools", []):
        tool.setdefault("config", {}).update(plan.tool_settings)
    plan.tool_config.parent.mkdir(parents=True, exist_ok=True)
    write_text(plan.tool_config, "# written by mempo train verl from " + template.name + "\n"
               + yaml.safe_dump(doc, sort_keys=False))
    return plan.tool_config


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The newest `global_step_N` folder per verl's tracker file (None when there is none)."""
    tracker = checkpoint_dir / "latest_checkpointed_iteration.txt"
    if not tracker.exists():
        return None
    step = int(tracker.read_text().strip())
    path = checkpoint_dir / f"global_step_{step}"
    return path if path.exists() else None


def merge_checkpoint(step_dir: Path, target: Path, python: str | None = None) -> Path:
    """Merge `step_dir/actor` (FSDP shards) into an HF folder `target` with verl.model_merger (atomic)."""
    actor = step_dir / "actor"
    if not actor.is_dir():
        raise DataError("no actor/ folder in the checkpoint", path=step_dir)
    with atomic_dir(target) as tmp:
        cmd = [python or sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
               "--local_dir", str(actor), "--target_dir", str(tmp)]
        log.info("merging %s -> %s", actor, target)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise MempoError(f"verl.model_merger failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}",
                             path=actor)
        tok_src = actor / "huggingface"
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (tok_src / name).exists() and not (tmp / name).exists():
                (tmp / name).write_bytes((tok_src / name).read_bytes())
    return target


def check_inputs(plan: VerlRunPlan, params: Any) -> None:
    """DataError naming the missing input (policy folder, train/val parquet)."""
    policy = Path(params.verl.policy)
    if not (policy / "config.json").exists():
        raise DataError("policy folder has no config.json (run `mempo train sft` or `mempo policy`)",
                        path=policy, field="verl.policy")
    for split in ("train", "val"):
        f = Path(params.verl.data) / f"{split}.parquet"
        if not f.exists():
            raise DataError(f"no {split}.parquet (run `mempo data prepare`)", path=f, field="verl.data")


def launch_verl(params: Any, dry_run: bool = False, tracking: bool = True,
                python: str | None = None) -> dict[str, Any]:
    """Run the whole verl path (see module docstring). Returns a summary dict.

    `dry_run=True` only plans and checks the pin/registration; nothing is started or written.
    With `tracking`, an MLflow stage run `train_verl` (nested under the pipeline run when one
    is open) is opened and verl's own MLflow logger writes its metrics into it. `python` is
    the interpreter that runs `verl.trainer.main_ppo` (default: this one).
    """
    version = check_verl_install()
    if dry_run:
        plan = plan_verl_run(params)
        return {"verl": version, "command": plan.shell(), "out": str(plan.out), "dry_run": True}
    if not tracking:
        return _launch(params, version, None, python)
    from mempo.tracking import stage_run

    with stage_run("train_verl", params=params.verl, data={"policy": params.verl.policy,
                                                           "data": params.verl.data}) as run:
        run_id = getattr(getattr(run, "info", None), "run_id", None)
        return _launch(params, version, run_id, python)


def _launch(params: Any, version: str, run_id: str | None, python: str | None) -> dict[str, Any]:
    plan = plan_verl_run(params, python=python, mlflow_run_id=run_id)
    summary: dict[str, Any] = {"verl": version, "command": plan.shell(), "out": str(plan.out)}
    check_inputs(plan, params)
    write_tool_config(plan)
    log.info("launching: %s", plan.shell())
    proc = subprocess.run(plan.command, env={**os.environ, **plan.env})
    summary["exit_code"] = proc.returncode
    step = latest_checkpoint(plan.checkpoint_dir)
    summary["checkpoint"] = str(step) if step else None
    if proc.returncode == 0 and params.verl.merge:
        if step is None:
            raise DataError("training finished but wrote no checkpoint (set trainer.save_freq > 0)",
                            path=plan.checkpoint_dir)
        summary["model"] = str(merge_checkpoint(step, plan.model_dir))
    write_json(plan.out / "verl" / "launch.json", {**summary, "overrides": plan.overrides})
    if proc.returncode != 0:
        raise MempoError(f"verl training exited with {proc.returncode} (resume_mode=auto continues from "
                         f"{summary['checkpoint'] or 'the start'} on the next run)")
    return summary
