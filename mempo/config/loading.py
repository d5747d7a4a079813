"""Loading `params.yaml`: the `Params` model of the whole file, `key=value` overrides, the
errors for moved keys, and the flat view MLflow logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from mempo.config.base import Section
from mempo.config.episodes import (
    EvalParams,
    MempoParams,
    RolloutParams,
    SFTParams,
    TrainParams,
    VerlParams,
)
from mempo.config.stages import (
    BenchmarksParams,
    ClusterParams,
    CorpusParams,
    DataParams,
    IndexParams,
    PipelineParams,
    PolicyParams,
    PromoteParams,
    RegisterParams,
    ServeParams,
    ValidateParams,
    WorldParams,
)
from mempo.errors import ConfigError
from mempo.io import flatten

DEFAULT_PARAMS = Path("params.yaml")


class Params(Section):
    """All of params.yaml. Sections are added by the stages that read them."""

    world: WorldParams = Field(default_factory=WorldParams)
    index: IndexParams = Field(default_factory=IndexParams)
    serve: ServeParams = Field(default_factory=ServeParams)
    corpus: CorpusParams = Field(default_factory=CorpusParams)
    rollout: RolloutParams = Field(default_factory=RolloutParams)
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

    @model_validator(mode="after")
    def _stages_inherit_rollout(self) -> Params:
        # train: and eval: override `rollout:` field by field; give them the section to inherit
        self.train.inherit_rollout(self.rollout)
        self.eval.inherit_rollout(self.rollout)
        return self



# Keys that moved (issue 16: one spelling per setting). Each is an error that names the new
# spelling, never a silent alias: a params file keeps meaning one thing.
RENAMED: dict[str, str] = {
    "agent": "rollout",
    "train.lambda_mem": "mempo.lambda_mem",
    "train.max_turns": "train.rollout.max_turns (null = rollout.max_turns)",
    "train.max_new_tokens": "train.rollout.max_new_tokens (null = rollout.max_new_tokens)",
    "eval.max_turns": "eval.rollout.turns_per_objective",
    "eval.max_turns_cap": "eval.rollout.max_turns",
    "eval.max_obs_tokens": "eval.rollout.observation_max_tokens",
    "eval.topk": "eval.rollout.topk",
    "eval.max_new_tokens": "eval.rollout.max_new_tokens",
    "eval.temperature": "eval.rollout.temperature",
    "eval.max_prompt_tokens": "eval.rollout.max_prompt_tokens",
    "eval.concurrency": "eval.rollout.max_concurrent_episodes",
}


def _check_renamed(data: dict[str, Any], path: str | Path | None) -> None:
    """A `ConfigError` naming the old key and its new spelling, for the first moved key found."""
    for old, new in RENAMED.items():
        *parents, leaf = old.split(".")
        cur: Any = data
        for p in parents:
            cur = cur.get(p) if isinstance(cur, dict) else None
        if isinstance(cur, dict) and leaf in cur:
            what = "section" if "." not in old else "key"
            raise ConfigError(f"the {what} `{old}` was renamed: write `{new.split(' ')[0]}` instead"
                              + (f" {new.split(' ', 1)[1]}" if " " in new else ""), path=path, field=old)


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
    _check_renamed(data, path)
    items = overrides.items() if isinstance(overrides, dict) else (
        parse_override(o) for o in (overrides or [])
    )
    for key, value in items:
        if value is not None:
            _set_dotted(data, key, value)
    _check_renamed(data, None)
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
    return flatten(params.model_dump(mode="json"))


def profile_overrides(path: str | Path) -> dict[str, Any]:
    """A params profile (e.g. `params.tiny.yaml`: only the keys it changes, nested as in
    params.yaml) as dotted overrides, `{"world.size": "tiny", "promote.floors": {}, ...}`.

    It descends into sections (a stage's `rollout:` block included); a setting whose value is
    a mapping (`promote.floors`, `eval.models`) is one override, replaced whole. Validated on
    the defaults: unknown keys, wrong types and moved keys are `ConfigError`s naming the key.
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read the params profile: {e}", path=path) from e
    if not isinstance(data, dict):
        raise ConfigError("a params profile is a mapping of sections", path=path)
    _check_renamed(data, path)
    out: dict[str, Any] = {}

    def walk(node: dict[str, Any], model: type[BaseModel], prefix: str) -> None:
        by_name = {(f.alias or name): f for name, f in model.model_fields.items()}
        for key, value in node.items():
            ann = by_name[key].annotation if key in by_name else None
            if isinstance(value, dict) and isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(value, ann, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(data, Params, "")
    try:
        load_params(None, overrides=out)
    except ConfigError as e:
        raise ConfigError(e.message, path=path, field=e.field) from e
    return out
