"""Shared pieces of the verl plug-in tests (tests/test_verl_*_on_cpu.py).

- `tiny_policy`: the project's tiny tokenizer + randomly initialised Qwen2 policy, built
  once per session from the tiny knowledge world (~5 s).
- `ScriptedServer`: a stand-in for verl's `LLMServerClient` (the issue's "fake server
  manager"): generation replays scripted turn texts, and prompt-log-prob requests are
  answered by running a real transformers model, shaped by verl's own SGLang function.
- `compose_mempo_config`: the full Hydra config, composed exactly as `main_ppo` does.
- `make_mem_agent_loop`: `mem_agent` built the way verl's AgentLoopWorker builds it, with the
  real retrieval BaseTool over the tiny world.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs" / "verl"


# Built once per session: pytest makes one fixture definition per importing module, so the
# folder is remembered here (tmp_path_factory folders live for the whole session).
_BUILT_POLICIES: dict[str, Path] = {}


@pytest.fixture(scope="session")
def tiny_policy(tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny policy (tokenizer with the turn tags + random 2x128 Qwen2)."""
    from mempo.policy.tiny import TinyPolicySpec, bootstrap_tiny

    key = str(tiny_world)
    if key not in _BUILT_POLICIES:
        out = tmp_path_factory.mktemp("policy") / "tiny"
        bootstrap_tiny(out, tiny_world / "corpus.jsonl", [tiny_world / "qa" / "train.jsonl"],
                       spec=TinyPolicySpec(copy_steps=0))
        _BUILT_POLICIES[key] = out
    return _BUILT_POLICIES[key]


def load_sglang_prompt_logprob_shaper() -> Callable[..., None]:
    """verl's `_extract_prompt_logprobs_sglang`, loaded from verl's source without importing
    sglang (its module imports sglang at the top, which is not installed on CPU machines).

    Using verl's real function keeps the fake server honest about verl's row layout.
    """
    import verl.workers.rollout as rollout_pkg

    path = Path(rollout_pkg.__file__).parent / "sglang_rollout" / "async_sglang_server.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_extract_prompt_logprobs_sglang")
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace["_extract_prompt_logprobs_sglang"]


class ScriptedServer:
    """Async stand-in for verl's LLMServerClient.

    `generate(...)` without `prompt_logprobs` returns the next scripted response (token ids
    of the text, plus `trailing` junk to test stop-string cutting). With `prompt_logprobs`
    it runs `model` over the ids and returns SGLang-style input log-probs shaped by verl.
    """

    def __init__(self, tokenizer: Any, responses: Sequence[str], model: Any | None = None,
                 trailing: str = "") -> None:
        self.tokenizer = tokenizer
        self.responses = list(responses)
        self.model = model
        self.trailing = trailing
        self.calls: list[dict[str, Any]] = []
        self.probe_calls: list[list[int]] = []
        self._shape = load_sglang_prompt_logprob_shaper()

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        if "prompt_logprobs" in sampling_params:
            self.probe_calls.append(list(prompt_ids))
            return TokenOutput(token_ids=[0], log_probs=[0.0], extra_fields=self.prompt_logprobs(prompt_ids))
        self.calls.append({"prompt_ids": list(prompt_ids), "sampling_params": dict(sampling_params)})
        text = self.responses.pop(0)
        ids = self.tokenizer.encode(text + self.trailing, add_special_tokens=False)
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), extra_fields={"global_steps": 3})

    def prompt_logprobs(self, ids: list[int]) -> dict[str, Any]:
        """SGLang's meta_info for `logprob_start_len=0`, shaped into verl's contract."""
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
        logp = logits.log_softmax(-1)
        # SGLang: entry k = (logprob of token k given tokens < k, token id, text); entry 0 has None.
        entries = [(None, ids[0], None)] + [(float(logp[k - 1, ids[k]]), ids[k], None) for k in range(1, len(ids))]
        out: dict[str, Any] = {}
        self._shape(meta_info={"input_token_logprobs": entries}, num_prompt_logprobs=0,
                    sequence_length=len(ids), result_dict=out)
        return out


def compose_mempo_config(overrides: Sequence[str] = ()) -> Any:
    """The full verl config: our overlay over verl's `ppo_trainer` (pkg://verl.trainer.config)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("mempo_trainer", overrides=list(overrides))


def make_mem_agent_loop(tiny_policy: Path, world: Path, server: ScriptedServer, max_turns: int = 4,
                        extra_overrides: Sequence[str] = (), **mempo: Any) -> Any:
    """Build the agent loop the way verl's AgentLoopWorker does (hydra.instantiate on the registry)."""
    import hydra
    from verl.experimental.agent_loop.agent_loop import (
        DictConfigWrap,
        ToolListWrap,
        _agent_loop_registry,
    )
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from mempo.verl_plugin.tool import RetrievalTool

    overrides = [f"actor_rollout_ref.model.path={tiny_policy}", "data.train_files=x", "data.val_files=y",
                 f"mempo.max_turns={max_turns}", "mempo.max_new_tokens=64",
                 "data.max_prompt_length=1024", "data.max_response_length=96"]
    overrides += [f"mempo.{k}={v}" for k, v in mempo.items()]
    cfg = compose_mempo_config([*overrides, *extra_overrides])
    tool = RetrievalTool({"type": "native", "retriever": str(world / "corpus.jsonl"), "topk": 2,
                          "observation_max_tokens": 64})
    return hydra.utils.instantiate(
        config=_agent_loop_registry["mem_agent"],
        trainer_config=DictConfigWrap(config=cfg), server_manager=server, tokenizer=server.tokenizer,
        processor=None, hf_model_type="qwen2", dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([tool]),
    )


def subprocess_env() -> dict[str, str]:
    """Environment for fresh `python` subprocesses (offline, quiet, repo importable)."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VERL_USE_EXTERNAL_PLUGINS="auto", PYTHONWARNINGS="ignore")
    return env
