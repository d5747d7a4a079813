"""`mem_agent`: MemPO's turn loop as a verl 0.9 agent loop (one AgentLoopOutput per turn).

Each turn the prompt is REBUILT from scratch by `mempo.agent.context.MemoryContext`: system
prompt + question + the `<mem>` of the previous turn + the previous action with its
(truncated) result. Nothing older. The model writes `<mem> ... </mem> <think> ... </think>`
and one action; `<search>` / `<access>` go to the retrieval `BaseTool`
(`mempo.verl_plugin.tool.RetrievalTool`), `<answer>` ends the episode, an invalid turn
gets the corrective observation. Because every turn has its own prompt, `run()` returns a
list with one `AgentLoopOutput` per turn (verl 0.9's multi-trajectory output); verl keys
them `{uid}_{session}_{turn}` and copies the final reward to every turn.

Each output's `extra_fields` holds what the `mempo_sync` trainer needs:
`mem_mask` (1 on the response tokens inside `<mem>`), `turn_index`, `memory` (the text),
`mem_prob` / `mem_logprob` (P(a* | q, mem_t), from the rollout server, see
`mempo.verl_plugin.memory_probe`) and, with eps=full_context, `full_prob` / `full_logprob`.
The last output also carries `mempo_turn_texts` (every turn's response text) so the reward
(`mempo.verl_plugin.reward.compute_score`) scores the format of the whole episode.

Selected per row by the parquet column `agent_name=mem_agent` (written by the data stage).
Settings come from the Hydra `mempo:` section (configs/verl/mempo_trainer.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopOutput,
    ToolListWrap,
    register,
)

from mempo.agent.context import FullContext, MemoryContext
from mempo.agent.format import (
    STOP_SEQUENCES,
    USER_QUESTION_TEMPLATE,
    ParsedTurn,
    invalid_turn_observation,
    parse_turn,
    render_prompt,
)
from mempo.agent.generation import cut_at_stop
from mempo.agent.masks import check_mem_mask, span_token_mask
from mempo.verl_plugin import AGENT_LOOP_NAME
from mempo.verl_plugin.memory_probe import (
    answer_probability_from_server,
    full_context_probe,
    memory_probe,
)
from mempo.verl_plugin.tool import TOOL_NAME, RetrievalTool

log = logging.getLogger(__name__)

# Per rollout backend: the sampling flag that keeps a matched stop string in the output.
KEEP_STOP_STRING: dict[str, dict[str, bool]] = {
    "sglang": {"no_stop_trim": True},
    "vllm": {"include_stop_str_in_output": True},
}


@dataclass(frozen=True)
class MemAgentSettings:
    """The agent loop's part of the Hydra `mempo:` section.

    Attributes:
        max_turns: turns before the episode is cut (the last turn's output is still kept).
        max_new_tokens: tokens generated per turn (also capped by rollout.response_length).
        lambda_mem: 0 skips the memory probes (no A^M is used then).
        eps: previous | full_context | none (full_context adds one probe per turn).
        check_masks: verify each `<mem>` token mask decodes to the memory text.
        probe_concurrency: memory-probe requests in flight per episode.
    """

    max_turns: int = 8
    max_new_tokens: int = 512
    lambda_mem: float = 1.0
    eps: str = "full_context"
    check_masks: bool = True
    probe_concurrency: int = 16

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any] | None) -> MemAgentSettings:
        if not section:
            return cls()
        names = {f.name for f in fields(cls)}
        return cls(**{k: section[k] for k in names if k in section})


def question_of(kwargs: Mapping[str, Any]) -> str:
    """The task's question: `extra_info.question` (data stage), else parsed from the prompt."""
    extra = kwargs.get("extra_info") or {}
    if isinstance(extra, Mapping) and extra.get("question"):
        return str(extra["question"])
    prefix = USER_QUESTION_TEMPLATE.split("{question}")[0]
    for message in reversed(list(kwargs.get("raw_prompt") or [])):
        content = str(message.get("content", ""))
        if message.get("role") == "user" and content.startswith(prefix):
            return content[len(prefix):].split("\n\n", 1)[0].strip()
    raise ValueError("mem_agent needs extra_info.question or a user message 'Question: ...'")


def gold_answer_of(kwargs: Mapping[str, Any]) -> str | None:
    """The gold answer scored by the memory probe (first of `reward_model.ground_truth`)."""
    reward_model = kwargs.get("reward_model") or {}
    truth: Any = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
    if isinstance(truth, Mapping):
        truth = truth.get("target", truth.get("golden_answers"))
    if truth is None:
        return None
    if isinstance(truth, str):
        return truth
    items = [str(t) for t in list(truth)]
    return items[0] if items else None


@register(AGENT_LOOP_NAME)
class MemAgentLoop(AgentLoopBase):
    """MemPO's memory-context agent (see module docstring)."""

    def __init__(self, *args: Any, tools: ToolListWrap | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = MemAgentSettings.from_mapping(self.config.get("mempo"))
        tool_list = tools.tools if tools else []
        self.tool = next((t for t in tool_list if isinstance(t, RetrievalTool)), None) or next(
            (t for t in tool_list if getattr(t, "name", None) == TOOL_NAME), None)
        if self.tool is not None and hasattr(self.tool, "bind_tokenizer"):
            self.tool.bind_tokenizer(self.tokenizer)
        self.response_length = int(self.rollout_config.response_length)

    async def _observe(self, instance_id: str | None, action: str, argument: str) -> tuple[str, str, dict]:
        if self.tool is None:
            raise RuntimeError(
                "mem_agent has no retrieval tool: set actor_rollout_ref.rollout.multi_turn.tool_config_path "
                "to configs/verl/retrieval_tool.yaml")
        resp, _, info = await self.tool.execute(instance_id, {"action": action, "query": argument})
        text = resp.text or ""
        return text, str(info.get("short_observation") or text), dict(info)

    def _encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of one turn's prompt (chat template, capped at rollout.prompt_length)."""
        text = render_prompt(self.tokenizer, messages)
        return self._cap_text_prompt_length(self.tokenizer.encode(text, add_special_tokens=False))

    def _digest_response(self, token_ids: list[int]) -> tuple[list[int], str, ParsedTurn, list[int]]:
        """Cut the generated ids after the first stop string, parse the turn, mask its `<mem>`.

        Returns (response ids, their text, the parsed turn, the mem mask over the ids).
        """
        response_ids, _, _ = cut_at_stop(token_ids, self.tokenizer, STOP_SEQUENCES)
        response_ids = response_ids[: self.response_length]
        if not response_ids:  # an empty generation still needs one token to train on
            response_ids = [self.tokenizer.eos_token_id or 0]
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        parsed = parse_turn(text)
        mem_mask = span_token_mask(response_ids, self.tokenizer, parsed.mem_span)
        if self.settings.check_masks and parsed.mem is not None:
            check_mem_mask(response_ids, self.tokenizer, mem_mask, parsed.mem)
        return response_ids, text, parsed, mem_mask

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> list[AgentLoopOutput]:
        """Play one episode; returns one AgentLoopOutput per turn (see module docstring)."""
        question = question_of(kwargs)
        answer = gold_answer_of(kwargs)
        memory_ctx = MemoryContext(question)
        full_ctx = FullContext(question) if self.settings.eps == "full_context" else None
        params = dict(sampling_params)
        params["max_tokens"] = min(self.settings.max_new_tokens, self.response_length)
        params["stop"] = list(STOP_SEQUENCES)
        # keep the stop string (the closing action tag) in the returned tokens: the turn is
        # trained on exactly what the policy generated, and the parser needs the closing tag
        params.update(KEEP_STOP_STRING.get(str(self.rollout_config.name), {}))
        request_id = uuid4().hex
        loop = asyncio.get_running_loop()

        outputs: list[AgentLoopOutput] = []
        memories: list[str | None] = []
        full_messages: list[list[dict[str, str]]] = []
        turn_texts: list[str] = []
        instance_id = None
        if self.tool is not None:
            instance_id, _ = await self.tool.create()
        try:
            for turn in range(self.settings.max_turns):
                # tokenising and the mask bookkeeping are CPU work (~ms per turn): run them in
                # a worker thread so the event loop keeps serving the other episodes
                messages = memory_ctx.messages()
                prompt_ids = await loop.run_in_executor(None, self._encode_prompt, messages)
                t0 = time.monotonic()
                generated = await self.server_manager.generate(
                    request_id=request_id, prompt_ids=prompt_ids, sampling_params=params)
                gen_s = time.monotonic() - t0
                response_ids, text, parsed, mem_mask = await loop.run_in_executor(
                    None, self._digest_response, list(generated.token_ids))
                logprobs = list(generated.log_probs)[: len(response_ids)] if generated.log_probs else None
                if logprobs is not None and len(logprobs) != len(response_ids):
                    logprobs = None

                done = parsed.valid and parsed.action == "answer"
                observation = short = None
                tool_s, tool_info = 0.0, {}
                if not done:
                    if parsed.valid and parsed.action in ("search", "access"):
                        t1 = time.monotonic()
                        observation, short, tool_info = await self._observe(
                            instance_id, parsed.action, parsed.argument or "")
                        tool_s = time.monotonic() - t1
                    else:
                        observation = short = invalid_turn_observation(parsed.error)
                if full_ctx is not None:
                    # what a full-history policy would have seen at this turn (as the local
                    # trainer's `mempo.agent.rollout.full_context_messages`)
                    full_messages.append(full_ctx.messages())
                    full_ctx.record_turn(text, parsed, observation, short)
                memory_ctx.record_turn(text, parsed, observation, short)
                memories.append(parsed.mem)
                turn_texts.append(text)

                extra = dict(generated.extra_fields or {})
                extra.update(
                    turn_index=turn, mem_mask=mem_mask, memory=parsed.mem or "",
                    turn_valid=bool(parsed.valid), action=parsed.action or "",
                    tool_ok=bool(tool_info.get("ok", True)),
                )
                outputs.append(AgentLoopOutput(
                    prompt_ids=prompt_ids,
                    response_ids=response_ids,
                    response_mask=[1] * len(response_ids),
                    response_logprobs=logprobs,
                    num_turns=2,
                    metrics={"generate_sequences": gen_s, "tool_calls": tool_s},
                    extra_fields=extra,
                ))
                if done:
                    break
        finally:
            if self.tool is not None and instance_id is not None:
                await self.tool.release(instance_id)

        await self._score_memories(outputs, question, answer, memories, full_messages, request_id)
        for out in outputs:  # verl's num_turns metric: chat turns of the whole episode
            out.num_turns = 2 * len(outputs)
        outputs[-1].extra_fields["mempo_turn_texts"] = turn_texts
        return outputs

    async def _score_memories(
        self, outputs: list[AgentLoopOutput], question: str, answer: str | None,
        memories: list[str | None], full_messages: list[list[dict[str, str]]], request_id: str,
    ) -> None:
        """Write mem_prob / mem_logprob (and full_* with eps=full_context) into each turn."""
        if self.settings.lambda_mem == 0 or not answer:
            for out in outputs:
                out.extra_fields.update(mem_prob=0.0, mem_logprob=0.0)
            return
        loop = asyncio.get_running_loop()
        probes = await loop.run_in_executor(
            None, lambda: [memory_probe(self.tokenizer, question, m, answer) for m in memories])
        ap = await answer_probability_from_server(
            self.server_manager, probes, self.settings.probe_concurrency, request_id)
        for k, out in enumerate(outputs):
            out.extra_fields.update(mem_prob=float(ap.prob[k]), mem_logprob=float(ap.mean_logprob[k]))
        if full_messages:
            full_probes = await loop.run_in_executor(
                None, lambda: [full_context_probe(self.tokenizer, msgs, answer) for msgs in full_messages])
            fp = await answer_probability_from_server(
                self.server_manager, full_probes, self.settings.probe_concurrency, request_id)
            for k, out in enumerate(outputs):
                out.extra_fields.update(full_prob=float(fp.prob[k]), full_logprob=float(fp.mean_logprob[k]))
