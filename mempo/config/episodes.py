"""The sections of the episode-running stages: the shared `rollout:` settings, MemPO's
rewards and advantages (`mempo:`), and the stages that run episodes (eval, sft, train, verl).

One spelling per setting: the turn loop's limits and tools live in `rollout:` only; `eval:`
and `train:` carry a `rollout:` block of overrides whose null fields inherit. `Params` (in
`mempo.config.loading`) hands each stage section the `rollout:` it inherits from, so a stage
given only its own section (`run_eval(params.eval, ...)`) still sees the shared values.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, create_model
from pydantic.fields import FieldInfo

from mempo.config.base import Section


class RolloutParams(Section):
    """The agent's turn loop and tools (mempo.agent): training rollouts, SFT teacher runs,
    evaluation and the verl agent loop (each stage may override fields, see `resolve_rollout`)."""

    context: Literal["memory", "full"] = "memory"
    max_turns: int = Field(24, ge=1)
    turns_per_objective: int = Field(6, ge=0)
    max_prompt_tokens: int = Field(0, ge=0)
    max_concurrent_episodes: int = Field(64, ge=1)
    topk: int = Field(3, ge=1)
    observation_max_tokens: int = Field(512, ge=1)
    access_chunk_chars: int = Field(1000, ge=1)
    short_text_chars: int = Field(100, ge=0)
    max_new_tokens: int = Field(512, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    repeat_temperature: float = Field(0.0, ge=0.0)
    check_masks: bool = True
    decoder: Literal["fast", "hf"] = "fast"
    prefix_cache_mb: int = Field(256, ge=0)


def _overrides_model(name: str, doc: str, **defaults: Any) -> type[Section]:
    """A section with every `RolloutParams` field, nullable (null = inherit), with the same
    constraints; `defaults` are the stage's own values (a partial block keeps the others)."""
    fields: dict[str, Any] = {}
    for field_name, info in RolloutParams.model_fields.items():
        fields[field_name] = (info.annotation | None,
                              FieldInfo.merge_field_infos(info, default=defaults.pop(field_name, None)))
    if defaults:
        raise TypeError(f"not rollout fields: {sorted(defaults)}")
    return create_model(name, __base__=Section, __doc__=doc, **fields)


# Evaluation: greedy, short tool results and turns, a bounded context, 32 episodes in flight.
EvalRollout = _overrides_model(
    "EvalRollout", "`eval.rollout`: where evaluation episodes differ from `rollout:`.",
    max_concurrent_episodes=32, max_prompt_tokens=4096, observation_max_tokens=256, max_new_tokens=192,
    temperature=0.0, repeat_temperature=1.0)
# Training: shorter turns than `rollout.max_new_tokens` (the teacher's k=4 turns reach 168).
TrainRollout = _overrides_model(
    "TrainRollout", "`train.rollout`: where the local trainer's episodes differ from `rollout:`.",
    max_new_tokens=192)


def resolve_rollout(base: RolloutParams, overrides: BaseModel | None) -> RolloutParams:
    """`base` with the non-null fields of `overrides` (a stage's `rollout:` block)."""
    if overrides is None:
        return base
    update = {k: v for k, v in overrides.model_dump().items() if v is not None}
    return RolloutParams(**{**base.model_dump(), **update})


class _InheritsRollout(Section):
    """A stage section with a `rollout:` override block; `Params` sets the base it inherits
    (a section built on its own inherits the `RolloutParams` defaults)."""

    _base: RolloutParams = PrivateAttr(default_factory=RolloutParams)

    def inherit_rollout(self, base: RolloutParams) -> None:
        """Set the `rollout:` section this stage's overrides apply to."""
        self._base = base

    def rollout_params(self) -> RolloutParams:
        """This stage's episode settings: `rollout:` with the section's `rollout` overrides."""
        return resolve_rollout(self._base, getattr(self, "rollout", None))


class MempoParams(Section):
    """MemPO's rewards and advantages (mempo.rewards, mempo.advantage), lambda_mem included."""

    lambda_mem: float = Field(0.5, ge=0.0)
    eps: Literal["previous", "full_context", "none"] = "full_context"
    form: Literal["prob", "logprob"] = "logprob"
    norm_by_std: bool = True
    mem_adv_group: Literal["per_turn", "per_group"] = "per_turn"
    adv_eps: float = Field(1e-6, gt=0.0)
    mem_adv_min_std: float = Field(0.01, ge=0.0)
    final_memory: Literal["score", "skip", "closing"] = "score"
    rm_max: float | None = None
    format_rule: Literal["strict", "penalty", "ignore"] = "strict"
    format_penalty: float = Field(0.0, ge=0.0)
    no_answer_penalty: float = Field(0.0, ge=0.0)
    multi_rule: Literal["all", "mean", "mean_k", "any"] = "all"
    probe_batch_size: int = Field(16, ge=1)


class EvalParams(_InheritsRollout):
    """`mempo eval` / `mempo ask`: agents x benchmarks on one model; greedy unless
    `eval.rollout.temperature` > 0.

    `rollout:` holds only where evaluation episodes differ from the `rollout:` section
    (null = inherit); `rollout_params()` is what the agents run with.
    """

    model: str = "outputs/train/model"  # HF folder, or models:/NAME@alias | models:/NAME/VERSION
    # agent -> its own trained policy (e.g. full_context: the full-history baseline); others run `model`
    models: dict[Literal["memory", "full_context", "external_memory", "rag", "direct"], str] = Field(
        default_factory=dict)
    benchmarks: list[str] = Field(
        default_factory=lambda: ["world", "world-k2", "world-k4", "world-k8"],
        min_length=1,
    )
    agents: list[Literal["memory", "full_context", "external_memory", "rag", "direct"]] = Field(
        default_factory=lambda: ["memory", "full_context", "external_memory", "rag", "direct"],
        min_length=1,
    )
    limit: int | None = Field(32, ge=1)
    out: str = "outputs/eval"
    seed: int = 0
    retriever: str = "outputs/index"
    backend: Literal["hf", "openai"] = "hf"
    openai_url: str = "http://127.0.0.1:30000"
    served_model: str = "policy"
    device: str = "cpu"
    threads: int = Field(1, ge=0)  # torch CPU threads (0 = torch default), as sft.threads / train.threads
    # processes that run (benchmark, agent) pairs side by side, each with `threads` torch threads and
    # its own copy of the model(s) and retriever; 1 = in this process
    workers: int = Field(1, ge=1)
    memory_probe: bool = True
    external_memory_encoder: str = "hashing"
    external_memory_snippets: int = Field(3, ge=1)
    mlflow_genai_samples: int = Field(20, ge=0)
    rollout: EvalRollout = Field(default_factory=EvalRollout)


class SFTParams(Section):
    """`mempo train sft`: the cold start on correct memory-format trajectories."""

    policy: str = "outputs/policy"
    out: str = "outputs/sft"
    world: str = "data/world"
    retriever: str = "outputs/index"
    trajectories: str = ""
    val_trajectories: str = ""
    teacher_out: str = "outputs/teacher"
    part: str = "sft"
    max_questions: int | None = Field(2000, ge=1)
    multi_k: list[int] = Field(default_factory=lambda: [2, 3, 4])
    multi_tasks: int = Field(600, ge=0)
    rename_entities: float = Field(1.0, ge=0.0, le=1.0)
    memory_layout: Literal["now", "queue"] = "now"
    prompt_loss_weight: float = Field(0.0, ge=0.0)
    val_questions: int = Field(100, ge=1)
    val_multi_k: list[int] = Field(default_factory=list)
    val_multi_tasks: int = Field(0, ge=0)
    epochs: float = Field(1.0, gt=0.0)
    max_steps: int = Field(0, ge=0)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(3e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(20, ge=0)
    grad_clip: float = Field(1.0, gt=0.0)
    max_tokens: int = Field(1024, ge=16)
    eval_every: int = Field(50, ge=1)
    checkpoint_every: int = Field(100, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    resume: str = "auto"
    seed: int = 0
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int = Field(1, ge=0)


class TrainParams(_InheritsRollout):
    """`mempo train grpo`: the local GRPO + memory-advantage trainer.

    `rollout:` holds only where training episodes differ from the `rollout:` section
    (null = inherit); `rollout_params()` is what the trainer rolls out with.
    """

    policy: str = "outputs/sft/model"
    out: str = "outputs/train"
    data: str = "data/prepared"
    retriever: str = "outputs/index"
    steps: int = Field(20, ge=1)
    batch_questions: int = Field(8, ge=1)
    n_rollouts: int = Field(4, ge=1)
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(0, ge=0)
    grad_clip: float = Field(1.0, gt=0.0)
    clip_ratio_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_ratio_high: float = Field(0.2, ge=0.0)
    kl_coef: float = Field(0.001, ge=0.0)
    update_epochs: int = Field(1, ge=1)
    num_minibatches: int = Field(1, ge=1)
    micro_batch_size: int = Field(32, ge=1)
    token_budget: int = Field(16384, ge=64)
    generation_batch_size: int = Field(64, ge=1)
    log_memory_reward: bool = True
    val_every: int = Field(0, ge=0)
    val_questions: int = Field(64, ge=1)
    checkpoint_every: int = Field(5, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    resume: str = "auto"
    seed: int = 0
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int = Field(1, ge=0)
    rollout: TrainRollout = Field(default_factory=TrainRollout)


class VerlParams(Section):
    """`mempo train verl`: MemPO on verl 0.9.1 (Ray + GPUs, SGLang rollouts); see configs/verl/."""

    policy: str = "outputs/sft/model"
    data: str = "data/prepared"
    retriever: str = "http://127.0.0.1:8013"
    out: str = "outputs/train"
    config: str = "configs/verl/mempo_trainer.yaml"
    ray_address: str = ""
    nnodes: int = Field(1, ge=1)
    n_gpus_per_node: int = Field(8, ge=1)
    n_rollouts: int = Field(5, ge=1)
    train_batch_size: int = Field(256, ge=1)
    lr: float = Field(1e-6, gt=0.0)
    total_epochs: int = Field(1, ge=1)
    total_training_steps: int = Field(0, ge=0)
    lambda_mem: float | None = Field(None, ge=0.0)
    experiment_name: str = "mempo-verl"
    merge: bool = True
    overrides: list[str] = Field(default_factory=list)
    # PPO mini-batches: verl counts rows, and every TURN is a row here (one output per turn).
    ppo_mini_batch_prompts: int = Field(64, ge=1)
    turns_per_episode: float = Field(4.0, ge=1.0)
    # rollout health: abort the run when the retriever or the agent loop fails too often
    max_tool_failure_rate: float = Field(0.2, ge=0.0, le=1.0)
    max_failed_session_rate: float = Field(0.1, ge=0.0, le=1.0)
    min_health_samples: int = Field(32, ge=1)
    # memory probe on the rollout server: SGLang's chunked logits and a per-worker bound
    logprob_chunk_size: int = Field(2048, ge=0)
    probe_concurrency: int = Field(16, ge=1)
    # multi-node: a folder every node mounts (checkpoints, merged model); "" = refuse nnodes > 1
    shared_dir: str = ""
    preflight_timeout_s: float = Field(10.0, gt=0.0)
