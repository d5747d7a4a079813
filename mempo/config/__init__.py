"""Typed `params.yaml`: one section per stage, validated on load.

Unknown keys and wrong types are `ConfigError`s naming the dotted key; a key that moved
(`agent:` -> `rollout:`, `train.lambda_mem` -> `mempo.lambda_mem`, ...; see `RENAMED`) is an
error naming its new spelling. CLI flags override params (each command passes its flags as
overrides), and `mempo --set mempo.lambda_mem=0 ...` overrides any key.

    params = load_params("params.yaml", overrides=["mempo.lambda_mem=0"])
    params.mempo.lambda_mem              # -> 0.0
    params.eval.rollout_params().max_turns   # `rollout:` with eval's overrides

The package: `base` (the Section base), `stages` (data, retrieval, registry, orchestration
sections), `episodes` (`rollout:`, `mempo:` and the stages that run episodes), `loading`
(the whole file, overrides, moved keys), `hydra` (the verl Hydra `mempo:` block).
"""

from mempo.config.base import Section
from mempo.config.episodes import (
    EvalParams,
    EvalRollout,
    MempoParams,
    RolloutParams,
    SFTParams,
    TrainParams,
    TrainRollout,
    VerlParams,
    resolve_rollout,
)
from mempo.config.loading import (
    DEFAULT_PARAMS,
    RENAMED,
    Params,
    _set_dotted,
    load_params,
    params_flat,
    parse_override,
    profile_overrides,
)
from mempo.config.stages import (
    BenchmarksParams,
    ClusterParams,
    Composition,
    CorpusParams,
    DataParams,
    DataSource,
    IndexParams,
    PipelineParams,
    PolicyParams,
    PromoteParams,
    RegisterParams,
    ServeParams,
    ServiceLimitParams,
    ValidateBounds,
    ValidateParams,
    WorldParams,
)

__all__ = [
    "DEFAULT_PARAMS", "RENAMED", "BenchmarksParams", "ClusterParams", "Composition", "CorpusParams",
    "DataParams", "DataSource", "EvalParams", "EvalRollout", "IndexParams", "MempoParams", "Params",
    "PipelineParams", "PolicyParams", "PromoteParams", "RegisterParams", "RolloutParams", "SFTParams",
    "Section", "ServeParams", "ServiceLimitParams", "TrainParams", "TrainRollout", "ValidateBounds",
    "ValidateParams", "VerlParams", "WorldParams", "_set_dotted", "load_params", "params_flat",
    "parse_override", "profile_overrides", "resolve_rollout",
]
