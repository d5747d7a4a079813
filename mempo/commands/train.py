"""`mempo train teacher|sft|grpo`: the teacher's SFT episodes, the SFT cold start and the local
GRPO + memory-advantage trainer.

Flags override `params.yaml` (`sft:` / `train:`); `--set section.key=value` overrides any key.
"""

from __future__ import annotations

import argparse
import json

from mempo.commands import params_from


def register(sub: argparse._SubParsersAction) -> None:
    from mempo.cli import add_subparser

    train = add_subparser(sub, "train", "train the policy: SFT cold start, then GRPO + memory advantage")
    tsub = train.add_subparsers(dest="train_command", metavar="TRAINER", required=True)

    def teacher_inputs(parser: argparse.ArgumentParser, policy_help: str) -> None:
        """The flags of what the teacher reads (`train teacher`, and `train sft` when it runs it)."""
        parser.add_argument("--policy", default=None, help=f"{policy_help} (params: sft.policy)")
        parser.add_argument("--world", default=None,
                            help="knowledge world: its corpus names the renamed entities (params: sft.world)")
        parser.add_argument("--data", default=None,
                            help="prepared data folder with the teacher's sft.parquet / sft_val.parquet (params: data.out)")
        parser.add_argument("--retriever", default=None, help="index folder, corpus .jsonl or http URL (params: sft.retriever)")

    teacher = add_subparser(tsub, "teacher", "the scripted teacher's correct episodes on the SFT tasks, for both SFT formats")
    teacher_inputs(teacher, "policy folder whose tokenizer counts tokens")
    teacher.add_argument("--out", default=None, help="output folder (params: sft.teacher_out)")
    teacher.add_argument("--seed", type=int, default=None, help="seed of the entity renaming (params: sft.seed)")
    teacher.set_defaults(handler=_teacher)

    sft = add_subparser(tsub, "sft", "cold start on correct memory-format trajectories")
    teacher_inputs(sft, "model folder to start from")
    sft.add_argument("--trajectories", default=None, help="jsonl of trajectories instead of the teacher (params: sft.trajectories)")
    sft.add_argument("--out", default=None, help="output folder (params: sft.out)")
    sft.add_argument("--max-steps", type=int, default=None, help="optimiser steps (params: sft.max_steps)")
    sft.add_argument("--device", default=None, help="cpu | cuda | auto (params: sft.device)")
    sft.add_argument("--seed", type=int, default=None, help="seed (params: sft.seed)")
    sft.add_argument("--resume", default=None, help="auto | never | CHECKPOINT (params: sft.resume)")
    sft.set_defaults(handler=_sft)

    grpo = add_subparser(tsub, "grpo", "the local GRPO + memory-advantage trainer (CPU or one GPU)")
    grpo.add_argument("--policy", default=None, help="start model folder (params: train.policy)")
    grpo.add_argument("--data", default=None, help="prepared data folder with train.parquet (params: train.data)")
    grpo.add_argument("--retriever", default=None, help="index folder, corpus .jsonl or http URL (params: train.retriever)")
    grpo.add_argument("--out", default=None, help="output folder (params: train.out)")
    grpo.add_argument("--steps", type=int, default=None, help="optimiser steps (params: train.steps)")
    grpo.add_argument("--lambda-mem", type=float, default=None, help="weight of A^M; 0 = plain GRPO (params: mempo.lambda_mem)")
    grpo.add_argument("--device", default=None, help="cpu | cuda | auto (params: train.device)")
    grpo.add_argument("--seed", type=int, default=None, help="seed (params: train.seed)")
    grpo.add_argument("--resume", default=None, help="auto | never | CHECKPOINT (params: train.resume)")
    grpo.add_argument("--decoder", choices=["fast", "hf"], default=None, help="rollout generator (params: train.rollout.decoder, else rollout.decoder)")
    grpo.set_defaults(handler=_grpo)

    verl = add_subparser(tsub, "verl", "the scale path: MemPO as a verl 0.9.1 plug-in on Ray + GPUs (SGLang rollouts)")
    verl.add_argument("--policy", default=None, help="start model folder (params: verl.policy)")
    verl.add_argument("--data", default=None, help="prepared data folder with train/val.parquet (params: verl.data)")
    verl.add_argument("--retriever", default=None, help="retrieval service URL reachable from every node (params: verl.retriever)")
    verl.add_argument("--out", default=None, help="output folder: verl/checkpoints, model (params: verl.out)")
    verl.add_argument("--ray-address", default=None, help='"" local head | auto | ray://host:10001 (params: verl.ray_address)')
    verl.add_argument("--nnodes", type=int, default=None, help="Ray nodes (params: verl.nnodes)")
    verl.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (params: verl.n_gpus_per_node)")
    verl.add_argument("--steps", type=int, default=None, help="stop after N steps, 0 = epochs (params: verl.total_training_steps)")
    verl.add_argument("--lambda-mem", type=float, default=None, help="weight of A^M (params: verl.lambda_mem, else mempo.lambda_mem)")
    verl.add_argument("--dry-run", action="store_true", help="check the verl pin and plug-in, print the command, start nothing")
    verl.add_argument("hydra_overrides", nargs="*", metavar="KEY=VALUE", help="extra verl Hydra overrides")
    verl.set_defaults(handler=_verl)

    rayjob = add_subparser(tsub, "rayjob", "the cluster train step: a KubeRay RayJob running `mempo train verl` (params: cluster)")
    rayjob.add_argument("--policy", default=None, help="start model folder as the Ray pods see it (params: verl.policy)")
    rayjob.add_argument("--data", default=None, help="prepared data folder as the Ray pods see it (params: verl.data)")
    rayjob.add_argument("--retriever", default=None, help="retrieval service URL reachable from the Ray pods (params: verl.retriever)")
    rayjob.add_argument("--out", default=None, help="output folder on the shared volume; the merged model lands in OUT/model (params: verl.out)")
    rayjob.add_argument("--name", default=None, help="RayJob name (default: derived from --out, so a retry finds its job)")
    rayjob.add_argument("--parent-run-id", default=None, help="MLflow parent run (default: $MEMPO_PARENT_RUN_ID)")
    rayjob.add_argument("--dry-run", action="store_true", help="print the validated RayJob manifest, submit nothing")
    rayjob.set_defaults(handler=_rayjob)


def _teacher(args: argparse.Namespace) -> int:
    from mempo.training.sft_data import run_teacher

    params = params_from(args, {
        "sft.policy": args.policy, "sft.world": args.world, "sft.retriever": args.retriever,
        "sft.teacher_out": args.out, "sft.seed": args.seed, "data.out": args.data,
    })
    metrics = run_teacher(params)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))
    return 0


def _sft(args: argparse.Namespace) -> int:
    from mempo.training.sft import run_sft

    params = params_from(args, {
        "sft.policy": args.policy, "sft.world": args.world, "sft.retriever": args.retriever,
        "sft.trajectories": args.trajectories, "sft.out": args.out, "sft.max_steps": args.max_steps,
        "sft.device": args.device, "sft.seed": args.seed, "sft.resume": args.resume, "data.out": args.data,
    })
    metrics = run_sft(params)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))
    return 0


def _grpo(args: argparse.Namespace) -> int:
    from mempo.training.grpo import run_grpo

    params = params_from(args, {
        "train.policy": args.policy, "train.data": args.data, "train.retriever": args.retriever,
        "train.out": args.out, "train.steps": args.steps, "mempo.lambda_mem": args.lambda_mem,
        "train.device": args.device, "train.seed": args.seed, "train.resume": args.resume,
        "train.rollout.decoder": args.decoder,
    })
    metrics = run_grpo(params)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))
    return 0


def _verl(args: argparse.Namespace) -> int:
    from mempo.training.verl_launch import launch_verl

    params = params_from(args, {
        "verl.policy": args.policy, "verl.data": args.data, "verl.retriever": args.retriever,
        "verl.out": args.out, "verl.ray_address": args.ray_address, "verl.nnodes": args.nnodes,
        "verl.n_gpus_per_node": args.gpus_per_node, "verl.total_training_steps": args.steps,
        "verl.lambda_mem": args.lambda_mem,
    })
    if args.hydra_overrides:
        params.verl.overrides = [*params.verl.overrides, *args.hydra_overrides]
    summary = launch_verl(params, dry_run=args.dry_run)
    print(json.dumps(summary, indent=2))
    return 0


def _rayjob(args: argparse.Namespace) -> int:
    import os

    import yaml

    from mempo.orchestration.rayjob import train_on_rayjob
    from mempo.orchestration.rayjob_manifest import TrainRun, job_name, render_rayjob

    params = params_from(args, {"verl.policy": args.policy, "verl.data": args.data,
                                "verl.retriever": args.retriever, "verl.out": args.out})
    vp = params.verl
    run = TrainRun(name=args.name or job_name(vp.out), policy=vp.policy, data=vp.data, out=vp.out,
                   retriever=vp.retriever,
                   parent_run_id=args.parent_run_id or os.environ.get("MEMPO_PARENT_RUN_ID", ""),
                   overrides=tuple(getattr(args, "overrides", []) or []))
    if args.dry_run:
        print(yaml.safe_dump(render_rayjob(params.cluster, run), sort_keys=False))
        return 0
    print(json.dumps(train_on_rayjob(params.cluster, run), indent=2))
    return 0
