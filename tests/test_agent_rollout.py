"""Rollouts end to end on the tiny world with the real BM25 retriever: the scripted teacher
(memory and full-history contexts, multi-objective tasks, the access fallback), the
transformers generator (batched turns, logprobs), and the OpenAI-compatible HTTP generator."""

from __future__ import annotations

import pytest
import torch
from fastapi import Request  # module level: FastAPI resolves the string annotation from globals

from mempo.agent.format import parse_turn, render_prompt
from mempo.agent.generation import (
    Generation,
    HFGenerator,
    OpenAIGenerator,
    SamplingParams,
    cut_at_stop,
)
from mempo.agent.masks import check_mem_mask
from mempo.agent.rollout import GeneratorPolicy, RolloutConfig, full_context_messages, run_episodes
from mempo.agent.teacher import NO_FACTS_YET, ScriptedTeacher
from mempo.agent.tools import ArticleReader, ToolConfig, ToolEnv, chunk_text
from mempo.forgetting import MemoryStep, episode_forgot
from mempo.policy.tiny import TinyPolicySpec, build_tiny_model
from mempo.retrieval.inprocess import InProcessRetriever
from mempo.tasks import compose_multi_objective


def _check_records(ep, tok):
    for t in ep.turns:
        assert t.prompt_length == len(t.prompt_ids)
        assert len(t.response_mask) == len(t.mem_mask) == len(t.response_ids)
        assert tok.decode(t.response_ids, skip_special_tokens=True) == t.response_text
        check_mem_mask(t.response_ids, tok, t.mem_mask, t.memory)


def test_teacher_solves_world_tasks_in_both_contexts(rollout_world):
    tok, retriever, items = rollout_world
    env = ToolEnv(retriever, tok, ToolConfig(topk=3, observation_max_tokens=400))
    sample = [i for i in items if i.metadata["type"] in ("bridge", "comparison")][:6] + items[:2]
    mem = run_episodes(sample, ScriptedTeacher(tok), env, tok, context="memory", progress=False)
    full = run_episodes(sample, ScriptedTeacher(tok), env, tok, context="full", progress=False)
    for em, ef, item in zip(mem, full, sample, strict=True):
        assert em.outcome_reward() == 1.0 and ef.outcome_reward() == 1.0, em.to_dict()
        assert em.format_valid and not em.hit_turn_limit
        assert em.num_turns == len(item.objectives[0].chain) + 1  # one search per hop, then answer
        _check_records(em, tok)
        _check_records(ef, tok)
        # same trajectory, different contexts: the full history is never shorter
        assert [t.response_text for t in em.turns] == [t.response_text for t in ef.turns]
        assert all(a <= b for a, b in zip(em.prompt_tokens, ef.prompt_tokens, strict=True))
        # the memory grows with exactly the facts found so far
        assert em.turns[0].memory == NO_FACTS_YET
        for k, hop in enumerate(item.objectives[0].chain):
            assert hop.value in em.turns[k + 1].memory
            assert hop.value in (em.turns[k].observation or "")
        # the first-turn prompt is what the data stage writes: the question only
        assert em.turns[0].prompt_ids == tok.encode(render_prompt(tok, full_context_messages(em, 0)),
                                                    add_special_tokens=False)
    three_hop = next(e for e in mem if e.num_turns == 4)
    assert three_hop.prompt_tokens[-1] < full[mem.index(three_hop)].prompt_tokens[-1]


def test_teacher_multi_objective_tasks(rollout_world):
    tok, retriever, items = rollout_world
    tasks = compose_multi_objective(items, k=3, n_tasks=3, seed=1)
    env = ToolEnv(retriever, tok, ToolConfig(topk=3))
    eps = run_episodes(tasks, ScriptedTeacher(tok), env, tok, config=RolloutConfig(max_turns=30), progress=False)
    for ep, task in zip(eps, tasks, strict=True):
        assert ep.outcome_reward() == 1.0
        assert len(parse_turn(ep.turns[-1].response_text).argument.split(";")) == 3
        hops = sum(len(o.chain) for o in task.objectives)
        assert ep.num_turns == hops + 1
        # finished objectives are kept as their answers only, listed as the final answer lists them
        objs = task.objectives
        final = parse_turn(ep.turns[-1].response_text).argument
        assert ep.turns[-1].memory == f"Answers: {final}."
        # the objective in progress is named in the memory, copied from the task's question
        assert ep.turns[0].memory == f"Now: {objs[0].question}"
        assert f"Now: {objs[2].question}" in ep.turns[-2].memory and objs[2].question in task.question
        assert "Now:" not in ep.turns[-1].memory  # all done: only the answers
        # and its memory never drops an answer it has stored
        assert not episode_forgot(ep.objectives, [MemoryStep(t.memory, t.observation) for t in ep.turns])

def test_teacher_queue_layout_keeps_the_questions_left_and_drops_the_head(rollout_world):
    tok, retriever, items = rollout_world
    tasks = compose_multi_objective(items, k=3, n_tasks=3, seed=1)
    env = ToolEnv(retriever, tok, ToolConfig(topk=3))
    cfg = RolloutConfig(max_turns=30)
    now = run_episodes(tasks, ScriptedTeacher(tok), env, tok, config=cfg, progress=False)
    queue = run_episodes(tasks, ScriptedTeacher(tok, layout="queue"), env, tok, config=cfg, progress=False)
    for en, eq, task in zip(now, queue, tasks, strict=True):
        assert eq.outcome_reward() == 1.0
        # the same searches and answer: only the memory differs
        assert [t.action for t in eq.turns] == [t.action for t in en.turns]
        assert eq.turns[-1].response_text.split("<answer>")[1] == en.turns[-1].response_text.split("<answer>")[1]
        qs = [o.question for o in task.objectives]
        assert eq.turns[0].memory == f"Now: {task.question}" == f"Now: {'; '.join(qs)}"
        lefts = []
        for t in eq.turns[:-1]:
            head, _, rest = t.memory.partition("Now: ")
            lefts.append(next(len(qs) - i for i in range(len(qs)) if rest.startswith("; ".join(qs[i:]))))
        assert lefts == sorted(lefts, reverse=True) and set(lefts) == {3, 2, 1}  # each drop is one head
        assert "Now:" not in eq.turns[-1].memory and eq.turns[-1].memory == en.turns[-1].memory
        _check_records(eq, tok)
    with pytest.raises(ValueError, match="'list'.*now, queue"):
        ScriptedTeacher(tok, layout="list")



class _SearchMisses(InProcessRetriever):
    """A retriever whose search finds nothing (a weak index), with the real access call."""

    def search(self, queries, topk=3):
        return [[] for _ in queries]


def test_teacher_falls_back_to_access_and_access_chunks(rollout_world, tiny_world):
    tok, retriever, items = rollout_world
    weak = _SearchMisses(retriever.store, retriever.searcher, retriever.manifest)
    env = ToolEnv(weak, tok, ToolConfig(access_chunk_chars=60, short_text_chars=20))
    item = next(i for i in items if i.metadata["type"] == "single")
    ep = run_episodes([item], ScriptedTeacher(tok), env, tok, context="full", progress=False)[0]
    actions = [t.action for t in ep.turns]
    # search misses, then the article is read chunk by chunk until the fact shows up
    assert actions[0] == "search" and actions[-1] == "answer" and len(actions) >= 3
    assert set(actions[1:-1]) == {"access"}, [t.response_text for t in ep.turns]
    assert ep.outcome_reward() == 1.0  # the entity's own article holds the fact
    assert "[chunk 1/" in ep.turns[1].observation and ep.turns[1].short_observation is not None
    # access again shows the next chunk; once not last, the full context keeps the short form
    reader = ArticleReader()
    import asyncio

    first, short = asyncio.run(env.access(item.objectives[0].chain[0].entity, reader))
    second, _ = asyncio.run(env.access(item.objectives[0].chain[0].entity, reader))
    assert "[chunk 1/" in first and "[chunk 2/" in second and len(short) < len(first) + 200
    missing, _ = asyncio.run(env.access("No Such Article", ArticleReader()))
    assert "No article found" in missing
    assert chunk_text("a b c d e f", 3) == ["a b", "c d", "e f"]


@pytest.fixture(scope="module")
def tiny_policy(rollout_world):
    tok = rollout_world[0]
    model = build_tiny_model(tok, TinyPolicySpec(hidden_size=32, intermediate_size=64, num_layers=1,
                                                 num_heads=2, num_kv_heads=1, seed=3)).eval()
    return model, tok


class _CountingGenerator:
    """The real HFGenerator, counting its batched calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, prompts, sampling):
        self.calls.append(len(prompts))
        return self.inner.generate(prompts, sampling)


def test_generator_policy_batches_turns_and_records_logprobs(rollout_world, tiny_policy):
    model, tok = tiny_policy
    _, retriever, items = rollout_world
    gen = _CountingGenerator(HFGenerator(model, tok, batch_size=8))
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=0)
    eps = run_episodes(items[:3], GeneratorPolicy(gen, sampling), ToolEnv(retriever, tok), tok,
                       config=RolloutConfig(max_turns=2), n_rollouts=2, progress=False)
    assert [e.episode_id for e in eps] == [f"{i.id}#{r}" for i in items[:3] for r in range(2)]
    assert gen.calls[0] == 6  # the six episodes' first turns went out as one batch
    n_turns = sum(e.num_turns for e in eps)
    assert len(gen.calls) < n_turns
    for ep in eps:
        _check_records(ep, tok)
        assert ep.hit_turn_limit or ep.turns[-1].action == "answer"
        for t in ep.turns:
            assert t.logprobs is not None and len(t.logprobs) == len(t.response_ids)
            assert all(lp <= 1e-6 for lp in t.logprobs)
            if not t.valid and t.action != "answer":
                assert t.observation.startswith("<information> Your previous turn was not")


def test_hf_generator_greedy_logprobs_match_teacher_forcing(tiny_policy):
    model, tok = tiny_policy
    prompts = [tok.encode("Question: who founded it?", add_special_tokens=False),
               tok.encode("Question: a much longer question about the mayor of the city?", add_special_tokens=False)]
    outs = HFGenerator(model, tok).generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0, stop=()))
    for p, g in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + g.token_ids])).logits[0]
        lp = logits.log_softmax(-1)
        ref = [lp[len(p) - 1 + i, t].item() for i, t in enumerate(g.token_ids)]
        assert g.logprobs == pytest.approx(ref, abs=1e-4)
        assert g.token_ids[0] == int(logits[len(p) - 1].argmax())  # greedy


def test_cut_at_stop_keeps_a_prefix_of_the_generated_ids(tiny_policy):
    _, tok = tiny_policy
    ids = tok.encode("<mem> m </mem> <search> q </search> trailing text", add_special_tokens=False)
    kept, text, hit = cut_at_stop(ids, tok, ["</search>", "</answer>"])
    assert hit and kept == ids[:len(kept)] and text.endswith("</search>")
    assert cut_at_stop(ids[:3], tok, ["</answer>"])[2] is False


def _completions_app(model, tok):
    """A minimal OpenAI-compatible /v1/completions app over the real HFGenerator."""
    from fastapi import FastAPI

    app = FastAPI()
    gen = HFGenerator(model, tok)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.json()
        out = gen.generate([body["prompt"]], SamplingParams(
            max_new_tokens=body["max_tokens"], temperature=body["temperature"], stop=tuple(body["stop"])))[0]
        return {"choices": [{"text": out.text, "output_token_ids": out.token_ids, "finish_reason": "stop",
                             "logprobs": {"token_logprobs": out.logprobs}}]}

    return app


def test_openai_generator_matches_hf_over_http(tiny_policy):
    import threading
    import time

    import uvicorn

    model, tok = tiny_policy
    server = uvicorn.Server(uvicorn.Config(_completions_app(model, tok), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    prompts = [tok.encode("Question: where was he born?", add_special_tokens=False)]
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    try:
        local = HFGenerator(model, tok).generate(prompts, sampling)
        remote = OpenAIGenerator(url, "policy", tok).generate(prompts * 2, sampling)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert all(isinstance(r, Generation) for r in remote)
    assert remote[0].token_ids == local[0].token_ids and remote[1].text == local[0].text
    assert remote[0].logprobs == pytest.approx(local[0].logprobs, abs=1e-4)


def test_memory_reward_on_teacher_episodes(rollout_world, tiny_policy):
    from mempo.advantage import MemoryTurn, answer_probability, memory_reward
    from mempo.agent.format import ANSWER_PROBE_PREFIX, answer_continuation

    model, tok = tiny_policy
    _, retriever, items = rollout_world
    ep = run_episodes([next(i for i in items if i.metadata["hops"] == 2)], ScriptedTeacher(tok),
                      ToolEnv(retriever, tok), tok, progress=False)[0]
    full_prompts = [render_prompt(tok, full_context_messages(ep, t.turn_index), ANSWER_PROBE_PREFIX)
                    for t in ep.turns]
    turns = [MemoryTurn(ep.episode_id, t.turn_index, ep.question, t.memory, ep.golden_answers[0], fp)
             for t, fp in zip(ep.turns, full_prompts, strict=True)]
    r_prev = memory_reward(model, tok, turns, eps="previous")
    r_full = memory_reward(model, tok, turns, eps="full_context", form="logprob")
    assert r_prev.shape == r_full.shape == (ep.num_turns,)
    gold = [answer_continuation(ep.golden_answers[0])] * ep.num_turns
    p_full = answer_probability(model, tok, full_prompts, gold).mean_logprob
    p_mem = memory_reward(model, tok, turns, eps="none", form="logprob")
    assert torch.allclose(r_full, p_mem - p_full, atol=1e-5)
    # at turn 0 the full history is the question alone, and the memory prompt adds only a memory
    assert "Question:" in full_prompts[0] and "<mem>" not in full_prompts[0].split("Question:")[-1]
