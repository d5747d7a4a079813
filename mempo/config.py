"""Typed `params.yaml`: one section per stage, validated on load.

Unknown keys and wrong types are `ConfigError`s naming the dotted key. CLI flags override
params (each command passes its flags as overrides), and `mempo --set train.lambda_mem=0 ...`
overrides any key.

    params = load_params("params.yaml", overrides=["train.lambda_mem=0"])
    params.train.lambda_mem  # -> 0.0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mempo.errors import ConfigError

DEFAULT_PARAMS = Path("params.yaml")


class Section(BaseModel):
    """Base for every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class WorldParams(Section):
    """`mempo world generate`: the offline knowledge world."""

    seed: int = 13
    size: Literal["tiny", "small", "medium"] = "small"
    out: str = "data/world"


class PolicyParams(Section):
    """`mempo policy bootstrap`: the policy the trainers start from."""

    kind: Literal["tiny", "smollm2", "base"] = "tiny"
    out: str = "outputs/policy"
    corpus: str = "data/world/corpus.jsonl"
    questions: list[str] = Field(default_factory=lambda: ["data/world/qa/train.jsonl"])
    base_model: str = ""
    vocab_size: int = Field(1536, ge=300)
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    max_positions: int = Field(2048, ge=64)
    max_token_chars: int = Field(0, ge=0)
    copy_steps: int = Field(800, ge=0)
    copy_lr: float = Field(1e-3, gt=0)
    copy_batch: int = Field(32, ge=1)
    seed: int = 0


class DataSource(Section):
    """One FlashRAG QA file that feeds a split of the prepared data."""

    name: str = Field(min_length=1)  # the parquet `data_source` (world, nq, hotpotqa, ...)
    path: str = Field(min_length=1)
    split: Literal["train", "val"]


class Composition(Section):
    """One multi-objective mix: `share` of each source's questions composed `k` at a time."""

    k: int = Field(1, ge=1, le=16)
    share: float = Field(1.0, gt=0.0, le=1.0)


def _default_sources() -> list[DataSource]:
    return [
        DataSource(name="world", path="data/world/qa/train.jsonl", split="train"),
        DataSource(name="world", path="data/world/qa/val.jsonl", split="val"),
    ]


class DataParams(Section):
    """`mempo data prepare`: QA sets -> verl-schema train/val parquet."""

    sources: list[DataSource] = Field(default_factory=_default_sources, min_length=1)
    compositions: list[Composition] = Field(
        default_factory=lambda: [Composition(k=1, share=1.0), Composition(k=2, share=0.5)],
        min_length=1,
    )
    train_parts: list[str] | None = None
    dedup: bool = True
    seed: int = 0
    leakage: Literal["drop", "fail"] = "drop"
    eval_sets: list[str] = Field(default_factory=lambda: ["data/world/qa/test.jsonl"])
    ability: str = "fact-reasoning"
    gate: bool = True
    out: str = "data/prepared"


class ValidateBounds(Section):
    """Limits the data contracts enforce (characters unless named otherwise)."""

    max_line_bytes: int = Field(1 << 20, ge=1)
    corpus_min_chars: int = Field(3, ge=1)
    corpus_max_chars: int = Field(20_000, ge=1)
    question_max_chars: int = Field(2_000, ge=1)
    answer_max_chars: int = Field(500, ge=1)
    max_answers: int = Field(100, ge=1)
    prompt_max_chars: int = Field(40_000, ge=1)
    eval_rate_metrics: list[str] = Field(
        default_factory=lambda: ["em", "f1", "substring_em", "format_valid", "all_correct",
                                 "objective_em", "truncated", "hit_turn_limit", "memory_probe"])
    eval_count_metrics: list[str] = Field(
        default_factory=lambda: ["turns", "searches", "peak_prompt_tokens", "total_prompt_tokens",
                                 "generated_tokens", "latency_s", "n"])
    eval_key_columns: list[str] = Field(default_factory=lambda: ["agent", "benchmark", "id"])


class ValidateParams(Section):
    """`mempo validate`: Great Expectations data contracts (corpus, qa, prepared, eval)."""

    out: str = "outputs/validation"
    chunk_rows: int = Field(100_000, ge=1)
    sample_rows: int = Field(20, ge=1)
    bounds: ValidateBounds = Field(default_factory=ValidateBounds)


class RegisterParams(Section):
    """`mempo register`: the trained policy as an MLflow model version with its evidence."""

    model_name: str = Field("mempo-agent", min_length=1)
    model_dir: str = "outputs/train/model"
    metrics: str = "outputs/eval/metrics.json"
    train_metrics: str = ""   # "" = metrics.json beside model_dir (the train stage's own)
    headline: str = ""        # "" = <out>/headline.json
    # Inputs whose versions (DVC md5 or sha256) become `data.<name>.*` version tags.
    data: dict[str, str] = Field(
        default_factory=lambda: {"world": "data/world", "train_data": "data/prepared"}
    )
    out: str = "outputs/register"


class PromoteParams(Section):
    """`mempo promote`: the gate `@challenger` must pass to become `@champion`."""

    primary_metric: str = "memory/world/em"
    min_gain: float = 0.0
    tolerance: float = Field(0.02, ge=0.0)
    guard_metrics: list[str] = Field(default_factory=lambda: ["memory/*/em", "memory/*/f1"])
    lower_is_better: list[str] = Field(
        default_factory=lambda: ["*tokens*", "*latency*", "*turns*", "*searches*"]
    )
    required_benchmarks: list[str] = Field(default_factory=lambda: ["world"])
    benchmark_metric: str = "memory/{benchmark}/em"
    floors: dict[str, float] = Field(default_factory=dict)
    min_eval_n: int = Field(1, ge=1)
    same_eval_set: bool = True
    lock_wait_s: float = Field(120.0, gt=0.0)
    out: str = "outputs/promote"


class BenchmarksParams(Section):
    """`benchmarks:` name -> FlashRAG jsonl path read by `mempo eval` (null = not available here).

    The standard seven are listed with null paths (nothing is bundled offline); requesting
    one without a path is an error. `world` also feeds `world-k{1,2,4,8,16}` (composed).
    Any other `name: path` adds a custom benchmark.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    world: str | None = "data/world/qa/test.jsonl"
    nq: str | None = None
    triviaqa: str | None = None
    popqa: str | None = None
    hotpotqa: str | None = None
    twowiki: str | None = Field(None, alias="2wiki")
    musique: str | None = None
    bamboogle: str | None = None

    def paths(self) -> dict[str, str | None]:
        """name -> path for every benchmark, custom ones included (`2wiki` under its real name)."""
        out = {k: v for k, v in self.model_dump(by_alias=True).items()}
        for name, value in out.items():
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"must be a path string or null, got {value!r}", field=f"benchmarks.{name}")
        return out


class EvalParams(Section):
    """`mempo eval` / `mempo ask`: agents x benchmarks on one model; greedy unless temperature > 0."""

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
    concurrency: int = Field(32, ge=1)
    max_prompt_tokens: int = Field(4096, ge=16)
    seed: int = 0
    retriever: str = "outputs/index"
    backend: Literal["hf", "openai"] = "hf"
    openai_url: str = "http://127.0.0.1:30000"
    served_model: str = "policy"
    device: str = "cpu"
    max_turns: int = Field(6, ge=1)
    max_turns_cap: int = Field(64, ge=1)
    topk: int = Field(3, ge=1)
    max_new_tokens: int = Field(192, ge=1)
    max_obs_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    memory_probe: bool = True
    external_memory_encoder: str = "hashing"
    external_memory_snippets: int = Field(3, ge=1)
    mlflow_genai_samples: int = Field(20, ge=0)


class AgentParams(Section):
    """The agent's turn loop and tools (mempo.agent): rollouts in training, SFT teacher runs."""

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
    check_masks: bool = True
    decoder: Literal["fast", "hf"] = "fast"


class MempoParams(Section):
    """MemPO's rewards and advantages (mempo.rewards, mempo.advantage); lambda_mem is in train."""

    eps: Literal["previous", "full_context", "none"] = "full_context"
    form: Literal["prob", "logprob"] = "logprob"
    norm_by_std: bool = True
    mem_adv_group: Literal["per_turn", "per_group"] = "per_turn"
    adv_eps: float = Field(1e-6, gt=0.0)
    mem_adv_min_std: float = Field(0.01, ge=0.0)
    format_rule: Literal["strict", "penalty", "ignore"] = "strict"
    format_penalty: float = Field(0.0, ge=0.0)
    multi_rule: Literal["all", "mean", "any"] = "all"
    probe_batch_size: int = Field(16, ge=1)


class SFTParams(Section):
    """`mempo train sft`: the cold start on correct memory-format trajectories."""

    policy: str = "outputs/policy"
    out: str = "outputs/sft"
    world: str = "data/world"
    retriever: str = "outputs/index"
    trajectories: str = ""
    val_trajectories: str = ""
    part: str = "sft"
    max_questions: int | None = Field(2000, ge=1)
    multi_k: list[int] = Field(default_factory=lambda: [2, 3, 4])
    multi_tasks: int = Field(600, ge=0)
    rename_entities: float = Field(1.0, ge=0.0, le=1.0)
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


class PipelineParams(Section):
    """`mempo pipeline run` (`make run`): the local orchestration around `dvc repro`."""

    experiment: str = "mempo"
    serve_retriever: bool = True
    retriever_stages: list[str] = Field(default_factory=lambda: ["sft", "train", "train_full", "eval"])
    index_stage: str = "index"
    index_dir: str = "outputs/index"
    retriever_host: str = "127.0.0.1"
    retriever_start_timeout_s: float = Field(300.0, gt=0.0)
    promote: bool = True
    push: bool = True


class IndexParams(Section):
    """`mempo index build`: the retrieval index (mempo.retrieval.index)."""

    corpus: str = "data/world/corpus.jsonl"
    out: str = "outputs/index"
    method: Literal["bm25", "dense"] = "bm25"
    encoder: str = "all-MiniLM-L6-v2"
    index_type: Literal["flat", "hnsw", "ivfpq"] = "flat"
    hnsw_m: int = Field(32, ge=2)
    hnsw_ef_construction: int = Field(200, ge=1)
    hnsw_ef_search: int = Field(128, ge=1)
    ivf_nlist: int = Field(1024, ge=1)
    ivf_nprobe: int = Field(32, ge=1)
    pq_m: int = Field(48, ge=1)
    pq_nbits: int = Field(8, ge=1, le=16)
    pq_rerank: int = Field(0, ge=0)
    bm25_k1: float = Field(1.5, gt=0.0)
    bm25_b: float = Field(0.75, ge=0.0, le=1.0)
    batch_size: int = Field(64, ge=1)
    shard_size: int = Field(10_000, ge=1)
    device: str = "cpu"
    faiss_gpu: bool = False
    ray: bool = False
    ray_actors: int = Field(1, ge=1)
    ray_address: str = ""


class ServiceLimitParams(Section):
    """Request limits and scheduling knobs of the retrieval service (the part of `serve:` that
    `mempo.retrieval.contract.ServiceLimits` extends with the runtime-only bearer token)."""

    batching: bool = True
    batch_window_ms: float = Field(0.0, ge=0.0)
    max_batch_queries: int = Field(128, ge=1)
    workers: int = Field(1, ge=1)
    max_queue_queries: int = Field(1024, ge=1)
    request_timeout_s: float = Field(10.0, gt=0.0)
    ready_queue_fraction: float = Field(0.5, gt=0.0, le=1.0)
    max_connections: int = Field(1024, ge=1)
    max_queries_per_request: int = Field(256, ge=1)
    max_query_chars: int = Field(2048, ge=1)
    max_topk: int = Field(50, ge=1)
    default_topk: int = Field(3, ge=1)
    max_body_bytes: int = Field(1_000_000, ge=64)
    max_access_items: int = Field(64, ge=1)
    max_access_passages: int = Field(1024, ge=1)
    max_access_in_flight: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _queue_holds_a_request(self) -> ServiceLimitParams:
        if self.max_queue_queries < self.max_queries_per_request:
            raise ValueError(f"max_queue_queries ({self.max_queue_queries}) must be >= "
                             f"max_queries_per_request ({self.max_queries_per_request}): a full-size "
                             "request could never be queued")
        return self


class ServeParams(ServiceLimitParams):
    """`mempo serve retriever`: the retrieval service (mempo.retrieval.server)."""

    index: str = "outputs/index"
    host: str = "127.0.0.1"
    port: int = Field(8013, ge=0, le=65535)
    encoder: str = ""
    device: str = "cpu"
    encoder_backend: Literal["torch", "torch-int8", "onnx", "onnx-int8"] = "torch"
    encoder_threads: int = Field(0, ge=0)
    graceful_timeout_s: float = Field(30.0, ge=0.0)

    def limits(self) -> ServiceLimitParams:
        """Only the limit and scheduling fields."""
        return ServiceLimitParams(**{k: getattr(self, k) for k in ServiceLimitParams.model_fields})


class CorpusParams(Section):
    """`mempo corpus wiki-sample`: real Wikipedia lead summaries in the wiki-18 format."""

    wiki_out: str = "data/corpora/wiki_sample/corpus.jsonl"
    wiki_lang: Literal["en-us", "es-es", "fr-fr"] = "en-us"
    words_per_passage: int = Field(100, ge=0)


class TrainParams(Section):
    """`mempo train grpo`: the local GRPO + memory-advantage trainer."""

    policy: str = "outputs/sft/model"
    out: str = "outputs/train"
    data: str = "data/prepared"
    retriever: str = "outputs/index"
    steps: int = Field(20, ge=1)
    batch_questions: int = Field(8, ge=1)
    n_rollouts: int = Field(4, ge=1)
    lambda_mem: float = Field(1.0, ge=0.0)
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
    max_new_tokens: int = Field(192, ge=0)
    max_turns: int = Field(0, ge=0)
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


class ClusterParams(Section):
    """`mempo train rayjob`: the cluster train step, a KubeRay RayJob running `mempo train verl`."""

    namespace: str = "mempo"
    image: str = "ghcr.io/mempo/mempo-train:0.1.0"
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    ray_version: str = "2.60.0"
    image_workdir: str = "/app"
    nnodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    cpus_per_node: str = "64"
    memory_per_node: str = "512Gi"
    shm_size: str = "64Gi"
    head_cpus: str = "8"
    head_memory: str = "32Gi"
    gpu_resource: str = "nvidia.com/gpu"
    node_selector: dict[str, str] = Field(default_factory=lambda: {"nvidia.com/gpu.present": "true"})
    service_account: str = ""
    shared_claim: str = "mempo-runs"
    shared_mount: str = "/mnt/mempo"
    mlflow_secret: str = "mempo-mlflow"
    mlflow_secret_key: str = "MLFLOW_TRACKING_URI"
    retriever_secret: str = "mempo-retriever"
    retriever_secret_key: str = "MEMPO_RETRIEVER_TOKEN"
    queue: str = ""
    active_deadline_s: int = Field(172800, ge=60)
    ttl_after_finished_s: int = Field(3600, ge=0)
    backoff_limit: int = Field(1, ge=0)
    poll_s: float = Field(30.0, gt=0.0)


class Params(Section):
    """All of params.yaml. Sections are added by the stages that read them."""

    world: WorldParams = Field(default_factory=WorldParams)
    index: IndexParams = Field(default_factory=IndexParams)
    serve: ServeParams = Field(default_factory=ServeParams)
    corpus: CorpusParams = Field(default_factory=CorpusParams)
    agent: AgentParams = Field(default_factory=AgentParams)
    mempo: MempoParams = Field(default_factory=MempoParams)
    eval: EvalParams = Field(default_factory=EvalParams)
    benchmarks: BenchmarksParams = Field(default_factory=BenchmarksParams)
    policy: PolicyParams = Field(default_factory=PolicyParams)
    sft: SFTParams = Field(default_factory=SFTParams)
    train: TrainParams = Field(default_factory=TrainParams)
    data: DataParams = Field(default_factory=DataParams)
    # `validate` would shadow pydantic's BaseModel.validate; params.yaml still says `validate:`.
    validation: ValidateParams = Field(default_factory=ValidateParams, alias="validate")
    # `register` would shadow ABCMeta.register; params.yaml still says `register:`.
    registration: RegisterParams = Field(default_factory=RegisterParams, alias="register")
    promote: PromoteParams = Field(default_factory=PromoteParams)
    pipeline: PipelineParams = Field(default_factory=PipelineParams)
    verl: VerlParams = Field(default_factory=VerlParams)
    cluster: ClusterParams = Field(default_factory=ClusterParams)


def _loc(err: dict[str, Any]) -> str:
    return ".".join(str(p) for p in err["loc"])


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    cur = data
    for p in parts[:-1]:
        nxt = cur.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set '{key}': '{p}' is not a section", field=key)
        cur = nxt
    cur[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse `a.b.c=value` (the value as YAML: `0`, `true`, `[1, 2]`, `'text'`)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override value is not valid YAML: {e}", field=key) from e
    return key, value


def load_params(
    path: str | Path | None = DEFAULT_PARAMS,
    overrides: list[str] | dict[str, Any] | None = None,
) -> Params:
    """Load and validate params.yaml (defaults when `path` is None or missing).

    `overrides` is a list of `key=value` strings or a dict of dotted keys to values;
    `None` values in a dict are ignored (an unset CLI flag).
    """
    data: dict[str, Any] = {}
    if path is not None and Path(path).exists():
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ConfigError(f"not valid YAML: {e}", path=path) from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError("top level must be a mapping of sections", path=path)
        data = loaded
    items = overrides.items() if isinstance(overrides, dict) else (
        parse_override(o) for o in (overrides or [])
    )
    for key, value in items:
        if value is not None:
            _set_dotted(data, key, value)
    try:
        return Params.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        msg = first["msg"]
        if first["type"] == "extra_forbidden":
            msg = "unknown key (typo? see params.yaml for the valid keys)"
        raise ConfigError(
            f"{msg}" + (f" (got {first.get('input')!r})" if first["type"] != "extra_forbidden" else ""),
            path=path, field=_loc(first),
        ) from e


def params_flat(params: Params) -> dict[str, Any]:
    """Params as `{"section.key": value}` (for MLflow params and tags)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = obj

    walk("", params.model_dump(mode="json"))
    return out
