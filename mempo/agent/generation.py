"""Engine-agnostic text generation for rollouts: one `Generator` protocol, three engines.

Prompts are TOKEN ID LISTS (already chat-templated by the caller, see
`mempo.agent.format.render_prompt`): the trainer needs the exact prompt ids it will
compute log-probabilities on, so the rollout tokenises once and every engine receives ids.

    gen = make_generator(model, tokenizer, "fast")          # FastGenerator (mempo.agent.decoder)
    gen = make_generator(model, tokenizer, "hf")            # HFGenerator: transformers generate()
    gen = OpenAIGenerator("http://127.0.0.1:30000", "policy", tokenizer)   # SGLang / vLLM
    outs = gen.generate([prompt_ids, ...], SamplingParams(max_new_tokens=256))
    outs[0].text, outs[0].token_ids, outs[0].logprobs

`generate` is synchronous and batched; the async rollout loop (`mempo.agent.rollout`) runs
it in a worker thread and batches turns of many episodes into one call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from mempo.agent.format import STOP_SEQUENCES
from mempo.errors import ConfigError, MempoError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one `generate` call.

    Attributes:
        max_new_tokens: most tokens generated per prompt.
        temperature: 0 means greedy.
        top_p: nucleus sampling mass (1.0 = off).
        stop: stop strings; the returned text/ids include the stop string itself.
        seed: seed for sampling (None = not seeded).
        logprobs: return per-token log-probabilities of the sampled tokens.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = tuple(STOP_SEQUENCES)
    seed: int | None = None
    logprobs: bool = True


@dataclass
class Generation:
    """One generated response.

    Attributes:
        text: decoded response (special tokens skipped), cut right after a stop string.
        token_ids: generated token ids, [n_tokens] (no padding; eos kept if generated).
        logprobs: log p of each generated token under the sampling distribution
            (temperature applied), [n_tokens], or None when the engine gave none.
        finish_reason: "stop" (stop string or eos) or "length".
    """

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str = "stop"
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Generator(Protocol):
    """Anything that turns prompt token ids into responses."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        """One `Generation` per prompt, in order."""
        ...


def cut_at_stop(
    token_ids: list[int], tokenizer: Any, stop: Sequence[str]
) -> tuple[list[int], str, bool]:
    """Drop tokens after the first token that completes a stop string.

    Returns (kept ids, decoded text of the kept ids, whether a stop string was hit). The
    kept ids are a prefix of `token_ids`, so they stay exactly what the model generated.
    """
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    hits = [text.find(s) + len(s) for s in stop if s and s in text]
    if not hits:
        return token_ids, text, False
    end_char = min(hits)
    # Smallest prefix whose decoding reaches the stop string's end.
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(token_ids[:mid], skip_special_tokens=True)) >= end_char:
            hi = mid
        else:
            lo = mid + 1
    kept = token_ids[:lo]
    return kept, tokenizer.decode(kept, skip_special_tokens=True), True


class HFGenerator:
    """Batched generation with a transformers causal LM (left padding; CPU or CUDA).

    Args:
        model: a `PreTrainedModel` (put on its device by the caller).
        tokenizer: its tokenizer; a pad token is taken from eos when missing.
        batch_size: prompts per forward batch.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 16) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        out: list[Generation] = []
        for i in range(0, len(prompts), self.batch_size):
            out.extend(self._generate_batch(prompts[i:i + self.batch_size], sampling))
        return out

    def _generate_batch(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        import torch

        if not prompts:
            return []
        from mempo.agent.engines import left_pad

        pad_id = self.tokenizer.pad_token_id
        device = next(self.model.parameters()).device
        input_ids, attention = left_pad(prompts, pad_id)
        width = input_ids.shape[1]
        greedy = sampling.temperature <= 0
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            pad_token_id=pad_id,
            return_dict_in_generate=True,
            output_scores=sampling.logprobs,
        )
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        if sampling.stop:
            kwargs.update(stop_strings=list(sampling.stop), tokenizer=self.tokenizer)
        with torch.inference_mode():
            res = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device), **kwargs
            )
        seqs = res.sequences[:, width:].cpu()
        # scores are the processed logits (temperature/top-p applied) at each step.
        step_logp = (
            torch.stack([s.float().log_softmax(-1) for s in res.scores], dim=1).cpu()
            if sampling.logprobs and res.scores else None
        )
        eos_ids = eos_token_ids(self.model, self.tokenizer)
        gens: list[Generation] = []
        for r in range(len(prompts)):
            ids = seqs[r].tolist()
            lps = None
            if step_logp is not None:
                lps = [float(step_logp[r, k, t]) for k, t in enumerate(ids)]
            gens.append(finish_generation(ids, lps, self.tokenizer, sampling, eos_ids))
        return gens


def finish_generation(ids: list[int], logprobs: list[float] | None, tokenizer: Any,
                      sampling: SamplingParams, eos_ids: set[int]) -> Generation:
    """The `Generation` of raw generated `ids` (and their log-probs): cut after the first eos
    (kept), then right after the first stop string (`cut_at_stop`). Every engine ends here,
    so they return the same thing for the same tokens."""
    n = len(ids)
    for k, t in enumerate(ids):
        if t in eos_ids:
            n = k + 1  # keep the eos: the policy generated it
            break
    ids = ids[:n]
    hit_eos = bool(ids) and ids[-1] in eos_ids
    ids, text, hit_stop = cut_at_stop(ids, tokenizer, sampling.stop)
    lps = None if logprobs is None else [float(x) for x in logprobs[:len(ids)]]
    finished = hit_stop or hit_eos or len(ids) < sampling.max_new_tokens
    return Generation(text, ids, lps, "stop" if finished else "length")


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a sequence: the model's generation config, config and tokenizer."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list | tuple):
            ids.update(int(x) for x in e)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class FastGenerator:
    """Batched generation with `mempo.agent.decoder.Decoder` (preallocated KV cache, finished
    rows dropped, waiting prompts joining between steps); same contract as `HFGenerator`.

    Greedy outputs are token-identical to `generate()`; sampling draws from the same
    distribution (temperature, then top-p) with `torch.multinomial`, seeded per call when
    `sampling.seed` is set, else from torch's global RNG (as `HFGenerator`).

    Args:
        model: a `PreTrainedModel` (put on its device by the caller).
        tokenizer: its tokenizer; a pad token is taken from eos when missing.
        batch_size: rows decoded together (more prompts join as rows finish).
        engine: "auto" | "llama" | "hf" (see `mempo.agent.engines.make_engine`).
        prefix_cache_mb: finished rows' keys and values kept for prompts that extend them
            (`rollout.prefix_cache_mb`, `mempo.agent.prefix_cache`); 0 = off.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 64, engine: str = "auto",
                 prefix_cache_mb: int = 0) -> None:
        from mempo.agent.decoder import Decoder

        self.model = model
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.decoder = Decoder(model, tokenizer, max_batch=batch_size, engine=engine,
                               prefix_cache_bytes=prefix_cache_mb << 20)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        import torch

        gen = None
        if sampling.seed is not None and sampling.temperature > 0:
            device = next(self.model.parameters()).device
            gen = torch.Generator(device=device).manual_seed(sampling.seed)
        rows = self.decoder.decode(prompts, sampling.max_new_tokens, temperature=sampling.temperature,
                                   top_p=sampling.top_p, stop=sampling.stop, logprobs=sampling.logprobs,
                                   generator=gen)
        eos = self.decoder.eos_ids
        return [finish_generation(r.token_ids, r.logprobs if sampling.logprobs else None, self.tokenizer,
                                  sampling, eos) for r in rows]


DECODERS = ("fast", "hf")


def make_generator(model: Any, tokenizer: Any, kind: str = "fast", batch_size: int = 64,
                   prefix_cache_mb: int = 0) -> Generator:
    """The in-process generator every caller builds (`rollout.decoder`, `--decoder`):
    "fast" = `FastGenerator` (with `prefix_cache_mb`, `rollout.prefix_cache_mb`), "hf" =
    `HFGenerator` (transformers `generate()`, the fallback)."""
    if kind == "fast":
        return FastGenerator(model, tokenizer, batch_size=batch_size, prefix_cache_mb=prefix_cache_mb)
    if kind == "hf":
        return HFGenerator(model, tokenizer, batch_size=batch_size)
    raise ConfigError(f"unknown decoder '{kind}' (choose from {', '.join(DECODERS)})", field="rollout.decoder")


class OpenAIGenerator:
    """Generation through an OpenAI-compatible `/v1/completions` endpoint (SGLang, vLLM).

    Prompts are sent as token id lists (both servers accept `prompt: [int, ...]`). Response
    ids come from the server when it returns them (`output_token_ids` / SGLang `meta_info`);
    otherwise the text is re-tokenised with `tokenizer` (then logprobs, if any, are kept
    only when their count matches).

    Args:
        base_url: e.g. "http://127.0.0.1:30000" (no trailing /v1).
        model: the served model name.
        tokenizer: the policy's tokenizer (for decoding / re-tokenising).
        timeout_s: HTTP timeout per request.
        max_concurrency: parallel requests (one prompt per request).
    """

    def __init__(
        self, base_url: str, model: str, tokenizer: Any, timeout_s: float = 300.0,
        max_concurrency: int = 32, api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _payload(self, prompt: Sequence[int], sampling: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": sampling.max_new_tokens,
            "temperature": max(sampling.temperature, 0.0),
            "top_p": sampling.top_p,
            "stop": list(sampling.stop),
            "include_stop_str_in_output": True,  # vLLM; SGLang: no_stop_trim
            "no_stop_trim": True,
            "skip_special_tokens": True,
        }
        if sampling.logprobs:
            body["logprobs"] = 1
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        return body

    def _parse(self, data: dict[str, Any], sampling: SamplingParams) -> Generation:
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError) as e:
            raise MempoError(f"completion response has no choices: {str(data)[:200]}") from e
        text = choice.get("text") or ""
        for s in sampling.stop:
            # Servers that trim the stop string despite the flags: put it back.
            if choice.get("finish_reason") == "stop" and choice.get("matched_stop") == s and not text.endswith(s):
                text += s
        ids = choice.get("output_token_ids") or choice.get("token_ids")
        lp_block = choice.get("logprobs") or {}
        lps = lp_block.get("token_logprobs") if isinstance(lp_block, dict) else None
        if ids is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        if lps is not None and len(lps) != len(ids):
            lps = None
        reason = "length" if choice.get("finish_reason") == "length" else "stop"
        return Generation(text, list(ids), None if lps is None else [float(x) for x in lps], reason)

    async def agenerate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        """Async variant: one HTTP request per prompt, at most `max_concurrency` in flight."""
        import asyncio

        import httpx

        sem = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
            async def one(p: Sequence[int]) -> Generation:
                async with sem:
                    r = await client.post(f"{self.base_url}/v1/completions", json=self._payload(p, sampling))
                if r.status_code != 200:
                    raise MempoError(f"{self.base_url}/v1/completions returned {r.status_code}: {r.text[:200]}")
                return self._parse(r.json(), sampling)

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        import asyncio

        return asyncio.run(self.agenerate(prompts, sampling))
