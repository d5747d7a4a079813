"""Process-level training setup shared by SFT and GRPO: device, seeding, determinism, models.

    device = resolve_device("auto")          # "cuda" when available, else "cpu"
    seed_everything(0, deterministic=True)   # python, numpy, torch (+ cuda) seeded
    model, tok = load_policy("outputs/policy", device)

The device is a parameter everywhere (`--device cpu|cuda|auto`); nothing in the trainers
assumes CPU. Determinism is exact on CPU for a given seed and thread count; on CUDA the
deterministic algorithms are requested but kernels may still differ across GPUs.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

from mempo.errors import ConfigError

log = logging.getLogger(__name__)


def resolve_device(device: str) -> Any:
    """`torch.device` for "cpu", "cuda", "cuda:N" or "auto" (cuda when available)."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device '{device}' requested but CUDA is not available", field="device")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"unknown device '{device}': {e}", field="device") from e


def set_cpu_threads(threads: int | None) -> None:
    """torch's intra-op CPU threads (None/0 keeps the default). The stages use 1 for the tiny
    policy: measured faster on 2 cores (eval rollouts 1.4-1.6x, docs/results.md). Likely why:
    rollouts generate in worker threads, each thread that runs a multi-threaded op gets its own
    OpenMP team, and once those outnumber the cores libgomp stops spinning between ops (the
    retrieval service's 2x slowdown, `mempo.retrieval.serving.open_in_search_thread`)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def die_with_parent(parent: int) -> None:
    """Process-pool initializer: on Linux the worker gets SIGTERM when `parent` (the pool's
    process, `os.getpid()` passed in initargs) ends, however it ends, SIGKILL included, so a
    stopped study or evaluation leaves no worker running on. Elsewhere it does nothing."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent ended before the call
            os.kill(os.getpid(), signal.SIGTERM)


def seed_everything(seed: int, deterministic: bool = True, threads: int | None = None) -> None:
    """Seed python, numpy and torch; optionally force deterministic kernels.

    Args:
        seed: the run's seed.
        deterministic: `torch.use_deterministic_algorithms` (warn-only, so an op without a
            deterministic kernel on some GPU warns instead of failing the run).
        threads: torch intra-op threads (None keeps the default). Results on CPU are
            bit-identical only for the same thread count.
    """
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    set_cpu_threads(threads)
    if deterministic:
        # cuBLAS needs this for deterministic matmuls; harmless on CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def load_policy(path: str | Path, device: Any, dtype: str = "float32") -> tuple[Any, Any]:
    """Load an HF causal LM and its tokenizer (left padding, pad token set) onto `device`.

    `path` may be a policy folder written by `mempo policy bootstrap` (including a `base`
    record pointing at a model elsewhere). `dtype`: float32 | bfloat16 | float16.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from mempo.policy import resolve_policy_path

    folder = resolve_policy_path(path)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ConfigError(f"unknown dtype '{dtype}' (float32 | bfloat16 | float16)", field="dtype")
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype)
    model.to(device)
    return model, tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a policy folder (see `load_policy`) as the rollouts use it: left
    padding, pad token set. For what needs token counts but no model (the teacher)."""
    from transformers import AutoTokenizer

    from mempo.policy import resolve_policy_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_policy_path(path)))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def save_policy(model: Any, tokenizer: Any, out: str | Path, manifest: dict[str, Any] | None = None) -> Path:
    """Save model + tokenizer as an HF folder, atomically (the folder is replaced whole)."""
    from mempo.io import atomic_dir, write_json

    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if manifest is not None:
            write_json(tmp / "policy.json", manifest)
    return Path(out)
