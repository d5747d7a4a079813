"""The two trainers' turn loops on the SAME scripted generations give the same episode.

The local rollout (`mempo.agent.rollout.run_episode`) and verl's `mem_agent`
(`mempo.verl_plugin.agent_loop`, built by verl's registry, scored by verl's reward entry)
both drive `mempo.agent.step.EpisodeSteps`. Only the engine is scripted: a fixed list of
token ids per turn, served to the local trainer as a `Generator` and to verl as its
server manager. The retrieval tool is the real one over the tiny world, shared by both.

Asserted per turn: prompt ids, trained response ids, mem mask, memory text, validity,
action, tool call; per episode: termination, final answer, format validity, R^T, and the
memory-reward probes (memory context and full-history context).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from verl_cpu_helpers import ScriptedServer, make_mem_agent_loop, tiny_policy  # noqa: F401

from mempo.agent.format import build_messages, render_prompt
from mempo.agent.generation import Generation, SamplingParams
from mempo.agent.rollout import GeneratorPolicy, RolloutConfig, full_context_messages, run_episode
from mempo.tasks import Task
from mempo.verl_plugin.memory_probe import full_context_probe, memory_probe
from mempo.verl_plugin.reward import compute_score


class ScriptedGenerator:
    """The local trainer's `Generator`: returns the next scripted token ids per prompt."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script = [list(s) for s in script]

    def generate(self, prompts, sampling):
        out = []
        for _ in prompts:
            ids = self.script.pop(0)
            out.append(Generation(text="", token_ids=ids, logprobs=[-0.5] * len(ids)))
        return out


class ScriptedIdsServer(ScriptedServer):
    """verl's server manager replaying the same token ids; memory probes see a flat model."""

    def __init__(self, tokenizer, script: list[list[int]]) -> None:
        super().__init__(tokenizer, [])
        self.script = [list(s) for s in script]
        self.prompt_logprobs = lambda ids: {"prompt_logprobs": [[-0.25]] * len(ids)}

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        if "prompt_logprobs" in sampling_params:
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
        self.calls.append({"prompt_ids": list(prompt_ids), "sampling_params": dict(sampling_params)})
        ids = self.script.pop(0)
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), extra_fields={})


@dataclass
class Case:
    texts: list[str]
    max_turns: int
    turns: int            # turns both drivers play
    termination: str      # "answer" | "turn_limit"
    reward: float         # R^T (strict format rule, all objectives)


def _cases(item: Task, multi: Task) -> dict[str, tuple[Task, Case]]:
    subject, hop, gold = item.metadata["subjects"][0], item.objectives[0].chain[0], item.golden_answers[0]
    search = f"<mem> nothing yet </mem> <think> find {subject} </think> <search> {subject} born </search>"
    answer = f"<mem> the answer is {gold} </mem> <think> done </think> <answer> {gold} </answer>"
    return {
        "valid": (item, Case([search, answer], 4, 2, "answer", 1.0)),
        # an invalid turn (no <mem>) gets the corrective observation; the episode goes on
        "invalid_turn": (item, Case([
            search, "<think> forgot my memory </think> <search> nowhere </search>",
            f"<mem> {subject} was born in {hop.value} </mem> <think> read </think> <access> {hop.value} </access>",
            answer], 4, 4, "answer", 0.0)),
        # an unclosed <answer> is no action (the episode goes on); a closed <answer> without
        # <mem> is an invalid answer: it ends the episode (the third script entry is never used)
        "malformed_answer": (item, Case([
            f"<mem> m </mem> <answer> {gold}", f"<think> sure </think> <answer> {gold} </answer>", answer],
            4, 2, "answer", 0.0)),
        # an empty generation is an invalid turn that trains nothing
        "empty_generation": (item, Case(["", search, answer], 4, 3, "answer", 0.0)),
        "turn_limit": (item, Case([search, search, answer], 2, 2, "turn_limit", 0.0)),
        "two_objectives": (multi, Case([search, answer.replace(gold, multi.golden_answers[0])], 4, 2, "answer", 1.0)),
    }


@pytest.fixture(scope="module")
def setup(tiny_policy, tiny_world):  # noqa: F811
    from transformers import AutoTokenizer

    from mempo.datasets import load_qa
    from mempo.tasks import compose_multi_objective

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    items = load_qa(tiny_world / "qa" / "train.jsonl")
    multi = compose_multi_objective(items[1:5], k=2, n_tasks=1, seed=0)[0]
    assert len(multi.objectives) == 2 and ";" in multi.golden_answers[0]
    return tok, _cases(items[0], multi)


def _verl_kwargs(item: Task) -> dict:
    extra = {"question": item.question}
    if item.k > 1:
        extra["objectives"] = [{"question": o.question, "golden_answers": list(o.answers)} for o in item.objectives]
    return {"raw_prompt": build_messages(item.question), "extra_info": extra,
            "reward_model": {"ground_truth": list(item.golden_answers), "style": "rule"}}


@pytest.mark.parametrize("name", ["valid", "invalid_turn", "malformed_answer", "empty_generation", "turn_limit",
                                  "two_objectives"])
def test_local_and_verl_drivers_agree(setup, tiny_policy, tiny_world, name):  # noqa: F811
    tok, cases = setup
    item, case = cases[name]
    script = [tok.encode(t, add_special_tokens=False) for t in case.texts]

    server = ScriptedIdsServer(tok, script)
    loop = make_mem_agent_loop(tiny_policy, tiny_world, server, max_turns=case.max_turns, eps="full_context")
    kwargs = _verl_kwargs(item)
    outs = asyncio.run(loop.run({"temperature": 1.0}, **kwargs))

    env = loop.tool.env()  # the same retrieval tool for the local driver
    local = {ctx: asyncio.run(run_episode(item, GeneratorPolicy(ScriptedGenerator(script), SamplingParams()), env,
                                          tok, ctx, RolloutConfig(max_turns=case.max_turns)))
             for ctx in ("memory", "full")}
    ep = local["memory"]

    # termination: same turns played, same reason, same outcome
    n_turns = len(ep.turns)
    assert n_turns == len(outs) == len(server.calls) == case.turns
    last = outs[-1].extra_fields
    assert last["mempo_termination"] == case.termination
    assert ep.hit_turn_limit == (case.termination == "turn_limit")
    assert last["mempo_final_answer"] == ep.final_answer
    assert last["mempo_format_valid"] == ep.format_valid
    # R^T: the local Episode's and verl's reward entry on what verl hands it (extra_info
    # updated with the last output's extra_fields, as verl's reward manager does)
    final_text = tok.decode(outs[-1].response_ids, skip_special_tokens=True)
    verl_r = compute_score("world", final_text, kwargs["reward_model"]["ground_truth"],
                           {**kwargs["extra_info"], **last})
    assert ep.outcome_reward() == verl_r == case.reward

    for rec, out in zip(ep.turns, outs, strict=True):
        ef = out.extra_fields
        assert out.prompt_ids == rec.prompt_ids
        trained = [i for i, m in zip(out.response_ids, out.response_mask, strict=True) if m]
        assert trained == rec.response_ids == script[rec.turn_index]
        assert [m for m, r in zip(ef["mem_mask"], out.response_mask, strict=True) if r] == rec.mem_mask
        assert ef["memory"] == (rec.memory or "")
        assert ef["turn_valid"] == rec.valid and ef["action"] == (rec.action or "")
        assert ef["tool_called"] == (rec.valid and rec.action in ("search", "access"))
        assert rec.parsed.mem == rec.memory and rec.parsed.valid == rec.valid  # the kept parse
    assert len(server.script) == len(case.texts) - case.turns  # nothing generated after the end
    if name in ("empty_generation", "invalid_turn", "malformed_answer") and n_turns > 1:
        bad = next(t.turn_index for t in ep.turns if not t.valid)
        assert "not in the required format" in tok.decode(ep.turns[bad + 1].prompt_ids)
    if name == "empty_generation":
        assert ep.turns[0].response_ids == [] and outs[0].response_mask == [0]

    # memory records: verl's probes of P(a* | q, mem_t) and of the full history before turn t
    # are the local trainer's (the same probe functions over the local episode's records)
    gold = item.golden_answers[0]
    n = len(ep.turns)
    mem_probes = [memory_probe(tok, item.question, t.memory, gold) for t in ep.turns]
    full_probes = [full_context_probe(tok, full_context_messages(ep, t), gold) for t in range(n)]
    assert server.probe_calls[:n] == [p.prompt_ids + p.answer_ids for p in mem_probes]
    assert server.probe_calls[n:] == [p.prompt_ids + p.answer_ids for p in full_probes]

    # full context vs memory context: the same generations in the Search-R1 context play the
    # same turns, and each full-context prompt is the history the memory reward compares with
    full = local["full"]
    assert [t.response_ids for t in full.turns] == [t.response_ids for t in ep.turns]
    assert [t.observation for t in full.turns] == [t.observation for t in ep.turns]
    assert full.outcome_reward() == ep.outcome_reward() and full.hit_turn_limit == ep.hit_turn_limit
    for t, rec in enumerate(full.turns):
        assert rec.prompt_ids == tok.encode(render_prompt(tok, full_context_messages(ep, t)), add_special_tokens=False)


def test_episode_steps_order_and_rules(setup):
    """The step itself: a tool request waits for its observation; a closed but invalid
    <answer> ends the episode with its answer and an invalid format; nothing comes after."""
    from mempo.agent.context import MemoryContext
    from mempo.agent.step import EpisodeSteps, ToolRequest

    tok, _ = setup
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    episode = EpisodeSteps(MemoryContext("Who?"), max_turns=3)
    step = episode.take(ids("<mem> m </mem> <search> x </search>"), tok)
    assert step.request == ToolRequest("search", "x") and episode.awaiting_tool and not episode.finished
    with pytest.raises(RuntimeError):
        episode.take(ids("<mem> m </mem> <answer> a </answer>"), tok)  # the search is not observed yet
    episode.observe("<information> found r </information>")
    assert "found r" in episode.messages()[1]["content"]
    step = episode.take(ids("<mem> m </mem> <answer> a </answer> and more"), tok)
    assert step.answers and not step.parsed.valid and step.request is None and step.observation is None
    assert (episode.termination, episode.final_answer, episode.format_valid) == ("answer", "a", False)
    with pytest.raises(RuntimeError):
        episode.take(ids("<mem> m </mem> <answer> b </answer>"), tok)
