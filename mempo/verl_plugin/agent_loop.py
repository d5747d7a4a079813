"""`mem_agent`: MemPO's turn loop as a verl 0.9 agent loop (one AgentLoopOutput per turn).

The turn rules are the local rollout's: each turn is digested by
`mempo.agent.step.EpisodeSteps` (parse, mem mask, answer or tool call, turn limit), which
`mempo.agent.rollout.run_episode` drives too; this module adds verl's I/O. Each turn the
prompt is REBUILT from scratch by `mempo.agent.context.MemoryContext`: system prompt +
question + the `<mem>` of the previous turn + the previous action with its (truncated)
result. Nothing older. `<search>` / `<access>` go to the retrieval `BaseTool`
(`mempo.verl_plugin.tool.RetrievalTool`), any closed `<answer>` ends the episode, an invalid
turn gets the corrective observation. Because every turn has its own prompt, `run()` returns
a list with one `AgentLoopOutput` per turn (verl 0.9's multi-trajectory output); verl keys
them `{uid}_{session}_{turn}` and copies the final reward to every turn.

Each output's `extra_fields` holds what the `mempo_sync` trainer needs:
`mem_mask` (1 on the response tokens inside `<mem>`), `turn_index`, `memory` (the text),
`mem_prob` / `mem_logprob` (P(a* | q, mem_t), from the rollout server, see
`mempo.verl_plugin.memory_probe`) and, with eps=full_context, `full_prob` / `full_logprob`;
and for the rollout-health check (`mempo.verl_plugin.health`) `tool_called` / `tool_ok`
and `logprobs_filled`. The last output also carries the episode's outcome, which verl hands
to the reward function inside `extra_info` (`mempo.verl_plugin.reward.compute_score`, R^T
without parsing any text): `mempo_final_answer`, `mempo_format_valid` and
`mempo_termination` ("answer" | "turn_limit").

An empty generation trains nothing (as in the local trainer), but a verl row needs one
response token: it holds one EOS token with response_mask 0.

Rollout log-probs: verl stacks `rollout_log_probs` only if EVERY row of a batch has them
(one row without them breaks the batch), and a turn whose generation came back empty or
aborted has none. So when the rollout computes log-probs (`rollout.calculate_log_probs`),
every turn carries exactly one per response token: the server's, and 0.0 for a token it did
not produce, counted in `logprobs_filled`; when it does not, no turn carries any.

Selected per row by the parquet column `agent_name=mem_agent` (written by the data stage).
Settings come from the Hydra `mempo:` section (configs/verl/mempo_trainer.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopOutput,
    ToolListWrap,
    register,
)

from mempo.agent.context import MemoryContext
from mempo.agent.format import STOP_SEQUENCES, USER_QUESTION_TEMPLATE, render_prompt
from mempo.agent.generation import cut_at_stop
from mempo.agent.step import EpisodeSteps, full_context_messages
from mempo.config.base import default_of
from mempo.config.episodes import MempoParams, RolloutParams, VerlParams
from mempo.verl_plugin import AGENT_LOOP_NAME
from mempo.verl_plugin.memory_probe import (
    answer_probability_from_server,
    full_context_probe,
    memory_probe,
)
from mempo.verl_plugin.reward import FINAL_ANSWER_KEY, FORMAT_VALID_KEY, TERMINATION_KEY
from mempo.verl_plugin.tool import TOOL_NAME, RetrievalTool

log = logging.getLogger(__name__)

# Per rollout backend: the sampling flag that keeps a matched stop string in the output.
KEEP_STOP_STRING: dict[str, dict[str, bool]] = {
    "sglang": {"no_stop_trim": True},
    "vllm": {"include_stop_str_in_output": True},
}


@dataclass(frozen=True)
class MemAgentSettings:
    """The agent loop's part of the Hydra `mempo:` section (a plain dataclass: the plug-in reads
    a Hydra mapping; its defaults agree with the params models, tests/test_config_hydra.py).

    Attributes:
        max_turns: turns before the episode is cut (the last turn's output is still kept).
        max_new_tokens: tokens generated per turn (also capped by rollout.response_length).
        lambda_mem: 0 skips the memory probes (no A^M is used then).
        eps: previous | full_context | none (full_context adds one probe per turn).
        check_masks: verify each `<mem>` token mask decodes to the memory text.
        probe_concurrency: memory-probe requests in flight per worker process (all episodes).
    """

    max_turns: int = default_of(RolloutParams, "max_turns")
    max_new_tokens: int = default_of(RolloutParams, "max_new_tokens")
    lambda_mem: float = default_of(MempoParams, "lambda_mem")
    eps: str = default_of(MempoParams, "eps")
    check_masks: bool = default_of(RolloutParams, "check_masks")
    probe_concurrency: int = default_of(VerlParams, "probe_concurrency")

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


def align_logprobs(server_logprobs: Sequence[float] | None, n_tokens: int,
                   calculate: bool) -> tuple[list[float] | None, int]:
    """One rollout log-prob per response token, or None for every turn (see module docstring).

    Args:
        server_logprobs: what the server returned for this generation (None or shorter when it
            produced fewer tokens than the turn trains on, e.g. an empty or aborted generation).
        n_tokens: the turn's response length.
        calculate: `rollout.calculate_log_probs`.
    Returns:
        (log-probs [n_tokens] or None, how many were filled with 0.0).
    """
    if not calculate:
        return None, 0
    got = [float(x) for x in list(server_logprobs or [])[:n_tokens]]
    return got + [0.0] * (n_tokens - len(got)), n_tokens - len(got)


# One memory-probe semaphore per event loop (= per agent-loop worker process): verl creates
# an agent loop per episode, so a per-instance bound would not bound the worker.
_PROBE_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def probe_gate(limit: int) -> asyncio.Semaphore:
    """The running event loop's memory-probe semaphore (created with `limit` on first use)."""
    loop = asyncio.get_running_loop()
    gate = _PROBE_GATES.get(loop)
    if gate is None:
        gate = _PROBE_GATES[loop] = asyncio.Semaphore(limit)
    return gate


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

    async def _observe(self, instance_id: str | None, action: str, argument: str) -> tuple[str, str | None, dict]:
        """(observation, short form for an access else None, tool info) of one tool call."""
        if self.tool is None:
            raise RuntimeError(
                "mem_agent has no retrieval tool: set actor_rollout_ref.rollout.multi_turn.tool_config_path "
                "to configs/verl/retrieval_tool.yaml")
        resp, _, info = await self.tool.execute(instance_id, {"action": action, "query": argument})
        text = resp.text or ""
        short = str(info.get("short_observation") or text) if action == "access" else None
        return text, short, dict(info)

    def _encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of one turn's prompt (chat template, capped at rollout.prompt_length)."""
        text = render_prompt(self.tokenizer, messages)
        return self._cap_text_prompt_length(self.tokenizer.encode(text, add_special_tokens=False))

    def _cut(self, token_ids: list[int]) -> list[int]:
        """The generated ids up to the first stop string, at most rollout.response_length."""
        return cut_at_stop(token_ids, self.tokenizer, STOP_SEQUENCES)[0][: self.response_length]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> list[AgentLoopOutput]:
        """Play one episode; returns one AgentLoopOutput per turn (see module docstring)."""
        question = question_of(kwargs)
        answer = gold_answer_of(kwargs)
        episode = EpisodeSteps(MemoryContext(question), self.settings.max_turns, self.settings.check_masks)
        params = dict(sampling_params)
        params["max_tokens"] = min(self.settings.max_new_tokens, self.response_length)
        params["stop"] = list(STOP_SEQUENCES)
        # keep the stop string (the closing action tag) in the returned tokens: the turn is
        # trained on exactly what the policy generated, and the parser needs the closing tag
        params.update(KEEP_STOP_STRING.get(str(self.rollout_config.name), {}))
        request_id = uuid4().hex
        loop = asyncio.get_running_loop()

        outputs: list[AgentLoopOutput] = []
        instance_id = None
        if self.tool is not None:
            instance_id, _ = await self.tool.create()
        try:
            while not episode.finished:
                # tokenising and the mask bookkeeping are CPU work (~ms per turn): run them in
                # a worker thread so the event loop keeps serving the other episodes
                prompt_ids = await loop.run_in_executor(None, self._encode_prompt, episode.messages())
                t0 = time.monotonic()
                generated = await self.server_manager.generate(
                    request_id=request_id, prompt_ids=prompt_ids, sampling_params=params)
                gen_s = time.monotonic() - t0
                step = await loop.run_in_executor(
                    None, lambda ids=list(generated.token_ids): episode.take(self._cut(ids), self.tokenizer))
                tool_s, tool_info = 0.0, {}
                if step.request is not None:
                    t1 = time.monotonic()
                    observation, short, tool_info = await self._observe(
                        instance_id, step.request.action, step.request.argument)
                    tool_s = time.monotonic() - t1
                    episode.observe(observation, short)
                # a verl row needs one response token: an empty generation holds one EOS that
                # is not trained (response_mask 0), as the local trainer trains nothing of it
                response_ids = step.response_ids or [self.tokenizer.eos_token_id or 0]
                trained = 1 if step.response_ids else 0
                logprobs, filled = align_logprobs(
                    generated.log_probs, len(response_ids),
                    bool(getattr(self.rollout_config, "calculate_log_probs", False)))
                extra = dict(generated.extra_fields or {})
                extra.update(
                    turn_index=step.turn_index, mem_mask=step.mem_mask or [0] * len(response_ids),
                    memory=step.parsed.mem or "", turn_valid=bool(step.parsed.valid),
                    action=step.parsed.action or "", tool_called=step.request is not None,
                    tool_ok=bool(tool_info.get("ok", True)), logprobs_filled=filled,
                )
                outputs.append(AgentLoopOutput(
                    prompt_ids=prompt_ids,
                    response_ids=response_ids,
                    response_mask=[trained] * len(response_ids),
                    response_logprobs=logprobs,
                    num_turns=2,
                    metrics={"generate_sequences": gen_s, "tool_calls": tool_s},
                    extra_fields=extra,
                ))
        finally:
            if self.tool is not None and instance_id is not None:
                await self.tool.release(instance_id)

        full_messages = ([full_context_messages(question, episode.turns[:t]) for t in range(len(episode.turns))]
                         if self.settings.eps == "full_context" else [])
        memories = [t.parsed.mem for t in episode.turns]
        await self._score_memories(outputs, question, answer, memories, full_messages, request_id)
        for out in outputs:  # verl's num_turns metric: chat turns of the whole episode
            out.num_turns = 2 * len(outputs)
        outputs[-1].extra_fields.update({
            FINAL_ANSWER_KEY: episode.final_answer, FORMAT_VALID_KEY: episode.format_valid,
            TERMINATION_KEY: episode.termination})
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
        gate = probe_gate(self.settings.probe_concurrency)
        ap = await answer_probability_from_server(self.server_manager, probes, request_id=request_id, gate=gate)
        for k, out in enumerate(outputs):
            out.extra_fields.update(mem_prob=float(ap.prob[k]), mem_logprob=float(ap.mean_logprob[k]))
        if full_messages:
            full_probes = await loop.run_in_executor(
                None, lambda: [full_context_probe(self.tokenizer, msgs, answer) for msgs in full_messages])
            fp = await answer_probability_from_server(self.server_manager, full_probes, request_id=request_id,
                                                      gate=gate)
            for k, out in enumerate(outputs):
                out.extra_fields.update(full_prob=float(fp.prob[k]), full_logprob=float(fp.mean_logprob[k]))
