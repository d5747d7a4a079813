"""Turn `--model` into a local Hugging Face folder: a path, or an MLflow registry reference.

    with resolved_model("models:/mempo-policy@champion") as model:
        model.path       # a local folder with config.json (+ tokenizer files)
        model.version    # "3" (registry references only)

A registry reference (`models:/NAME@alias`, `models:/NAME/VERSION`) is downloaded with
MLflow's artifact API into a temporary folder that lives as long as the `with` block, so
the promotion gate evaluates exactly the bytes the registry holds. The model folder is
found inside the download (the folder holding `config.json`); a transformers-flavour model
keeps its tokenizer under `components/tokenizer`, which is used when the model folder has
no tokenizer of its own.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mempo.errors import ConfigError, MempoError

_REF = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class ResolvedModel:
    """A model ready to load.

    Attributes:
        ref: what the user passed (`models:/NAME@alias` or a path).
        path: local folder with `config.json` and the weights.
        tokenizer_path: local folder with the tokenizer files (often `path`).
        name / version / alias / run_id: registry facts, None for a plain path.
    """

    ref: str
    path: Path
    tokenizer_path: Path
    name: str | None = None
    version: str | None = None
    alias: str | None = None
    run_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict[str, str]:
        """Facts for the report header and MLflow tags (strings, no None)."""
        out = {"model": self.ref}
        if self.name:
            out.update(model_name=self.name, model_version=str(self.version))
        if self.run_id:
            out["model_source_run"] = self.run_id
        return out


def is_registry_ref(ref: str) -> bool:
    """True for `models:/NAME@alias` and `models:/NAME/VERSION`."""
    return str(ref).startswith("models:/")


def find_model_folder(root: str | Path) -> tuple[Path, Path]:
    """(model folder, tokenizer folder) inside `root`: the shallowest folder with config.json.

    Raises:
        MempoError: no config.json anywhere under `root`, or no tokenizer files.
    """
    root = Path(root)
    configs = sorted(root.rglob("config.json"), key=lambda p: (len(p.parts), str(p)))
    # generation_config.json etc. do not match; a tokenizer-only folder has no config.json.
    if not configs:
        raise MempoError(f"no Hugging Face model (config.json) found under {root}", path=root)
    model_dir = configs[0].parent
    candidates = [model_dir, root / "components" / "tokenizer", model_dir.parent / "components" / "tokenizer"]
    candidates += sorted({p.parent for name in _TOKENIZER_FILES for p in root.rglob(name)},
                         key=lambda p: (len(p.parts), str(p)))
    for cand in candidates:
        if any((cand / name).is_file() for name in _TOKENIZER_FILES):
            return model_dir, cand
    raise MempoError(f"model folder {model_dir} has no tokenizer files ({', '.join(_TOKENIZER_FILES)})", path=model_dir)


@contextlib.contextmanager
def resolved_model(ref: str, download_dir: str | Path | None = None) -> Iterator[ResolvedModel]:
    """Yield a `ResolvedModel` for a local path or a registry reference (see module doc).

    Args:
        ref: a local model folder, or `models:/NAME@alias` / `models:/NAME/VERSION`.
        download_dir: where to download a registry model (default: a temporary folder,
            deleted on exit).

    Raises:
        ConfigError: a malformed registry reference.
        MempoError: the path does not exist, the registry has no such model/alias/version,
            or the download holds no model folder.
    """
    ref = str(ref)
    if not is_registry_ref(ref):
        path = Path(ref)
        if not path.exists():
            raise MempoError("model folder not found (give a Hugging Face folder or models:/NAME@alias)", path=path)
        model_dir, tok_dir = find_model_folder(path)
        yield ResolvedModel(ref=ref, path=model_dir, tokenizer_path=tok_dir)
        return

    m = _REF.match(ref)
    if not m:
        raise ConfigError(f"'{ref}' is not a registry reference; use models:/NAME@alias or models:/NAME/VERSION",
                          field="eval.model")
    import mlflow

    from mempo.tracking import configure

    configure()
    client = mlflow.MlflowClient()
    name, alias, version = m.group("name"), m.group("alias"), m.group("version")
    try:
        mv = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    except mlflow.exceptions.MlflowException as e:
        what = f"alias '{alias}'" if alias else f"version {version}"
        raise MempoError(f"registry has no model '{name}' with {what} ({e.message.splitlines()[0]})") from e

    own_tmp = download_dir is None
    dst = Path(tempfile.mkdtemp(prefix="mempo-model-")) if own_tmp else Path(download_dir)
    dst.mkdir(parents=True, exist_ok=True)
    try:
        # Download the exact version the alias points at now (an alias may move mid-run).
        local = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{mv.version}", dst_path=str(dst))
        model_dir, tok_dir = find_model_folder(local)
        yield ResolvedModel(
            ref=ref, path=model_dir, tokenizer_path=tok_dir, name=name, version=str(mv.version),
            alias=alias, run_id=mv.run_id, tags=dict(mv.tags or {}),
        )
    finally:
        if own_tmp:
            shutil.rmtree(dst, ignore_errors=True)
