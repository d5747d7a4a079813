"""Greedy episodes that revisit a prompt: the rollout marks the repeat, and `GeneratorPolicy`
samples that turn alone, seeded by episode and turn (`rollout.repeat_temperature`), so a
deterministic policy does not replay the same cycle until the turn limit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mempo.agent.generation import Generation, SamplingParams, make_generator
from mempo.agent.rollout import (
    GeneratorPolicy,
    RolloutConfig,
    TurnRequest,
    repeat_seed,
    run_episodes,
)
from mempo.agent.tools import ToolConfig, ToolEnv
from mempo.policy.tiny import TinyPolicySpec, build_tiny_model


class _SameTurn:
    """A generator that writes the same memory and search every turn, recording each call's
    sampling settings and batch size."""

    def __init__(self, tok, text="<mem>Now: nothing yet.</mem><think>look</think><search>Mairwyrdale</search>"):
        self.ids = tok.encode(text, add_special_tokens=False)
        self.calls: list[tuple[int, SamplingParams]] = []

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling))
        return [Generation(text="", token_ids=list(self.ids)) for _ in prompts]


class _Recording:
    """A TurnPolicy around another, keeping every request."""

    def __init__(self, inner):
        self.inner, self.requests = inner, []

    async def respond(self, request: TurnRequest):
        self.requests.append(request)
        return await self.inner.respond(request)


@pytest.mark.parametrize("context, repeats", [("memory", [False, False, True, True]), ("full", [False] * 4)])
def test_a_prompt_seen_before_in_the_episode_is_marked(rollout_world, context, repeats):
    tok, retriever, items = rollout_world
    gen = _SameTurn(tok)
    policy = _Recording(GeneratorPolicy(gen, SamplingParams(max_new_tokens=32, temperature=0.0)))
    (ep,) = run_episodes(items[:1], policy, ToolEnv(retriever, tok, ToolConfig(topk=2)), tok, context=context,
                         config=RolloutConfig(max_turns=4), progress=False)
    # memory: turn 1's prompt is question + memory + result; turn 2 writes the same, sees the same
    assert [r.repeats for r in policy.requests] == repeats
    assert ep.repeated_turns == sum(repeats)  # what the eval rows report as `repeated_turns`


def test_repeated_greedy_turns_are_sampled_alone_with_their_own_seed(rollout_world):
    tok, retriever, items = rollout_world
    env = ToolEnv(retriever, tok, ToolConfig(topk=2))
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0)
    gen = _SameTurn(tok)
    policy = GeneratorPolicy(gen, greedy, repeat_temperature=0.8, seed=5)
    eps = run_episodes(items[:3], policy, env, tok, config=RolloutConfig(max_turns=4), progress=False)
    assert policy.resampled == 6  # turns 2 and 3 of three episodes
    own = [s for n, s in gen.calls if s.temperature > 0]
    assert len(own) == 6 and all(n == 1 for n, s in gen.calls if s.temperature > 0)
    assert sorted(s.seed for s in own) == sorted(repeat_seed(5, e.episode_id, t) for e in eps for t in (2, 3))
    assert {s.temperature for s in own} == {0.8} and all(s.max_new_tokens == 32 for s in own)
    assert all(s == greedy for n, s in gen.calls if s.temperature == 0)

    off = _SameTurn(tok)
    run_episodes(items[:3], GeneratorPolicy(off, greedy), env, tok, config=RolloutConfig(max_turns=4), progress=False)
    assert all(s == greedy for _, s in off.calls)  # repeat_temperature 0: greedy throughout
    sampled = _SameTurn(tok)  # a sampling policy never loops deterministically: nothing changes
    hot = SamplingParams(max_new_tokens=32, temperature=1.0, seed=1)
    run_episodes(items[:3], GeneratorPolicy(sampled, hot, repeat_temperature=0.8), env, tok,
                 config=RolloutConfig(max_turns=4), progress=False)
    assert all(s == hot for _, s in sampled.calls)


def test_a_real_policy_samples_its_repeated_turns_reproducibly(rollout_world):
    """A random tiny policy writes invalid turns, so its greedy prompts repeat (question, no
    memory, the same correction). Each repeated turn is the policy's sample at its own seed,
    whatever else was in flight, and differs from the greedy replay."""
    tok, retriever, items = rollout_world
    model = build_tiny_model(tok, TinyPolicySpec(hidden_size=32, intermediate_size=64, num_layers=1,
                                                 num_heads=2, num_kv_heads=1, seed=3)).eval()
    gen = make_generator(model, tok, "fast", batch_size=8)
    env = ToolEnv(retriever, tok, ToolConfig(topk=2))
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=False)
    cfg = RolloutConfig(max_turns=4)
    plain = run_episodes(items[:4], GeneratorPolicy(gen, greedy), env, tok, config=cfg, progress=False)
    policy = _Recording(GeneratorPolicy(gen, greedy, repeat_temperature=1.0, seed=2))
    escaped = run_episodes(items[:4], policy, env, tok, config=cfg, progress=False)
    repeated = [r for r in policy.requests if r.repeats]
    assert repeated, "the random policy's greedy prompts should repeat"
    by_turn = {(e.episode_id, t.turn_index): t for e in escaped for t in e.turns}
    changed = 0
    for r in repeated:
        alone = gen.generate([r.prompt_ids], replace(greedy, temperature=1.0, seed=repeat_seed(2, r.episode_id,
                                                                                           r.turn_index)))[0]
        assert by_turn[(r.episode_id, r.turn_index)].response_ids == alone.token_ids
        first = next(e for e in plain if e.episode_id == r.episode_id)
        changed += r.turn_index >= len(first.turns) or first.turns[r.turn_index].response_ids != alone.token_ids
    assert changed == len(repeated)
