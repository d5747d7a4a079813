"""The sections of the data, retrieval, registry and orchestration stages (one model per
`params.yaml` section; the episode-running stages are in `mempo.config.episodes`)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from mempo.config.base import Section
from mempo.errors import ConfigError


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
                                 "generated_tokens", "repeated_turns", "latency_s", "n"])
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


class PipelineParams(Section):
    """`mempo pipeline run` (`make run`): the local orchestration around `dvc repro`."""

    experiment: str = "mempo"
    serve_retriever: bool = True
    retriever_stages: list[str] = Field(default_factory=lambda: ["teacher", "train", "train_full", "eval"])
    parallel_stages: list[list[str]] = Field(default_factory=list)
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
