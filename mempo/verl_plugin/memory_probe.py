"""Memory rewards on the verl path: P(a* | q, mem_t) from the rollout server's prompt log-probs.

The memory reward is the same quantity as on the local trainer (`mempo.advantage`): the
geometric mean of the teacher-forced per-token probabilities of the gold answer after a
prompt holding only the question and mem_t (`mempo.agent.format.answer_probe_messages`,
rendered with `ANSWER_PROBE_PREFIX`, the answer scored as `answer_continuation(a)`).
Two ways to get it at scale:

1. the ACTOR: recompute log-probs of (probe prompt + answer) sequences in the trainer, as
   an extra batch through the FSDP/Megatron workers (`mempo.advantage.answer_probability`
   is this computation on one model);
2. the ROLLOUT SERVER: send each (probe prompt + answer) to SGLang with
   `prompt_logprobs=0, max_tokens=1` and read the input-token log-probs back (the same
   request verl 0.9's distillation teacher uses).

We use (2), called from the agent loop right after an episode ends. Why:
- the scores are per-trajectory values written to `extra_fields`, so the trainer needs
  no extra forward pass, no extra TransferQueue schema and no change to verl's batch
  balancing: the trainer's only change stays the advantage step;
- in the synchronous trainer the rollout server holds the actor's weights of this step
  (verl syncs them before every rollout), so the probability is under the same policy;
- they run while other episodes are still generating;
- the memory reward is a reward, not a gradient path, so bf16 kernel differences between
  SGLang and the training engine (~1e-2 relative on log-probs) do not bias the update.
The actor path stays the reference: tests assert both paths agree on the same inputs
(`answer_probability` on a model vs this module on a server backed by the same model).

What a probe costs on SGLang (0.5.x): asking for prompt log-probs from the first token
(`logprob_start_len=0`, what verl's server sends for `prompt_logprobs`) makes SGLang compute
the whole prompt again, so the shared system-prompt + question prefix is NOT served from the
radix cache, and its logits processor builds float32 logits over the full vocabulary for
every prompt token (0.6 MB per token for Qwen2.5's 152k vocabulary). Two bounds keep that in
check: `mempo train verl` turns on SGLang's chunked logits processing in the Ray runtime env
(`verl.logprob_chunk_size`, `mempo.training.verl_launch.sglang_probe_env`), and the agent
loop shares ONE semaphore of `probe_concurrency` requests per worker process across all its
episodes (`gate` below), instead of that many per episode. The GPU smoke run
(scripts/gpu_smoke.py) measures the probe's tokens/s and peak memory on the actor path.

    probes = [probe_ids(tok, question, mem, answer) for mem in memories]
    ap = await answer_probability_from_server(server_manager, probes)   # .prob, .mean_logprob
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import torch

from mempo.advantage import AnswerProbability
from mempo.agent.format import (
    ANSWER_PROBE_PREFIX,
    answer_continuation,
    answer_probe_messages,
    render_prompt,
)

# Sampling parameters for a prompt-log-prob request (forward pass only; temperature has no
# effect on prompt log-probs, max_tokens=1 avoids SGLang's empty-output corner case). Only
# keys both verl servers accept: verl's SGLang server translates max_tokens/prompt_logprobs
# and hands the rest to SGLang's SamplingParams.
PROMPT_LOGPROB_SAMPLING: dict[str, Any] = {
    "max_tokens": 1,
    "temperature": 1.0,
    "prompt_logprobs": 0,
}


@dataclass(frozen=True)
class AnswerProbe:
    """One teacher-forced probe: token ids of the rendered prompt and of the scored answer."""

    prompt_ids: list[int]
    answer_ids: list[int]


def encode_probe(tokenizer: Any, prompt: str, answer: str) -> AnswerProbe:
    """Tokenise prompt and answer separately (no special tokens), as `answer_probability` does."""
    a_ids = tokenizer.encode(answer, add_special_tokens=False)
    if not a_ids:
        raise ValueError(f"answer tokenises to nothing: {answer!r}")
    return AnswerProbe(tokenizer.encode(prompt, add_special_tokens=False), a_ids)


def memory_probe(tokenizer: Any, question: str, memory: str | None, answer: str) -> AnswerProbe:
    """The probe for P(a* | q, mem): only the question and that memory in the prompt."""
    prompt = render_prompt(tokenizer, answer_probe_messages(question, memory), ANSWER_PROBE_PREFIX)
    return encode_probe(tokenizer, prompt, answer_continuation(answer))


def full_context_probe(tokenizer: Any, messages: list[dict[str, str]], answer: str) -> AnswerProbe:
    """The probe for P(a* | full history) (eps=full_context): the full-history messages."""
    return encode_probe(tokenizer, render_prompt(tokenizer, messages, ANSWER_PROBE_PREFIX),
                        answer_continuation(answer))


def answer_logprobs_from_prompt_logprobs(
    prompt_logprobs: Sequence[Sequence[float]], n_prompt: int, n_answer: int
) -> torch.Tensor:
    """Log-probs of the answer tokens from verl's prompt-log-prob contract.

    verl 0.9 shapes SGLang's (and vLLM's) input log-probs into S rows for a sequence of S
    tokens: row j holds the log-prob of token j+1 given tokens 0..j (the first token has no
    prediction and is skipped; a dummy last row keeps the length S). The answer occupies
    tokens n_prompt .. n_prompt+n_answer-1, i.e. rows n_prompt-1 .. n_prompt+n_answer-2.

    Returns:
        float32 tensor [n_answer].
    """
    s = n_prompt + n_answer
    if len(prompt_logprobs) != s:
        raise ValueError(f"prompt_logprobs has {len(prompt_logprobs)} rows for a {s}-token sequence")
    if n_prompt < 1:
        raise ValueError("the probe prompt must hold at least one token")
    rows = prompt_logprobs[n_prompt - 1:n_prompt - 1 + n_answer]
    return torch.tensor([float(r[0]) for r in rows], dtype=torch.float32)


async def answer_probability_from_server(
    server_manager: Any, probes: Sequence[AnswerProbe], max_concurrency: int = 64,
    request_id: str | None = None, gate: asyncio.Semaphore | None = None,
) -> AnswerProbability:
    """Teacher-forced answer probabilities from the rollout server, one request per probe.

    Args:
        server_manager: verl's `LLMServerClient` (anything with verl's async
            `generate(request_id=, prompt_ids=, sampling_params=)` returning a TokenOutput
            whose `extra_fields["prompt_logprobs"]` follows verl's contract).
        probes: N probes.
        max_concurrency: requests in flight at once (when no `gate` is given).
        request_id: verl routes requests with the same id to the same server replica; the
            agent loop passes its episode's id, keeping an episode's requests on one replica
            (None: a fresh id per probe, spread over replicas).
        gate: a semaphore shared with other callers (the agent loop's per-worker bound).
    Returns:
        `AnswerProbability` with tensors [N] (prob = exp(mean log p) per probe).
    """
    gate = gate or asyncio.Semaphore(max_concurrency)

    async def one(probe: AnswerProbe) -> torch.Tensor:
        async with gate:
            out = await server_manager.generate(
                request_id=request_id or uuid4().hex,
                prompt_ids=probe.prompt_ids + probe.answer_ids,
                sampling_params=dict(PROMPT_LOGPROB_SAMPLING),
            )
        rows = (getattr(out, "extra_fields", None) or {}).get("prompt_logprobs")
        if rows is None:
            raise RuntimeError("the rollout server returned no prompt_logprobs (SGLang >= 0.5 / vLLM needed)")
        return answer_logprobs_from_prompt_logprobs(rows, len(probe.prompt_ids), len(probe.answer_ids))

    logps = await asyncio.gather(*(one(p) for p in probes))
    if not logps:
        empty = torch.zeros(0)
        return AnswerProbability(empty, empty, torch.zeros(0, dtype=torch.long))
    means = torch.stack([lp.mean() for lp in logps])
    counts = torch.tensor([len(lp) for lp in logps], dtype=torch.long)
    return AnswerProbability(means.exp(), means, counts)
