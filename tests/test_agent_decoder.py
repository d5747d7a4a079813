"""The batched KV-cache decoder (`mempo.agent.decoder`, `FastGenerator`) against transformers'
`generate()` (`HFGenerator`): greedy outputs token-identical on mixed-length prompts with stop
strings, eos and per-row budgets (tiny Qwen2 policy, a GPT-2 through the fallback engine, and,
slow, SmolLM2-135M); sampling from the same distribution (token frequencies, fixed seeds)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mempo.agent.decoder import Decoder, process_logits
from mempo.agent.engines import llama_family_reason
from mempo.agent.format import STOP_SEQUENCES, render_prompt
from mempo.agent.generation import FastGenerator, HFGenerator, SamplingParams, make_generator
from mempo.errors import ConfigError


@pytest.fixture(scope="module")
def tiny(tiny_world):
    """A 2-layer grouped-query Qwen2 policy and its BPE tokenizer, offline. Its matrices are
    re-drawn with std 0.15: at the default init (0.02) the untrained model writes one token
    forever, which would test nothing; at 0.15 it writes varied text (~-3.5 nats a token)."""
    from mempo.agent.format import SYSTEM_PROMPT, TAGS
    from mempo.datasets import iter_corpus
    from mempo.policy.tiny import TinyPolicySpec, build_tiny_model, train_tiny_tokenizer

    texts = [SYSTEM_PROMPT] * 20 + [p.contents for p in iter_corpus(tiny_world / "corpus.jsonl")]
    tok = train_tiny_tokenizer(iter(texts), TAGS, vocab_size=800)
    model = build_tiny_model(tok, TinyPolicySpec(hidden_size=64, intermediate_size=128, num_layers=2,
                                                 num_heads=4, num_kv_heads=2, seed=3)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.copy_(torch.randn(prm.shape, generator=gen) * 0.15)
    return model, tok


def _prompts(tok, tiny_world, n: int = 9) -> list[list[int]]:
    """Chat-templated questions with 0-3 passages appended: lengths from ~20 to ~190 tokens."""
    from mempo.datasets import iter_corpus, load_qa

    items = load_qa(tiny_world / "qa" / "train.jsonl")[:n]
    passages = [p.contents for p in iter_corpus(tiny_world / "corpus.jsonl")][:3 * n]
    out = []
    for i, item in enumerate(items):
        content = item.question + "".join(f"\n{passages[3 * i + j]}" for j in range(i % 4))
        out.append(tok.encode(render_prompt(tok, [{"role": "user", "content": content}]), add_special_tokens=False))
    return out


def _data_stops(gens, k: int = 4) -> tuple[str, ...]:
    """Stop strings the model will actually write: 3-character pieces from the middle of
    free-running outputs (a random policy never writes `</search>`)."""
    stops = []
    for g in gens[::2][:k]:
        piece = g.text[6:9]
        if piece.strip() and len(g.text) > 12:
            stops.append(piece)
    return tuple(dict.fromkeys(stops))


def _assert_same(ref, got, logprob_tol: float = 1e-4) -> None:
    for r, g in zip(ref, got, strict=True):
        assert g.token_ids == r.token_ids
        assert g.text == r.text and g.finish_reason == r.finish_reason
        if r.logprobs is not None:
            assert g.logprobs == pytest.approx(r.logprobs, abs=logprob_tol)


def test_greedy_is_token_identical_to_generate_with_stops_eos_and_joins(tiny, tiny_world):
    model, tok = tiny
    assert llama_family_reason(model) is None  # the hand-written forward runs this model
    prompts = _prompts(tok, tiny_world)
    assert min(map(len, prompts)) < 40 < 150 < max(map(len, prompts))
    free = HFGenerator(model, tok, batch_size=16).generate(prompts, SamplingParams(24, temperature=0.0, stop=()))
    stops = _data_stops(free) + tuple(STOP_SEQUENCES)
    # One token the model writes in the middle of one row becomes a second eos.
    extra_eos = free[1].token_ids[10]
    model = copy.deepcopy(model)
    model.generation_config.eos_token_id = [tok.eos_token_id, extra_eos]
    sampling = SamplingParams(24, temperature=0.0, stop=stops)
    ref = HFGenerator(model, tok, batch_size=16).generate(prompts, sampling)
    reasons = [(g.finish_reason, len(g.token_ids)) for g in ref]
    assert sum(r == "stop" and n < 24 for r, n in reasons) >= 3, reasons   # rows end at different steps
    assert any(g.token_ids and g.token_ids[-1] == extra_eos for g in ref)
    assert any(r == "length" for r, _ in reasons)
    # batch_size 4 < 9 prompts: rows finish, are dropped, and waiting prompts join mid-decode.
    for gen in (FastGenerator(model, tok, batch_size=16), FastGenerator(model, tok, batch_size=4),
                FastGenerator(model, tok, batch_size=4, engine="hf")):
        _assert_same(ref, gen.generate(prompts, sampling))


@pytest.mark.parametrize("fuse", [True, False])
def test_fused_and_separate_step_matrices_both_decode_like_generate(tiny, tiny_world, monkeypatch, fuse):
    """Decode steps with q/k/v and gate/up fused (small models) or as the model's own separate
    matrices (models above `FUSE_MAX_ELEMENTS`): both greedy-identical to `generate()`."""
    import mempo.agent.engines as engines

    model, tok = tiny
    if not fuse:
        monkeypatch.setattr(engines, "FUSE_MAX_ELEMENTS", 0)
    prompts = _prompts(tok, tiny_world)
    eng = engines.LlamaEngine(model)
    eng.prefill(prompts[:2], 256, 0)
    assert [f is not None for f in eng.fused] == [fuse] * 2
    sampling = SamplingParams(24, temperature=0.0, stop=())
    _assert_same(HFGenerator(model, tok, batch_size=16).generate(prompts, sampling),
                 FastGenerator(model, tok, batch_size=4).generate(prompts, sampling))


def test_prefill_groups_cover_each_prompt_once_in_order():
    from mempo.agent.engines import prefill_groups

    assert prefill_groups([5, 5, 20, 1, 1], 10) == [(0, 2), (2, 3), (3, 5)]
    assert prefill_groups([30], 10) == [(0, 1)]          # a prompt longer than a group is its own
    assert prefill_groups([3, 3, 3], 100) == [(0, 3)]
    assert prefill_groups([], 10) == []
    sizes = [7, 1, 12, 4, 4, 4, 9, 2]
    groups = prefill_groups(sizes, 8)
    assert [r for a, b in groups for r in range(a, b)] == list(range(len(sizes)))
    assert all(b - a == 1 or sum(sizes[a:b]) <= 8 for a, b in groups)


@pytest.mark.parametrize("group_tokens", [1, 128, 10**9])
def test_prefill_in_token_groups_decodes_like_generate(tiny, tiny_world, monkeypatch, group_tokens):
    """Prefill runs the packed prompts through every layer a group of prompts at a time
    (`PREFILL_GROUP_TOKENS`, so the activations stay in the CPU cache): one prompt per
    group, a few per group or all in one give `generate()`'s greedy outputs, and the same
    logits and cache within float rounding."""
    import mempo.agent.engines as engines

    model, tok = tiny
    prompts = _prompts(tok, tiny_world)
    capacity = max(map(len, prompts)) + 24
    ref_engine = engines.LlamaEngine(model)
    with torch.inference_mode():
        ref_logits = ref_engine.prefill(prompts, capacity, 0)
    monkeypatch.setattr(engines, "PREFILL_GROUP_TOKENS", group_tokens)
    n_groups = len(engines.prefill_groups([len(p) for p in prompts], group_tokens))
    if group_tokens == 1:
        assert n_groups == len(prompts)
    elif group_tokens == 128:
        assert 1 < n_groups < len(prompts)
    else:
        assert n_groups == 1
    eng = engines.LlamaEngine(model)
    with torch.inference_mode():
        logits = eng.prefill(prompts, capacity, 0)
    assert torch.allclose(logits, ref_logits, atol=1e-5)
    for a, b in zip(eng.k + eng.v, ref_engine.k + ref_engine.v, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    sampling = SamplingParams(24, temperature=0.0, stop=tuple(STOP_SEQUENCES))
    _assert_same(HFGenerator(model, tok, batch_size=16).generate(prompts, sampling),
                 FastGenerator(model, tok, batch_size=16).generate(prompts, sampling))


def test_per_row_budgets_and_joins_keep_each_row_its_own_output(tiny, tiny_world):
    model, tok = tiny
    prompts = _prompts(tok, tiny_world)
    full = HFGenerator(model, tok, batch_size=16).generate(prompts, SamplingParams(20, temperature=0.0, stop=()))
    budgets = [3, 20, 1, 7, 20, 12, 2, 20, 5]
    for max_batch, engine in ((16, "auto"), (2, "auto"), (3, "hf")):
        rows = Decoder(model, tok, max_batch=max_batch, engine=engine).decode(prompts, budgets)
        for row, ref, b in zip(rows, full, budgets, strict=True):
            assert row.token_ids == ref.token_ids[:b] and row.reason == "length"
            assert row.logprobs == pytest.approx(ref.logprobs[:b], abs=1e-4)
    with pytest.raises(ValueError, match="budgets"):
        Decoder(model, tok).decode(prompts, [1, 2])


def test_fallback_engine_runs_a_non_llama_model(tiny, tiny_world):
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tok = tiny
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=512, n_embd=32, n_layer=2, n_head=2,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    assert "gpt2" in (llama_family_reason(gpt2) or "")
    with pytest.raises(ValueError, match="llama-family"):
        Decoder(gpt2, tok, engine="llama")
    prompts = _prompts(tok, tiny_world, 5)
    free = HFGenerator(gpt2, tok).generate(prompts, SamplingParams(16, temperature=0.0, stop=()))
    sampling = SamplingParams(16, temperature=0.0, stop=_data_stops(free))
    _assert_same(HFGenerator(gpt2, tok).generate(prompts, sampling),
                 FastGenerator(gpt2, tok, batch_size=2).generate(prompts, sampling))


def _tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def test_sampling_draws_from_the_processed_distribution(tiny, tiny_world):
    model, tok = tiny
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.model.norm.weight.mul_(40.0)  # peaked logits, so temperature and top-p matter
    prompt = _prompts(tok, tiny_world, 1)[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()[None]
    temperature, top_p, n, tol = 0.7, 0.8, 3000, 0.06
    exact = process_logits(logits, temperature, top_p).softmax(-1)[0]
    # The test can tell a wrong sampler apart: these differ from `exact` by far more than tol.
    for wrong in (process_logits(logits, 1.0, top_p), process_logits(logits, temperature, 1.0),
                  process_logits(logits, 1.0, 1.0)):
        assert _tv(exact, wrong.softmax(-1)[0]) > 2.5 * tol
    sampling = SamplingParams(1, temperature=temperature, top_p=top_p, stop=(), seed=0)
    for gen in (FastGenerator(model, tok, batch_size=1024), HFGenerator(model, tok, batch_size=1024)):
        outs = gen.generate([prompt] * n, sampling)
        ids = torch.tensor([g.token_ids[0] for g in outs])
        freq = torch.bincount(ids, minlength=exact.numel()).float() / n
        assert _tv(freq, exact) < tol, type(gen).__name__
        assert exact[ids].min() > 0  # nothing outside the nucleus
        lps = torch.tensor([g.logprobs[0] for g in outs])
        assert torch.allclose(lps, exact[ids].log(), atol=1e-4)
    fast = FastGenerator(model, tok)
    again = [g.token_ids for g in fast.generate([prompt] * 64, SamplingParams(12, temperature=1.0, stop=(), seed=5))]
    assert again == [g.token_ids for g in fast.generate([prompt] * 64, SamplingParams(12, temperature=1.0, stop=(), seed=5))]
    other = [g.token_ids for g in fast.generate([prompt] * 64, SamplingParams(12, temperature=1.0, stop=(), seed=6))]
    assert other != again
    # Unseeded sampling follows torch's global RNG (what the trainer seeds), as HFGenerator does.
    torch.manual_seed(11)
    a = [g.token_ids for g in fast.generate([prompt] * 8, SamplingParams(8, temperature=1.0, stop=()))]
    torch.manual_seed(11)
    assert a == [g.token_ids for g in fast.generate([prompt] * 8, SamplingParams(8, temperature=1.0, stop=()))]


def test_decoder_sees_weight_updates_between_calls(tiny, tiny_world):
    model, tok = tiny
    model = copy.deepcopy(model)
    prompts = _prompts(tok, tiny_world, 3)
    sampling = SamplingParams(8, temperature=0.0, stop=())
    fast = FastGenerator(model, tok)
    before = fast.generate(prompts, sampling)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # in place, as an optimiser step
    after = fast.generate(prompts, sampling)
    _assert_same(HFGenerator(model, tok).generate(prompts, sampling), after)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]


def test_prefix_cache_prefills_only_new_tokens_and_decodes_like_generate(tiny, tiny_world):
    """Three turns of a full-history agent: each prompt is the last prompt, its output and an
    observation. With the prefix cache the decoder prefills only the new tokens (the rest
    comes from the rows it finished last turn) and stays greedy-identical to `generate()`;
    a prompt that agrees with a stored row only partly reuses that part; an in-place weight
    update empties the cache; the byte budget evicts the oldest rows."""
    from mempo.agent.prefix_cache import MIN_REUSE_TOKENS, PrefixCache

    model, tok = tiny
    model = copy.deepcopy(model)
    prompts = [p for p in _prompts(tok, tiny_world) if len(p) > MIN_REUSE_TOKENS][:5]
    observation = tok.encode("<information> Doc 1 more text here </information>", add_special_tokens=False)
    sampling = SamplingParams(16, temperature=0.0, stop=())
    cached = FastGenerator(model, tok, batch_size=3, prefix_cache_mb=64)
    dec = cached.decoder
    for turn in range(3):
        ref = HFGenerator(model, tok, batch_size=16).generate(prompts, sampling)
        before = dict(dec.stats)
        got = cached.generate(prompts, sampling)
        _assert_same(ref, got)
        prefilled = dec.stats["prefill_tokens"] - before["prefill_tokens"]
        if turn == 0:
            assert prefilled == sum(map(len, prompts))
        else:  # all but the newest output token and the observation came from the cache
            assert prefilled == len(prompts) * (1 + len(observation))
        prompts = [p + g.token_ids + observation for p, g in zip(prompts, got, strict=True)]
    assert dec.prefix_cache.stats["hits"] == 2 * len(prompts)
    # a prompt that agrees with a stored row for its first 70 tokens reuses those 70
    stored = next(iter(dec.prefix_cache.entries.values())).ids.tolist()
    hit = dec.prefix_cache.take(stored[:70] + [t + 1 for t in stored[70:90]])
    assert hit is not None and hit[0] == 70 and hit[1][0].shape[1] == 70
    assert dec.prefix_cache.take(stored[:70]) is None  # taken: it left the cache
    # weights changed in place (an optimiser step): nothing stale is reused
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    ref = HFGenerator(model, tok, batch_size=16).generate(prompts, sampling)
    hits = dec.prefix_cache.stats["hits"]
    _assert_same(ref, cached.generate(prompts, sampling))
    assert dec.prefix_cache.stats["hits"] == hits
    # the byte budget keeps the newest rows only
    small = PrefixCache(model, max_bytes=dec.prefix_cache.entries[next(iter(dec.prefix_cache.entries))].nbytes * 2)
    for e in list(dec.prefix_cache.entries.values()):
        small.put(e.ids.tolist(), e.keys, e.values)
    assert 1 <= len(small.entries) <= 2 and small.bytes <= small.max_bytes


def test_make_generator_and_the_decoder_setting(tiny):
    from mempo.config import load_params

    model, tok = tiny
    assert isinstance(make_generator(model, tok, "fast"), FastGenerator)
    assert isinstance(make_generator(model, tok, "hf", batch_size=3), HFGenerator)
    with pytest.raises(ConfigError, match="rollout.decoder"):
        make_generator(model, tok, "vllm")
    assert load_params(None).rollout.decoder == "fast"
    with pytest.raises(ConfigError, match="rollout.decoder"):
        load_params(None, {"rollout.decoder": "vllm"})


@pytest.mark.slow
def test_smollm2_greedy_is_token_identical_to_generate(tmp_path_factory, tiny_world):
    """SmolLM2-135M (Llama architecture, converted from the packaged GGUF): ~1 min on 2 cores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mempo.policy import bootstrap_smollm2

    out = tmp_path_factory.mktemp("smol") / "smol"
    bootstrap_smollm2(out)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert llama_family_reason(model) is None
    prompts = _prompts(tok, tiny_world, 5)
    free = HFGenerator(model, tok).generate(prompts, SamplingParams(20, temperature=0.0, stop=()))
    sampling = SamplingParams(20, temperature=0.0, stop=_data_stops(free) + tuple(STOP_SEQUENCES))
    ref = HFGenerator(model, tok).generate(prompts, sampling)
    assert any(g.finish_reason == "stop" and len(g.token_ids) < 20 for g in ref)
    _assert_same(ref, FastGenerator(model, tok, batch_size=2).generate(prompts, sampling), logprob_tol=1e-3)
    assert not math.isnan(sum(sum(g.logprobs) for g in ref))
