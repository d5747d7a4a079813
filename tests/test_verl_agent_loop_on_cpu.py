"""`mem_agent` on CPU: verl instantiates it from its registry, a fake server manager plays
scripted turns with the tiny tokenizer, the retrieval BaseTool searches the tiny world for
real, and each turn's output has the flat prompt, the response mask and the mem mask."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from verl_cpu_helpers import ScriptedServer, compose_mempo_config, tiny_policy  # noqa: F401
from verl_cpu_helpers import make_mem_agent_loop as _make_loop

from mempo.agent.context import MemoryContext
from mempo.agent.format import build_messages, invalid_turn_observation, parse_turn, render_prompt


def _first_question(world: Path) -> dict:
    with open(world / "qa" / "train.jsonl", encoding="utf-8") as f:
        return json.loads(f.readline())


@pytest.fixture(scope="module")
def episode(tiny_policy, tiny_world):  # noqa: F811
    """One scripted 4-turn episode: search, an invalid turn, access, answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    qa = _first_question(tiny_world)
    subject = qa["metadata"]["subjects"][0]
    hop = qa["metadata"]["chain"][0]
    answer = qa["golden_answers"][0]
    turns = [
        f"<mem> nothing found yet </mem> <think> find {subject} </think> <search> {subject} born </search>",
        "<think> forgot my memory </think> <search> nowhere </search>",
        f"<mem> {subject} was born in {hop['value']} </mem> <think> read it </think> <access> {hop['value']} </access>",
        f"<mem> the mayor of {hop['value']} is {answer} </mem> <think> done </think> <answer> {answer} </answer>",
    ]
    # junk after each stop string must be cut off, exactly as SGLang stops at </search>
    server = ScriptedServer(tok, turns, model=model, trailing=" trailing junk")
    loop = _make_loop(tiny_policy, tiny_world, server)
    kwargs = {"raw_prompt": build_messages(qa["question"]), "extra_info": {"question": qa["question"]},
              "reward_model": {"ground_truth": qa["golden_answers"], "style": "rule"}}
    outputs = asyncio.run(loop.run({"temperature": 1.0, "top_p": 1.0, "logprobs": True}, **kwargs))
    return {"outputs": outputs, "server": server, "tok": tok, "model": model, "qa": qa, "turns": turns}


def test_one_output_per_turn_with_masks(episode):
    outs, tok, turns = episode["outputs"], episode["tok"], episode["turns"]
    assert len(outs) == 4
    for t, out in enumerate(outs):
        text = tok.decode(out.response_ids, skip_special_tokens=True)
        assert text == turns[t]  # the junk after the stop string is gone
        assert out.response_mask == [1] * len(out.response_ids)  # no tool tokens inside a turn
        assert out.response_logprobs == [-0.5] * len(out.response_ids)
        assert out.extra_fields["turn_index"] == t
        assert out.extra_fields["global_steps"] == 3  # the server's fields are kept (staleness tags)
        mask = out.extra_fields["mem_mask"]
        assert len(mask) == len(out.response_ids)
        memory = parse_turn(turns[t]).mem
        if memory is None:
            assert sum(mask) == 0 and out.extra_fields["memory"] == ""
        else:
            masked = tok.decode([i for i, m in zip(out.response_ids, mask, strict=True) if m],
                                skip_special_tokens=True)
            assert memory in masked and "think" not in masked
            assert out.extra_fields["memory"] == memory
    assert [o.extra_fields["turn_valid"] for o in outs] == [True, False, True, True]
    assert [o.num_turns for o in outs] == [8] * 4
    # the episode's outcome for the reward, decided by the turn step (no turn texts to re-parse)
    answer = episode["qa"]["golden_answers"][0]
    assert outs[-1].extra_fields["mempo_final_answer"] == answer
    assert outs[-1].extra_fields["mempo_format_valid"] is False  # turn 1 has no <mem>
    assert outs[-1].extra_fields["mempo_termination"] == "answer"
    assert all("mempo_final_answer" not in o.extra_fields for o in outs[:-1])


def test_prompts_hold_only_question_last_memory_and_last_result(episode):
    outs, tok, turns, qa = episode["outputs"], episode["tok"], episode["turns"], episode["qa"]
    calls = episode["server"].calls
    assert len(calls) == 4
    prompts = [tok.decode(c["prompt_ids"], skip_special_tokens=False) for c in calls]
    assert prompts[0] == render_prompt(tok, build_messages(qa["question"]))
    for t in range(4):
        assert calls[t]["prompt_ids"] == outs[t].prompt_ids
        assert qa["question"] in prompts[t]
        assert calls[t]["sampling_params"]["stop"] == ["</search>", "</answer>", "</access>"]
        assert calls[t]["sampling_params"]["max_tokens"] == 64
        assert calls[t]["sampling_params"]["no_stop_trim"] is True  # rollout.name=sglang
    # turn 1 sees turn 0's memory and search with its retrieved passages
    assert "nothing found yet" in prompts[1] and "<information>" in prompts[1]
    assert "Doc 1(Title:" in prompts[1]
    # turn 2 follows the invalid turn: empty memory, the corrective observation, nothing of turn 0
    assert "not in the required format" in prompts[2]
    assert "nothing found yet" not in prompts[2] and "Doc 1(Title:" not in prompts[2]
    # turn 3 sees turn 2's memory and access result only
    born = parse_turn(turns[2]).mem
    assert born in prompts[3] and "[chunk 1/" in prompts[3]
    assert "forgot my memory" not in prompts[3] and "nothing found yet" not in prompts[3]
    # the prompt is exactly MemoryContext's rendering (the local trainer's builder)
    ctx = MemoryContext(qa["question"])
    invalid = parse_turn(turns[1])
    ctx.record_turn(turns[1], invalid, invalid_turn_observation(invalid.error))
    assert prompts[2] == render_prompt(tok, ctx.messages())


def test_memory_scores_match_actor_answer_probability(episode):
    from mempo.advantage import answer_probability
    from mempo.agent.format import ANSWER_PROBE_PREFIX, answer_continuation, answer_probe_messages

    outs, tok, model, qa, turns = (episode[k] for k in ("outputs", "tok", "model", "qa", "turns"))
    prompts = [render_prompt(tok, answer_probe_messages(qa["question"], parse_turn(t).mem), ANSWER_PROBE_PREFIX)
               for t in turns]
    expected = answer_probability(model, tok, prompts, [answer_continuation(qa["golden_answers"][0])] * 4)
    got = torch.tensor([o.extra_fields["mem_prob"] for o in outs])
    torch.testing.assert_close(got, expected.prob, atol=1e-5, rtol=1e-4)
    assert [o.extra_fields["mem_logprob"] for o in outs] == pytest.approx(expected.mean_logprob.tolist(), abs=1e-4)
    # 4 memory probes and, with the default eps=full_context, 4 full-history probes
    assert len(episode["server"].probe_calls) == 8


def test_turn_limit_cuts_the_episode_and_lambda_zero_skips_probes(tiny_policy, tiny_world):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    qa = _first_question(tiny_world)
    turns = [f"<mem> m{t} </mem> <search> q{t} </search>" for t in range(5)]
    server = ScriptedServer(tok, turns)
    loop = _make_loop(tiny_policy, tiny_world, server, max_turns=2, lambda_mem=0)
    outs = asyncio.run(loop.run({"temperature": 1.0}, raw_prompt=build_messages(qa["question"]),
                                reward_model={"ground_truth": qa["golden_answers"]}))
    assert len(outs) == 2 and len(server.calls) == 2
    assert server.probe_calls == [] and all(o.extra_fields["mem_prob"] == 0.0 for o in outs)
    # the question came from the prompt itself (no extra_info)
    assert qa["question"] in tok.decode(outs[0].prompt_ids)


def test_full_context_baseline_adds_full_history_probes(tiny_policy, tiny_world):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    qa = _first_question(tiny_world)
    turns = ["<mem> a </mem> <search> x </search>", f"<mem> b </mem> <answer> {qa['golden_answers'][0]} </answer>"]
    server = ScriptedServer(tok, turns, model=model)
    loop = _make_loop(tiny_policy, tiny_world, server, eps="full_context")
    outs = asyncio.run(loop.run({}, raw_prompt=build_messages(qa["question"]),
                                extra_info={"question": qa["question"]},
                                reward_model={"ground_truth": qa["golden_answers"]}))
    assert len(outs) == 2 and len(server.probe_calls) == 4
    assert all(0.0 < o.extra_fields["full_prob"] < 1.0 for o in outs)
    # turn 0's full history is just the question (= an empty memory's probe minus the memory
    # block); turn 1's holds turn 0's response and observation
    assert len(server.probe_calls[2]) < len(server.probe_calls[0])
    assert len(server.probe_calls[3]) > len(server.probe_calls[1])
    assert "<search> x </search>" in tok.decode(server.probe_calls[3])


def test_retrieval_tool_over_the_real_http_service(tiny_world):
    """The BaseTool against `mempo serve retriever`'s app on 127.0.0.1 (real HTTP)."""
    from mempo.retrieval import InProcessRetriever
    from mempo.retrieval.server import create_app
    from mempo.retrieval.serving import BackgroundServer
    from mempo.verl_plugin.tool import RetrievalTool

    qa = _first_question(tiny_world)
    hop = qa["metadata"]["chain"][0]
    app = create_app(InProcessRetriever.from_corpus(tiny_world / "corpus.jsonl"))

    async def session(url: str) -> tuple:
        tool = RetrievalTool({"type": "native", "retriever": url, "topk": 2, "timeout_s": 30.0})
        iid, _ = await tool.create()
        found = await tool.execute(iid, {"query": f"{hop['entity']} born"})
        first = await tool.execute(iid, {"action": "access", "query": hop["value"]})
        await tool.release(iid)
        return found, first

    with BackgroundServer(app, port=0) as srv:
        (search_resp, _, search_info), (access_resp, _, access_info) = asyncio.run(session(srv.url))
    assert search_info["ok"] and access_info["ok"]
    assert search_resp.text.startswith("<information> Doc 1(Title: ") and "Doc 2(Title: " in search_resp.text
    assert hop["entity"] in search_resp.text
    assert f"Doc(Title: {hop['value']}) [chunk 1/" in access_resp.text
    assert access_info["short_observation"].startswith(f"<information> Doc(Title: {hop['value']}) [1]")


def test_retrieval_tool_timeout_becomes_an_observation():
    """A service that accepts connections but never answers: the call fails within timeout_s
    and the model gets an <information> block saying so, instead of a crashed rollout."""
    import socket

    from mempo.verl_plugin.tool import RetrievalTool

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        tool = RetrievalTool({"type": "native", "retriever": url, "timeout_s": 0.5})

        async def call() -> tuple:
            iid, _ = await tool.create()
            return await tool.execute(iid, {"query": "anything"})

        resp, reward, info = asyncio.run(call())
    assert info["ok"] is False and "Timeout" in info["error"]
    assert resp.text.startswith("<information>") and "timed out" in resp.text
    assert reward == 0.0
    bad, _, bad_info = asyncio.run(tool.execute("x", {"action": "delete", "query": "q"}))
    assert bad_info["ok"] is False and "Invalid tool call" in bad.text


def test_data_stage_parquet_row_through_verls_dataset_drives_the_loop(tiny_policy, tiny_world, tmp_path):  # noqa: F811
    """The data stage's parquet, read by verl's RLHFDataset, gives every field mem_agent and
    the reward need (a 2-objective task: question in extra_info, answers 'a1; a2')."""
    from transformers import AutoTokenizer
    from verl.trainer.ppo.utils import create_rl_dataset

    from mempo.config import load_params
    from mempo.data.prepare import prepare_data
    from mempo.verl_plugin.reward import compute_score

    qa = tiny_world / "qa"
    params = load_params(None, overrides={
        "data.sources": [{"name": "world", "path": str(qa / "train.jsonl"), "split": "train"},
                         {"name": "world", "path": str(qa / "val.jsonl"), "split": "val"}],
        "data.eval_sets": [str(qa / "test.jsonl")], "data.out": str(tmp_path / "data"), "data.gate": False})
    prepare_data(params.data, params.validate)
    tok = AutoTokenizer.from_pretrained(tiny_policy)
    cfg = compose_mempo_config([f"actor_rollout_ref.model.path={tiny_policy}", "data.max_prompt_length=1024",
                                f"data.train_files={tmp_path / 'data' / 'train.parquet'}", "data.val_files=x"])
    dataset = create_rl_dataset(cfg.data.train_files, cfg.data, tok, None, is_train=True)
    row = next(dataset[i] for i in range(len(dataset)) if dataset[i]["extra_info"]["k"] == 2)
    assert row["agent_name"] == "mem_agent"
    gold = row["reward_model"]["ground_truth"]["target"][0]
    assert ";" in gold  # "a1; a2"
    turns = ["<mem> none yet </mem> <search> first part </search>",
             f"<mem> both found </mem> <think> done </think> <answer> {gold} </answer>"]
    server = ScriptedServer(tok, turns, model=None)
    server.prompt_logprobs = lambda ids: {"prompt_logprobs": [[-0.25]] * len(ids)}  # a flat model
    loop = _make_loop(tiny_policy, tiny_world, server)
    outs = asyncio.run(loop.run({"temperature": 1.0}, **row))
    assert len(outs) == 2
    assert row["extra_info"]["question"] in tok.decode(outs[0].prompt_ids)
    assert [o.extra_fields["mem_prob"] for o in outs] == pytest.approx([float(torch.tensor(-0.25).exp())] * 2)
    extra = {**row["extra_info"], **outs[-1].extra_fields}
    final = tok.decode(outs[-1].response_ids, skip_special_tokens=True)
    assert compute_score(row["data_source"], final, row["reward_model"]["ground_truth"], extra) == 1.0
    wrong = {**extra, "mempo_final_answer": "nobody; nowhere"}
    assert compute_score(row["data_source"], final, row["reward_model"]["ground_truth"], wrong) == 0.0


class FlakyServer(ScriptedServer):
    """Generation as SGLang returns it when things go wrong: `None` entries in `responses` are
    empty generations without log-probs; `(text, k)` entries came back with only k log-probs
    (an aborted request). Probe requests are slowed and counted in flight."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight = self.max_in_flight = 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        if "prompt_logprobs" in sampling_params:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            await asyncio.sleep(0.005)
            self.in_flight -= 1
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
        item = self.responses[0]
        if item is None:
            self.responses.pop(0)
            return TokenOutput(token_ids=[], log_probs=None, extra_fields={})
        if isinstance(item, tuple):
            self.responses.pop(0)
            ids = self.tokenizer.encode(item[0], add_special_tokens=False)
            return TokenOutput(token_ids=ids, log_probs=[-0.25] * item[1], extra_fields={})
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)


def _flaky_turns(qa: dict) -> list:
    subject, answer = qa["metadata"]["subjects"][0], qa["golden_answers"][0]
    return [None, (f"<mem> m </mem> <think> t </think> <search> {subject} </search>", 3),
            f"<mem> {answer} </mem> <think> done </think> <answer> {answer} </answer>"]


@pytest.mark.parametrize("calculate", [True, False])
def test_empty_and_aborted_generations_keep_the_batch_consistent(tiny_policy, tiny_world, calculate):  # noqa: F811
    """With rollout log-probs on, every turn has one per response token (0.0 where the server
    gave none, counted); with them off, no turn has any. verl's own collation then stacks them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    qa = _first_question(tiny_world)
    server = FlakyServer(tok, _flaky_turns(qa), model=AutoModelForCausalLM.from_pretrained(tiny_policy).eval())
    loop = _make_loop(tiny_policy, tiny_world, server,
                      extra_overrides=(f"actor_rollout_ref.rollout.calculate_log_probs={str(calculate).lower()}",))
    kwargs = {"raw_prompt": build_messages(qa["question"]), "extra_info": {"question": qa["question"]},
              "reward_model": {"ground_truth": qa["golden_answers"], "style": "rule"}}
    outs = asyncio.run(loop.run({"temperature": 1.0, "top_p": 1.0, "logprobs": calculate}, **kwargs))
    assert len(outs) == 3 and all(isinstance(o, AgentLoopOutput) for o in outs)
    if not calculate:
        assert all(o.response_logprobs is None for o in outs)
        return
    for o in outs:
        assert len(o.response_logprobs) == len(o.response_ids)
    assert outs[0].response_ids == [tok.eos_token_id or 0] and outs[0].response_logprobs == [0.0]
    assert outs[0].response_mask == [0]  # the EOS only fills the row: an empty turn trains nothing
    assert outs[0].extra_fields["logprobs_filled"] == 1
    assert outs[1].response_logprobs[:3] == [-0.25] * 3
    assert outs[1].extra_fields["logprobs_filled"] == len(outs[1].response_ids) - 3
    assert outs[2].extra_fields["logprobs_filled"] == 0
    assert [o.extra_fields["tool_called"] for o in outs] == [False, True, False]
    # verl's TransferQueue field: a rollout_log_probs tensor for every row (as_dict drops it when None)
    assert all("rollout_log_probs" in o.as_dict() for o in outs)


def test_align_logprobs():
    from mempo.verl_plugin.agent_loop import align_logprobs

    assert align_logprobs([-1.0, -2.0, -3.0], 2, True) == ([-1.0, -2.0], 0)
    assert align_logprobs(None, 2, True) == ([0.0, 0.0], 2)
    assert align_logprobs([-1.0], 3, True) == ([-1.0, 0.0, 0.0], 2)
    assert align_logprobs([-1.0], 3, False) == (None, 0)


def test_memory_probes_are_bounded_per_worker_not_per_episode(tiny_policy, tiny_world):  # noqa: F811
    """Four episodes at once in one worker (one event loop), probe_concurrency=2: never more
    than two probe requests in flight, although each episode alone would allow two."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_policy)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    qa = _first_question(tiny_world)
    subject, answer = qa["metadata"]["subjects"][0], qa["golden_answers"][0]
    turns = [f"<mem> a </mem> <think> t </think> <search> {subject} </search>",
             f"<mem> {answer} </mem> <think> t </think> <answer> {answer} </answer>"]
    server = FlakyServer(tok, turns * 4, model=model)
    # eps=previous: one probe per turn (full_context would add a full-history probe to each)
    loops = [_make_loop(tiny_policy, tiny_world, server, probe_concurrency=2, eps="previous") for _ in range(4)]
    kwargs = {"raw_prompt": build_messages(qa["question"]), "extra_info": {"question": qa["question"]},
              "reward_model": {"ground_truth": qa["golden_answers"], "style": "rule"}}

    async def all_episodes():
        return await asyncio.gather(*(lp.run({"temperature": 1.0, "top_p": 1.0}, **kwargs) for lp in loops))

    results = asyncio.run(all_episodes())
    # the four episodes share the scripted replies, so their lengths vary; 8 turns in all
    assert sum(len(r) for r in results) == 8
    assert len(server.probe_calls) == 8  # one probe per turn
    assert server.max_in_flight == 2
