"""`mempo train verl`: launch MemPO on verl 0.9.1 (Ray + GPUs, SGLang rollouts), then merge.

    mempo train verl --policy outputs/sft/model --data data/prepared \
        --retriever http://10.0.0.5:8013 --nnodes 2 --gpus-per-node 8 --ray-address auto
    mempo train verl --dry-run          # print the command and overrides, start nothing

What it does, in order:
1. checks the installed verl against `configs/verl/REQUIRED_VERL.txt` and that the plug-in
   registers (`mempo.verl_plugin.assert_registered`), so a broken install fails here, not
   hours later as plain GRPO;
2. checks the inputs (the policy folder, the data stage's `train.parquet` / `val.parquet`,
   the tool config beside the Hydra config) and runs the preflight (`preflight`): the
   retriever answers a search from this node; with `nnodes > 1` every path is under
   `verl.shared_dir`, MLflow is a tracking server (a sqlite file exists on one node only),
   and, on a running Ray cluster, a probe task on every node sees this run's output folder,
   has `MLFLOW_TRACKING_URI` and reaches the retriever. A refused launch costs no GPU time;
3. runs `python -m verl.trainer.main_ppo --config-path configs/verl --config-name
   mempo_trainer` with Hydra overrides from params.yaml (`verl:`, `mempo:`, `rollout:`; the
   `mempo:` block as `mempo.config.hydra` spells it). The agent-loop workers load the tool
   config that ships beside the Hydra config (the same path on every node of one image) and read the retriever URL from
   `MEMPO_RETRIEVER_URL`, which the Ray runtime env carries with `VERL_USE_EXTERNAL_MODULES=
   mempo.verl_plugin` (every worker imports the plug-in), `MLFLOW_RUN_ID` when a stage run
   is open, and SGLang's logits-processor chunking for the memory probe. The MLflow URI is
   NOT on the command line, in the runtime env or in launch.json (it may carry credentials,
   and verl prints both): the training process inherits it, and Ray workers on other nodes
   have it from their own environment (the RayJob sets it from a Secret). With
   `ray_address` set, `RAY_ADDRESS` points verl's `ray.init()` at the existing cluster;
   without it verl starts a local head;
4. merges the newest checkpoint (`trainer.default_local_dir`, verl's tracker file) into an
   HF folder `<out>/model` with `python -m verl.model_merger merge --backend fsdp`, so the
   register stage reads it exactly like the local trainer's output, then retires verl's
   checkpoints; writes `<out>/verl/launch.json` (command, overrides, checkpoint, preflight,
   exit code).

verl runs with `resume_mode: auto` and continues whatever is in its checkpoint folder, so
before step 4 the launcher fingerprints the run (params + the contents of the policy, data
and Hydra overlay) into `<checkpoints>/mempo_fingerprint.json`; checkpoints of another run
(or of one that recorded none) are moved aside to `checkpoints.stale-<time>/`, not resumed.

PPO mini-batches: verl counts ROWS (`ppo_mini_batch_size x rollout.n`), and every turn is a
row here, so a mini-batch of P prompts would hold P/turns episodes and an epoch would take
about `turns` times the optimizer steps intended. The launcher sets
`actor.ppo_mini_batch_size = verl.ppo_mini_batch_prompts x verl.turns_per_episode`; the
trainer logs the turns per episode it sees (`mempo/turns_per_episode`), to adjust
`verl.turns_per_episode` if they drift.

This module plans the run (`plan_verl_run`, the Hydra overrides) and launches it; the checks
of step 2 are in `mempo.training.verl_preflight`, the checkpoint guard and merge of step 4 in
`mempo.training.verl_checkpoints`.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mempo.config.hydra import hydra_mempo_values, hydra_value
from mempo.errors import ConfigError, DataError, MempoError
from mempo.io import write_json
from mempo.training.verl_checkpoints import (
    guard_verl_checkpoints,
    latest_checkpoint,
    merge_checkpoint,
    retire_verl_checkpoints,
)
from mempo.training.verl_preflight import check_inputs, preflight

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "verl" / "mempo_trainer.yaml"
REQUIRED_VERL = REPO_ROOT / "configs" / "verl" / "REQUIRED_VERL.txt"

RETRIEVER_ENV = "MEMPO_RETRIEVER_URL"


@dataclass
class VerlRunPlan:
    """Everything `launch_verl` will run (also what `--dry-run` prints).

    Attributes:
        command: argv of the training process.
        env: environment variables set for it (on top of the current environment); printed
            and recorded, so never a secret.
        overrides: the Hydra overrides inside `command`.
        out: output folder; checkpoints in `checkpoint_dir`, merged model in `model_dir`.
        tool_config: the tool config the agent-loop workers load (beside the Hydra config).
        retriever: the retrieval service URL (reaches the workers as MEMPO_RETRIEVER_URL).
        private_env: set for the process too, but never printed or recorded (the MLflow URI
            when it does not come from the environment already).
    """

    command: list[str]
    env: dict[str, str]
    overrides: list[str]
    out: Path
    checkpoint_dir: Path
    model_dir: Path
    tool_config: Path
    retriever: str = ""
    private_env: dict[str, str] = field(default_factory=dict, repr=False)

    def shell(self) -> str:
        """The command as one copy-pasteable shell line (env vars first, no secrets)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.command)}".strip()


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
        params: `mempo.config.Params` (uses `verl`, `mempo` and `rollout`).
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
    # the copy that ships beside the Hydra config: the same path on every node of one image
    tool_config = cfg.parent.resolve() / "retrieval_tool.yaml"
    data = Path(vp.data).resolve()
    ap = params.rollout
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
        ("actor_rollout_ref.rollout.temperature", ap.temperature),
        ("actor_rollout_ref.rollout.top_p", ap.top_p),
        # verl counts rows and every turn is a row (module docstring)
        ("actor_rollout_ref.actor.ppo_mini_batch_size", ppo_mini_batch_rows(vp)),
    ]
    # the Hydra `mempo:` section, key by key as mempo.config.hydra generates it
    pairs += [(f"mempo.{k}", v) for k, v in hydra_mempo_values(params).items()]
    if vp.total_training_steps:
        pairs.append(("trainer.total_training_steps", vp.total_training_steps))
    overrides = [f"{k}={hydra_value(v)}" for k, v in pairs]

    env = {"VERL_USE_EXTERNAL_MODULES": "mempo.verl_plugin", "TOKENIZERS_PARALLELISM": "false",
           RETRIEVER_ENV: vp.retriever}
    runtime_env = dict(env)
    for key in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(key):
            runtime_env[key] = os.environ[key]
    if mlflow_run_id:
        runtime_env["MLFLOW_RUN_ID"] = mlflow_run_id
    if runtime_env.get("MLFLOW_RUN_ID"):
        env["MLFLOW_RUN_ID"] = runtime_env["MLFLOW_RUN_ID"]
    runtime_env.update(sglang_probe_env(vp.logprob_chunk_size))
    # Ray workers (possibly on other nodes) get these through the job's runtime env.
    overrides += [f"++ray_kwargs.ray_init.runtime_env.env_vars.{k}={hydra_value(v)}"
                  for k, v in sorted(runtime_env.items())]
    if vp.ray_address:
        env["RAY_ADDRESS"] = vp.ray_address
    overrides += list(vp.overrides)
    private_env = {}
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        from mempo.tracking import tracking_uri

        private_env["MLFLOW_TRACKING_URI"] = tracking_uri()

    command = [python or sys.executable, "-m", "verl.trainer.main_ppo",
               "--config-path", str(cfg.parent.resolve()), "--config-name", cfg.stem, *overrides]
    return VerlRunPlan(command, env, overrides, out, checkpoint_dir, out / "model", tool_config,
                       retriever=vp.retriever, private_env=private_env)


def ppo_mini_batch_rows(vp: Any) -> int:
    """verl's `ppo_mini_batch_size` (it multiplies by rollout.n) for `ppo_mini_batch_prompts`
    prompts whose episodes each give about `turns_per_episode` turn rows."""
    return max(1, round(vp.ppo_mini_batch_prompts * vp.turns_per_episode))


def sglang_probe_env(chunk_size: int) -> dict[str, str]:
    """SGLang's logits-processor chunking for prompt log-probs (the memory probe), 0 = off.

    Without it SGLang builds float32 logits over the whole vocabulary for every prompt token
    of a probe at once (152k x 4 bytes = 0.6 MB per token for Qwen2.5: 1.2 GB for a
    2,000-token probe prompt); chunked, it holds `chunk_size` tokens' worth at a time.
    """
    if chunk_size <= 0:
        return {}
    return {"SGLANG_ENABLE_LOGITS_PROCESSER_CHUNK": "1", "SGLANG_LOGITS_PROCESSER_CHUNK_SIZE": str(chunk_size)}



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
    from mempo.tracking import tracking_uri

    summary["preflight"] = preflight(plan, params, tracking_uri=tracking_uri())
    aside = guard_verl_checkpoints(plan, params)
    if aside is not None:
        summary["stale_checkpoints"] = str(aside)
    log.info("launching: %s", plan.shell())
    proc = subprocess.run(plan.command, env={**os.environ, **plan.private_env, **plan.env})
    summary["exit_code"] = proc.returncode
    step = latest_checkpoint(plan.checkpoint_dir)
    summary["checkpoint"] = str(step) if step else None
    if proc.returncode == 0 and params.verl.merge:
        if step is None:
            raise DataError("training finished but wrote no checkpoint (set trainer.save_freq > 0)",
                            path=plan.checkpoint_dir)
        summary["model"] = str(merge_checkpoint(step, plan.model_dir))
        retire_verl_checkpoints(plan.checkpoint_dir)
    write_json(plan.out / "verl" / "launch.json", {**summary, "overrides": plan.overrides})
    if proc.returncode != 0:
        raise MempoError(f"verl training exited with {proc.returncode} (resume_mode=auto continues from "
                         f"{summary['checkpoint'] or 'the start'} on the next run)")
    return summary
