"""End-to-end evaluation of the tiny (untrained) policy and the scripted teacher on the world.

Real components throughout: a tiny Qwen2 policy built offline, BM25 over the world corpus
in process and behind the real retrieval service on a loopback port, an OpenAI-compatible
completions server on a loopback port, MLflow on a temp sqlite store.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from mempo.config import load_params
from mempo.errors import ConfigError
from mempo.evaluation.agents import AGENTS
from mempo.evaluation.engine import Engine, load_engine
from mempo.evaluation.report import format_value, parse_report_tables
from mempo.evaluation.runner import run_eval


@pytest.fixture(scope="module")
def tiny_policy(tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained tiny Qwen2 policy (BPE tokenizer trained on the tiny world)."""
    from mempo.policy.tiny import TinyPolicySpec, bootstrap_tiny

    out = tmp_path_factory.mktemp("policy") / "tiny"
    bootstrap_tiny(out, tiny_world / "corpus.jsonl", [tiny_world / "qa" / "train.jsonl"],
                   spec=TinyPolicySpec(copy_steps=0))
    return out


@pytest.fixture(scope="module")
def engine(tiny_policy: Path, tiny_world: Path) -> Engine:
    return load_engine(tiny_policy, tiny_policy, retriever=str(tiny_world / "corpus.jsonl"), concurrency=20)


def _params(tiny_world: Path, tiny_policy: Path, out: Path, **eval_over: Any) -> Any:
    over: dict[str, Any] = {
        "eval.model": str(tiny_policy), "eval.retriever": str(tiny_world / "corpus.jsonl"),
        "eval.benchmarks": ["world"], "eval.limit": 20, "eval.out": str(out),
        "eval.rollout.max_new_tokens": 16, "eval.rollout.turns_per_objective": 2, "eval.rollout.max_concurrent_episodes": 20, "eval.mlflow_genai_samples": 0,
        "benchmarks.world": str(tiny_world / "qa" / "test.jsonl"),
    }
    over.update({f"eval.{k}": v for k, v in eval_over.items()})
    return load_params(None, overrides=over)


def _check_outputs(out: Path, agents: list[str], benches: list[str], n: int) -> dict[str, Any]:
    metrics = json.loads((out / "metrics.json").read_text())
    samples = pd.read_parquet(out / "samples.parquet")
    assert len(samples) == n * len(agents) * len(benches)
    assert set(samples["agent"]) == set(agents) and set(samples["benchmark"]) == set(benches)
    for a in agents:
        for b in benches:
            assert metrics[f"{a}/{b}/n"] == n
            part = samples[(samples.agent == a) & (samples.benchmark == b)]
            assert metrics[f"{a}/{b}/em"] == round(part["em"].mean(), 4)
            assert metrics[f"{a}/{b}/peak_prompt_tokens_max"] == part["peak_prompt_tokens"].max()
    # The report prints the numbers of metrics.json, rounded for reading.
    assert parse_report_tables((out / "report.md").read_text()) == {
        k: format_value(v, k.rsplit("/", 1)[1]) for k, v in metrics.items()}
    assert (out / "report.html").read_text().startswith("<!doctype html>")
    assert (out / "plots" / "em_by_benchmark.png").is_file()
    return metrics


def test_eval_tiny_policy_all_agents_in_process(tiny_world: Path, tiny_policy: Path, engine: Engine,
                                                tmp_path: Path) -> None:
    p = _params(tiny_world, tiny_policy, tmp_path / "eval", benchmarks=["world", "world-k2"], limit=5)
    res = run_eval(p.eval, p.benchmarks, engine=engine, track=False)
    metrics = _check_outputs(tmp_path / "eval", list(AGENTS), ["world", "world-k2"], 5)
    assert metrics == json.loads((tmp_path / "eval" / "metrics.json").read_text()) == res.metrics
    samples = pd.read_parquet(tmp_path / "eval" / "samples.parquet")
    # Turn limits: 2 turns per objective -> 2 for world, 4 for world-k2; single-turn agents 1.
    assert samples[samples.agent.isin(["rag", "direct"])]["turns"].eq(1).all()
    assert samples[(samples.agent == "memory") & (samples.benchmark == "world-k2")]["turns"].max() <= 4
    assert samples[samples.agent == "rag"]["searches"].eq(1).all()
    assert samples[samples.agent == "direct"]["searches"].eq(0).all()
    # A first turn never repeats a prompt; single-turn agents have nothing to repeat.
    multi = samples[samples.turns > 0]
    assert (multi["repeated_turns"] < multi["turns"]).all()
    assert samples[samples.agent.isin(["rag", "direct"])]["repeated_turns"].eq(0).all()
    # The multi-objective keys exist only for the k = 2 benchmark.
    assert "memory/world-k2/all_correct" in metrics and "memory/world/all_correct" not in metrics
    # Deterministic: greedy decoding gives the same samples a second time.
    p.eval.agents, p.eval.benchmarks = ["memory", "rag"], ["world"]
    again = run_eval(p.eval, p.benchmarks, engine=engine, track=False)
    cols = ["agent", "benchmark", "id", "prediction", "turns", "peak_prompt_tokens", "transcript"]
    first = [{c: r[c] for c in cols} for r in res.rows if r["agent"] in ("memory", "rag") and r["benchmark"] == "world"]
    assert [{c: r[c] for c in cols} for r in again.rows] == first


def test_eval_runs_with_the_configured_torch_threads(tiny_world: Path, tiny_policy: Path, engine: Engine,
                                                    tmp_path: Path) -> None:
    # eval.threads 1 (the default, as sft/train): 1.4-1.6x faster rollouts of the tiny policy
    # on 2 cores than torch's default of 2 (docs/results.md); 0 keeps what torch has
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        p = _params(tiny_world, tiny_policy, tmp_path / "eval", benchmarks=["world"], limit=2, agents=["direct"])
        assert p.eval.threads == 1
        run_eval(p.eval, p.benchmarks, engine=engine, track=False)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        p.eval.threads = 0
        run_eval(p.eval, p.benchmarks, engine=engine, track=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_eval_scripted_teacher_exercises_memory_search_and_probe(
    tiny_world: Path, tiny_policy: Path, engine: Engine, tmp_path: Path
) -> None:
    from mempo.agent.teacher import ScriptedTeacher

    teacher = Engine(engine.generator, engine.tokenizer, engine.retriever, engine.model,
                     turn_policy=ScriptedTeacher(engine.tokenizer))
    p = _params(tiny_world, tiny_policy, tmp_path / "eval", benchmarks=["world-k1", "world-k4"], limit=8,
                agents=["memory", "full_context", "external_memory"],
                **{"rollout.turns_per_objective": 12, "rollout.max_turns": 64})
    run_eval(p.eval, p.benchmarks, engine=teacher, track=False)
    metrics = _check_outputs(tmp_path / "eval", ["memory", "full_context", "external_memory"],
                             ["world-k1", "world-k4"], 8)
    samples = pd.read_parquet(tmp_path / "eval" / "samples.parquet")
    assert metrics["memory/world-k1/em"] >= 0.5          # the teacher follows the gold chain
    assert metrics["memory/world-k1/searches"] >= 1.0
    assert metrics["memory/world-k1/format_valid"] == 1.0
    assert 0.0 < metrics["memory/world-k1/memory_probe"] < 1.0
    # The memory agent's prompts stay flat; the full-context agent's grow with the turns.
    assert metrics["full_context/world-k4/peak_prompt_tokens"] > 1.5 * metrics["memory/world-k4/peak_prompt_tokens"]
    # Multi-objective scoring of the k = 4 tasks.
    assert 0.0 <= metrics["memory/world-k4/all_correct"] <= metrics["memory/world-k4/objective_em"]
    first = json.loads(samples[samples.agent == "memory"].iloc[0]["transcript"])
    assert first[0]["action"] == "search" and first[0]["titles"] and first[-1]["action"] == "answer"
    assert samples[samples.agent == "memory"].iloc[0]["final_memory"]
    assert (tmp_path / "eval" / "plots" / "em_vs_k.png").is_file()
    # Forgetting is measured for the memory agent on k > 1 tasks only; the teacher never forgets.
    assert metrics["memory/world-k4/forgetting_rate"] == 0.0
    # ... and never comes back to a prompt it had (each turn adds an answer or a result).
    assert metrics["memory/world-k4/repeated_turns"] == 0.0 < metrics["memory/world-k4/turns"]
    assert "memory/world-k1/forgetting_rate" not in metrics and "full_context/world-k4/forgetting_rate" not in metrics
    # The report ends with one example episode per (k, agent), the same task for every agent.
    report = (tmp_path / "eval" / "report.md").read_text()
    for bench in ("world-k1", "world-k4"):
        for agent in ("memory", "full_context", "external_memory"):
            assert f"### {bench} · {agent}" in report
    first_k4 = samples[(samples.agent == "memory") & (samples.benchmark == "world-k4")].iloc[0]
    assert first_k4["question"][:60] in report and "| turn | memory | action | titles found |" in report


def test_truncation_path_scores_wrong(tiny_world: Path, tiny_policy: Path, engine: Engine, tmp_path: Path) -> None:
    from mempo.agent.teacher import ScriptedTeacher

    teacher = Engine(engine.generator, engine.tokenizer, engine.retriever, engine.model,
                     turn_policy=ScriptedTeacher(engine.tokenizer))
    from mempo.agent.format import build_messages, render_prompt
    from mempo.datasets import load_qa
    from mempo.evaluation.agents import single_turn_messages

    # Room for the first prompt (question only) but not for a prompt with a search result.
    tok = engine.tokenizer
    question_only = max(len(tok.encode(render_prompt(tok, msgs), add_special_tokens=False))
                        for q in load_qa(tiny_world / "qa" / "test.jsonl")
                        for msgs in (build_messages(q.question), single_turn_messages(q.question, None)))
    p = _params(tiny_world, tiny_policy, tmp_path / "eval", limit=6, agents=["memory", "rag", "direct"],
                **{"rollout.turns_per_objective": 8, "rollout.max_prompt_tokens": question_only + 16})
    res = run_eval(p.eval, p.benchmarks, engine=teacher, track=False)
    mem = [r for r in res.rows if r["agent"] == "memory"]
    assert all(r["truncated"] == 1.0 and r["em"] == 0.0 and r["error"] == "context window exceeded" for r in mem)
    assert all(r["turns"] == 1 for r in mem)           # stopped before the second prompt
    rag = [r for r in res.rows if r["agent"] == "rag"]
    assert all(r["truncated"] == 1.0 and r["em"] == 0.0 and r["generated_tokens"] == 0 for r in rag)
    assert res.metrics["memory/world/truncated"] == 1.0
    assert res.metrics["direct/world/truncated"] == 0.0


def test_missing_benchmark_file_errors_before_loading_the_model(tiny_world: Path, tmp_path: Path) -> None:
    p = _params(tiny_world, tmp_path / "no-model", tmp_path / "eval", benchmarks=["world", "hotpotqa"])
    with pytest.raises(ConfigError, match="benchmarks.hotpotqa"):
        run_eval(p.eval, p.benchmarks, track=False)
    assert not (tmp_path / "eval").exists()


def test_eval_through_the_http_retrieval_service_with_mlflow(
    tiny_world: Path, tiny_policy: Path, engine: Engine, tmp_path: Path, mlflow_uri: str
) -> None:
    import mlflow

    from mempo.retrieval import open_retriever
    from mempo.retrieval.server import create_app
    from mempo.retrieval.serving import BackgroundServer

    backing = open_retriever(str(tiny_world / "corpus.jsonl"))
    with BackgroundServer(create_app(backing, manifest=backing.manifest)) as srv:
        p = _params(tiny_world, tiny_policy, tmp_path / "eval", retriever=srv.url, limit=20,
                    agents=["memory", "rag"], mlflow_genai_samples=4)
        http_engine = load_engine(tiny_policy, tiny_policy, retriever=srv.url, concurrency=20)
        res = run_eval(p.eval, p.benchmarks, engine=http_engine, track=True)
        http_engine.retriever.close()
    local = run_eval(p.eval, p.benchmarks, engine=engine, track=False)
    # Same passages through HTTP as in process -> identical samples.
    assert [r["transcript"] for r in res.rows] == [r["transcript"] for r in local.rows]
    _check_outputs(tmp_path / "eval", ["memory", "rag"], ["world"], 20)
    run = mlflow.get_run(res.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["memory/world/em"] == res.metrics["memory/world/em"]
    names = {a.path for a in mlflow.MlflowClient().list_artifacts(res.run_id)}
    assert {"metrics.json", "report.md", "report.html", "samples.parquet", "plots"} <= names
    children = mlflow.search_runs(filter_string=f"tags.mlflow.parentRunId = '{res.run_id}'", output_format="list")
    assert {c.info.run_name for c in children} == {"genai-memory", "genai-rag"}
    for c in children:
        agent = c.info.run_name.removeprefix("genai-")
        first4 = [r["em"] for r in res.rows if r["agent"] == agent][:4]
        assert math.isclose(c.data.metrics["em/mean"], sum(first4) / 4, abs_tol=1e-9)


def test_openai_backend_against_a_loopback_completions_server(
    tiny_world: Path, tiny_policy: Path, engine: Engine, tmp_path: Path
) -> None:
    from mempo.evaluation.openai_server import serve_completions

    p = _params(tiny_world, tiny_policy, tmp_path / "eval", limit=3, agents=["memory", "direct"],
                backend="openai", served_model="tiny")
    with serve_completions(tiny_policy, served_name="tiny") as url:
        p.eval.openai_url = url
        res = run_eval(p.eval, p.benchmarks, track=False)
    assert res.meta["backend"] == "openai"
    local = run_eval(p.eval.model_copy(update={"backend": "hf", "out": str(tmp_path / "hf")}),
                     p.benchmarks, engine=engine, track=False)
    # Greedy decoding of the same weights: the server's answers equal the in-process ones.
    assert [r["transcript"] for r in res.rows] == [r["transcript"] for r in local.rows]
    assert all(math.isnan(r["memory_probe"]) for r in res.rows)   # no local model: no probe


def test_ask_prints_memory_search_titles_and_answer(tiny_world: Path, engine: Engine) -> None:
    from mempo.agent.rollout import RolloutConfig, run_episodes
    from mempo.agent.teacher import ScriptedTeacher
    from mempo.agent.tools import ToolEnv
    from mempo.datasets import load_qa
    from mempo.evaluation.ask import ask, format_episode
    from mempo.evaluation.settings import EvalSettings

    item = load_qa(tiny_world / "qa" / "test.jsonl")[0]
    # The teacher needs the item's gold chain, which `ask` does not have: run its episode directly.
    ep = run_episodes([item], ScriptedTeacher(engine.tokenizer), ToolEnv(engine.retriever, engine.tokenizer),
                      engine.tokenizer, config=RolloutConfig(max_turns=8), progress=False)[0]
    text = format_episode(ep, gold=item.golden_answers)
    assert "Turn 1" in text and "memory:" in text and "search:" in text and "retrieved:" in text
    assert f"Final answer: {ep.final_answer}" in text and "EM 1" in text
    # `ask` itself, with the untrained policy: one episode, its turns printed, no answer.
    untrained = ask(item.question, engine, EvalSettings.from_params(load_params(
        None, {"eval.rollout.turns_per_objective": 2, "eval.rollout.max_new_tokens": 16}).eval), gold=item.golden_answers)
    assert untrained.num_turns == 2 and untrained.hit_turn_limit
    assert "No answer within 2 turns" in format_episode(untrained)


def test_cli_eval_and_ask_with_a_registry_reference(
    tiny_world: Path, tiny_policy: Path, tmp_path: Path, mlflow_uri: str,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlflow

    from mempo.cli import main
    from mempo.registry.register import register_model

    monkeypatch.setenv("MEMPO_PROJECT_ROOT", str(tmp_path))
    metrics = tmp_path / "m.json"
    metrics.write_text(json.dumps({"memory/world/em": 0.0}))
    reg = register_model("tiny-agent", tiny_policy, metrics)
    mlflow.MlflowClient().set_registered_model_alias("tiny-agent", "champion", reg.version)
    common = ["--retriever", str(tiny_world / "corpus.jsonl")]
    sets = ["--set", f"benchmarks.world={tiny_world / 'qa' / 'test.jsonl'}", "--set", "eval.rollout.max_new_tokens=8",
            "--set", "eval.mlflow_genai_samples=0"]
    rc = main([*sets, "eval", "--model", "models:/tiny-agent@champion", "--benchmarks", "world",
               "--agents", "direct", "rag", "--limit", "3", "--out", str(tmp_path / "eval"), *common, "--no-track"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "report:" in out and "direct" in out
    meta = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert (meta["model"], meta["model_name"], meta["model_version"]) == ("models:/tiny-agent@champion", "tiny-agent", reg.version)
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["direct/world/n"] == 3

    rc = main([*sets, "ask", "Who founded Quaevzawick?", "--model", "models:/tiny-agent/1", "--max-turns", "1", *common])
    assert rc == 0 and "Turn 1" in capsys.readouterr().out

    rc = main([*sets, "eval", "--model", "models:/tiny-agent@nope", "--agents", "direct", *common, "--no-track"])
    assert rc == 2 and "no model 'tiny-agent' with alias 'nope'" in capsys.readouterr().err
    rc = main([*sets, "eval", "--model", str(tiny_policy), "--benchmarks", "musique", *common, "--no-track"])
    err = capsys.readouterr().err
    assert rc == 2 and "benchmarks.musique" in err and "no file is configured" in err


def test_each_agent_runs_its_own_policy_and_cross_format_rows_are_apart(
    tiny_world: Path, tiny_policy: Path, tmp_path: Path
) -> None:
    # Two trained policies, each for its own format (policy.json records the context).
    import shutil

    mem_dir, full_dir = tmp_path / "mem", tmp_path / "full"
    for d, ctx in ((mem_dir, "memory"), (full_dir, "full")):
        shutil.copytree(tiny_policy, d)
        (d / "policy.json").write_text(json.dumps({"kind": "grpo", "context": ctx}))
    p = _params(tiny_world, mem_dir, tmp_path / "eval", limit=2, **{"rollout.turns_per_objective": 1},
                agents=["memory", "full_context", "rag"], models={"full_context": str(full_dir)})
    res = run_eval(p.eval, p.benchmarks, track=False)
    policy_of = {r["agent"]: r["policy"] for r in res.rows}
    assert policy_of == {"memory": str(mem_dir), "full_context": str(full_dir), "rag": str(mem_dir)}
    eval_json = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert eval_json["policies"]["full_context"] == {"model": str(full_dir), "trained_context": "full",
                                                     "agent_context": "full"}
    report = (tmp_path / "eval" / "report.md").read_text()
    own, cross = report.split("## EM: trained policies, each in its own format")[1].split(
        "## EM: cross-format rows")
    assert "| memory |" in own and "| full_context |" in own and "| rag |" not in own
    assert "| rag |" in cross.split("## world")[0]
    # A policy for another format is refused nowhere, only labelled: memory on the full policy is cross-format.
    p.eval.models = {"memory": str(full_dir)}
    p.eval.agents = ["memory"]
    run_eval(p.eval, p.benchmarks, track=False)
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "| memory |" in report.split("## EM: cross-format rows")[1].split("## world")[0]
