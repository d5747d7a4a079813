"""`benchmarks/learning.py`'s summary on hand-built job results: per-variant seeds (the
full-history variant may run fewer), paired differences only on the seeds both ran."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from benchmark_helpers import load_benchmark

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def learning():
    return load_benchmark("learning")


def _job(values: dict[str, list[float]], curve_reward: float = 0.5, **curve: float) -> dict:
    """A job result whose per-task objective EM on each set is `values[bench]` (`curve`: more
    keys of every training-curve row)."""
    ev = {}
    for bench, vals in values.items():
        per = {f"t{i}": {"em": v, "objective_em": v, "forgetting_rate": None} for i, v in enumerate(vals)}
        agg = {"n": len(vals), "em": sum(vals) / len(vals), "objective_em": sum(vals) / len(vals)}
        ev[bench] = {"aggregate": agg, "per_task": per}
    return {"eval": ev, "mean_time_step": 1.0, "mem_scoring_share": 0.0,
            "curve": [{"step": i + 1, "reward_mean": curve_reward, **curve} for i in range(3)]}


def test_paired_differences_use_the_seeds_both_variants_ran(learning, tmp_path):
    a = learning._args(["--seeds", "0", "1", "2", "--full-seeds", "0", "--variants", "grpo", "mempo", "full",
                        "--rl-steps", "3", "--bootstrap", "200", "--workdir", str(tmp_path)])
    assert learning.seeds_of(a, "mempo") == [0, 1, 2] and learning.seeds_of(a, "full") == [0]
    sets = ("single", "k2", "k4")
    results = {"untrained": _job({b: [0.0, 0.0] for b in sets}), "sft-memory": _job({b: [0.0, 1.0] for b in sets}),
               "sft-full": _job({b: [0.0, 1.0] for b in sets})}
    for s in range(3):
        results[f"rl-grpo-seed{s}"] = _job({b: [0.0, 0.0] for b in sets})
        results[f"rl-mempo-seed{s}"] = _job({b: [1.0, 0.0] for b in sets})  # +0.5 over grpo on every seed
    results["rl-full-seed0"] = _job({b: [1.0, 1.0] for b in sets})  # mempo - full = -0.5 on seed 0
    out = learning.summarise(a, results)
    assert out["config"]["seeds"] == {"grpo": [0, 1, 2], "mempo": [0, 1, 2], "full": [0]}
    assert out["paired"]["mempo_minus_grpo"]["seeds"] == [0, 1, 2]
    d = out["paired"]["mempo_minus_grpo"]["k2/objective_em"]
    assert d["mean"] == pytest.approx(0.5) and d["seeds"] == 3
    f = out["paired"]["mempo_minus_full"]
    assert f["seeds"] == [0] and f["k4/em"]["mean"] == pytest.approx(-0.5)
    assert out["results"]["full"]["k2"]["em"]["per_seed"] == [1.0]
    assert len(out["results"]["mempo"]["k2"]["em"]["per_seed"]) == 3
    # jobs from before the outcome shares: none reported rather than a partial mean
    assert out["results"]["mempo"]["k2"]["outcomes"] is None
    learning.print_table(out)  # the table skips the seed lists


def test_the_gain_at_k4_minus_the_gain_at_k2_is_paired_by_seed(learning, tmp_path):
    a = learning._args(["--seeds", "0", "1", "--variants", "grpo", "mempo", "--rl-steps", "3", "--bootstrap", "100",
                        "--workdir", str(tmp_path)])
    sets = ("single", "k2", "k4")
    results = {k: _job({b: [0.0, 0.0] for b in sets}) for k in ("untrained", "sft-memory", "sft-full")}
    for s in range(2):
        results[f"rl-grpo-seed{s}"] = _job({b: [0.0, 0.0] for b in sets})
        # +0.5 at k2 on both seeds; at k4 +1.0 on seed 0 and +0.5 on seed 1
        results[f"rl-mempo-seed{s}"] = _job({"single": [0.0, 0.0], "k2": [1.0, 0.0], "k4": [1.0, 1.0 - s]})
    d = learning.summarise(a, results)["paired"]["mempo_minus_grpo"]["k4_minus_k2/objective_em"]
    assert d["mean"] == pytest.approx(0.25) and d["seeds"] == 2
    assert d["ci95_low"] == pytest.approx(0.0) and d["ci95_high"] == pytest.approx(0.5)


def test_per_k_training_curves_average_over_seeds_and_get_their_own_plot(learning, tmp_path):
    a = learning._args(["--seeds", "0", "1", "--variants", "grpo", "mempo", "--rl-steps", "3", "--bootstrap", "50",
                        "--workdir", str(tmp_path)])
    sets = ("single", "k2", "k4")
    results = {"untrained": _job({b: [0.0] for b in sets}), "sft-memory": _job({b: [0.0] for b in sets}),
               "sft-full": _job({b: [0.0] for b in sets})}
    for s in range(2):
        results[f"rl-grpo-seed{s}"] = _job({b: [0.0] for b in sets}, em_k1=0.5, em_k2=0.1 * (s + 1), em_k4=0.1 * s)
        results[f"rl-mempo-seed{s}"] = _job({b: [0.0] for b in sets}, em_k1=0.5)  # no k=2 task in any batch
    out = learning.summarise(a, results)
    assert out["curves"]["grpo"][0]["em_k2"] == pytest.approx(0.15)
    assert out["curves"]["grpo"][1]["em_k4"] == pytest.approx(0.05)  # a mixture with k=4 tasks (--rl-mix)
    assert "em_k2" not in out["curves"]["mempo"][0] and out["curves"]["mempo"][2]["em_k1"] == 0.5
    learning.plots(out, tmp_path / "learning.json")
    assert (tmp_path / "learning_curves_per_k.png").stat().st_size > 0
    for r in results.values():
        for row in r["curve"]:
            row.pop("em_k1", None), row.pop("em_k2", None), row.pop("em_k4", None)
    learning.plots(learning.summarise(a, results), tmp_path / "plain" / "learning.json")
    assert not (tmp_path / "plain" / "learning_curves_per_k.png").exists()  # a study without per-k rows


def test_an_rl_runs_curve_keeps_the_per_k_values_of_the_ks_its_mixture_has(learning, tmp_path):
    rows = [{"step": 1, "reward_mean": 0.5, "em": 0.5, "em_k1": 0.6, "em_k4": 0.25, "format_valid_k4": 1.0,
             "loss": 3.0},
            {"step": 2, "reward_mean": 0.7, "em": 0.7, "em_k1": 0.7}]  # no k=4 task in this step's batch
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = learning.curve_rows(tmp_path)
    assert got[0]["em_k4"] == 0.25 and got[0]["format_valid_k4"] == 1.0 and "em_k2" not in got[0]
    assert "em_k4" not in got[1] and got[1]["reward_mean"] == 0.7 and got[1]["kl"] is None
    assert "loss" not in got[0]  # what the study does not report stays in history.jsonl


def test_the_study_evaluates_with_the_eval_stages_own_code(learning, tiny_world: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`evaluate_model` is `mempo eval`'s `evaluate_items` (params.yaml `eval:`, greedy, no
    probe) aggregated per set: the study reports the eval stage's numbers, per task and per set.
    (Short turns here: an untrained policy runs every episode to the turn cap.)"""
    from mempo.evaluation.agent_runner import evaluate_items
    from mempo.evaluation.engine import load_engine
    from mempo.evaluation.metrics import aggregate_pair
    from mempo.evaluation.settings import EvalSettings
    from mempo.policy import TinyPolicySpec, bootstrap_tiny

    policy, corpus = tmp_path / "policy", tiny_world / "corpus.jsonl"
    bootstrap_tiny(policy, corpus, [tiny_world / "qa" / "train.jsonl"],
                   spec=TinyPolicySpec(vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=1,
                                       num_heads=2, num_kv_heads=1, seed=1, copy_steps=0))
    params = learning._params
    short = {"eval.rollout.max_new_tokens": 24, "eval.rollout.turns_per_objective": 2, "eval.rollout.max_turns": 4}
    monkeypatch.setattr(learning, "_params", lambda over: params({**short, **over}))
    a = learning._args(["--eval-single", "3", "--eval-k2", "2", "--workdir", str(tmp_path)])
    tasks = {b: v for b, v in learning.test_tasks(tiny_world, a).items() if b != "k4"}
    assert [len(v) for v in tasks.values()] == [3, 2]

    ev = learning.evaluate_model(policy, "memory", tasks, corpus, "cpu")

    p = learning._params({"eval.memory_probe": False, "eval.rollout.max_concurrent_episodes": 64})
    engine = load_engine(policy, policy, retriever=str(corpus), concurrency=64, load_model_for_probe=False)
    try:
        rows = evaluate_items(tasks, ["memory"], engine, EvalSettings.from_params(p.eval))
    finally:
        engine.retriever.close()
    for bench, items in tasks.items():
        part = [r for r in rows if r["benchmark"] == bench]
        agg = ev[bench]["aggregate"]
        # the study's own mean; wall-clock time; the outcome shares (checked below)
        wall = ("mean_prompt_tokens", "latency_s", "outcomes")
        assert {k: v for k, v in agg.items() if k not in wall} == {
            k: v for k, v in aggregate_pair(part).items() if k not in wall}
        assert agg["mean_prompt_tokens"] == pytest.approx(
            sum(n for r in part for n in r["prompt_tokens_by_turn"]) / sum(len(r["prompt_tokens_by_turn"]) for r in part))
        assert list(ev[bench]["per_task"]) == [it.id for it in items]
        assert {t: d["em"] for t, d in ev[bench]["per_task"].items()} == {r["id"]: r["em"] for r in part}
    # what the study reports per set exists: EM, objective EM / all-correct / forgetting on k > 1
    assert {"em", "format_valid", "peak_prompt_tokens", "turns", "mean_prompt_tokens"} <= set(ev["single"]["aggregate"])
    assert ev["k2"]["aggregate"]["turns"] > 1  # episodes of more than one turn, up to the cap of 4
    from mempo.evaluation.outcomes import outcome_shares
    assert {b: ev[b]["aggregate"]["outcomes"] for b in tasks} == {
        b: outcome_shares(r for r in rows if r["benchmark"] == b) for b in tasks}
    assert {"objective_em", "all_correct", "forgetting_rate"} <= set(ev["k2"]["aggregate"])
    assert all(d["objective_em"] is None for d in ev["single"]["per_task"].values())


def test_from_pipeline_reads_a_finished_run_and_names_what_is_missing(learning, tmp_path: Path) -> None:
    """`--from-pipeline ROOT` takes the world, RL data, policy and both SFT checkpoints from a
    finished `make run` at params.yaml's paths; a missing one stops the study with its path."""
    a = learning._args(["--from-pipeline", str(tmp_path), "--workdir", str(tmp_path / "bench")])
    assert a.workdir == tmp_path / "bench" / "pipeline"  # its cache is not the self-trained study's
    with pytest.raises(SystemExit, match=r"sft-full: .*outputs/sft_full/model"):
        learning.pipeline_inputs(tmp_path)
    p = learning._params({})
    for rel in (p.sft.world, p.data.out, p.policy.out, f"{p.sft.out}/model", "outputs/sft_full/model"):
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
    (tmp_path / p.sft.world / "corpus.jsonl").write_text("")
    (tmp_path / p.sft.out / "metrics.json").write_text("{}")
    # the SFT metrics are read only when the SFT jobs finish: a missing file is named up front
    with pytest.raises(SystemExit, match=r"sft-full-metrics: .*outputs/sft_full/metrics.json"):
        learning.pipeline_inputs(tmp_path)
    (tmp_path / "outputs/sft_full/metrics.json").write_text("{}")
    inputs = learning.pipeline_inputs(tmp_path)
    assert inputs["sft-memory"] == tmp_path / p.sft.out / "model"
    assert inputs["data"] == tmp_path / p.data.out and inputs["corpus"].name == "corpus.jsonl"


def test_a_study_of_memory_format_variants_needs_and_reports_no_full_history_start(learning, tmp_path: Path) -> None:
    """--variants mempo_retain: only the memory SFT start is required (a pipeline whose
    full-history SFT stage still runs will do), evaluated and recorded; with `full` both are."""
    a = learning._args(["--from-pipeline", str(tmp_path), "--variants", "mempo_retain", "--seeds", "0",
                        "--rl-steps", "3", "--bootstrap", "50", "--workdir", str(tmp_path / "bench")])
    assert learning.start_formats(a) == ["memory"]
    assert learning.start_formats(learning._args(["--variants", "grpo", "full"])) == ["memory", "full"]
    p = learning._params({})
    for rel in (p.sft.world, p.data.out, p.policy.out, f"{p.sft.out}/model"):
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
    (tmp_path / p.sft.world / "corpus.jsonl").write_text("")
    (tmp_path / p.sft.out / "metrics.json").write_text("{}")
    inputs = learning.pipeline_inputs(tmp_path, learning.start_formats(a))
    assert "sft-memory" in inputs and not any(k.startswith("sft-full") for k in inputs)
    with pytest.raises(SystemExit, match="sft-full"):
        learning.pipeline_inputs(tmp_path, ["memory", "full"])
    sets = ("single", "k2", "k4")
    results = {"untrained": _job({b: [0.0, 0.0] for b in sets}), "sft-memory": _job({b: [0.0, 1.0] for b in sets}),
               "rl-mempo_retain-seed0": _job({b: [1.0, 1.0] for b in sets})}
    results["sft-memory"]["weights_sha256"] = "abc"
    out = learning.summarise(a, results)
    assert list(out["results"]) == ["untrained", "sft", "mempo_retain"] and out["config"]["start"] == {"memory": "abc"}
    assert out["results"]["mempo_retain"]["k2"]["em"]["mean"] == 1.0 and out["paired"] == {}


def test_outcome_shares_average_over_seeds(learning):
    m = learning.mean_outcomes([{"correct": 0.5, "turn limit": 0.5}, {"correct": 0.25, "wrong": 0.75}])
    assert m == {"correct": 0.375, "wrong": 0.375, "turn limit": 0.25}
    assert learning.mean_outcomes([{"correct": 1.0}, None]) is None


def test_every_rl_variant_is_a_valid_params_override_and_names_its_format(learning):
    """Each variant's keys are accepted by the params model (a misspelt key would fail every
    job of the study an hour in, not here) and set what its name says."""
    from mempo.config import load_params

    for name, (fmt, over) in learning.RL_VARIANTS.items():
        p = load_params(learning.PARAMS, over)
        assert fmt in learning.AGENT_OF_FORMAT, name
        assert (p.rollout.context == "full") == (fmt == "full"), name
    lam = {name: load_params(learning.PARAMS, over).mempo.lambda_mem for name, (_, over) in learning.RL_VARIANTS.items()}
    assert lam["grpo"] == 0.0 and lam["full"] == 0.0 and lam["mempo"] == 1.0 and lam["mempo_half"] == 0.5
    half, full_weight = (load_params(learning.PARAMS, learning.RL_VARIANTS[v][1]).mempo for v in ("mempo_half", "mempo"))
    assert half.model_dump() == {**full_weight.model_dump(), "lambda_mem": 0.5}  # only the weight differs
    half_skip = load_params(learning.PARAMS, learning.RL_VARIANTS["mempo_half_skip"][1]).mempo
    assert half_skip.model_dump() == {**half.model_dump(), "final_memory": "skip"}  # only the closing memory's A^M
    half_closing = load_params(learning.PARAMS, learning.RL_VARIANTS["mempo_half_closing"][1]).mempo
    assert half_closing.model_dump() == {**half.model_dump(), "final_memory": "closing"}
    assert set(learning.DEFAULT_VARIANTS) <= set(learning.RL_VARIANTS)


def test_rl_jobs_run_seed_by_seed_so_a_stopped_study_keeps_pairs(learning):
    a = learning._args(["--variants", "grpo", "mempo_prev", "full", "--seeds", "0", "1", "--full-seeds", "1"])
    jobs = learning.rl_jobs_by_format(a)
    assert [j[1] for j in jobs["memory"]] == ["rl-grpo-seed0", "rl-mempo_prev-seed0", "rl-grpo-seed1",
                                              "rl-mempo_prev-seed1"]
    assert [j[1] for j in jobs["full"]] == ["rl-full-seed1"]


def test_rl_mix_trains_rl_on_another_mixture_in_its_own_workdir(learning, tiny_world: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`--rl-mix 1:1 2:0.5 4:1`: the data stage composes k = 4 RL tasks too, into a workdir of
    its own (the default mixture's cache is not reused), and the study records the mixture."""
    import pandas as pd

    from mempo.data.prepare import prepare_data

    a = learning._args(["--rl-mix", "1:1", "2:0.5", "4:1", "--variants", "grpo", "--workdir", str(tmp_path / "w")])
    assert a.rl_mix == [{"k": 1, "share": 1.0}, {"k": 2, "share": 0.5}, {"k": 4, "share": 1.0}]
    assert a.workdir == tmp_path / "w" / "full-mix-1x1-2x0.5-4x1"
    objectives = {}
    for name, args in (("base", []), ("mix", ["--rl-mix", "1:1", "2:0.5", "4:1"])):
        pd_ = learning._params(learning.data_overrides(learning._args(args), tiny_world, tmp_path / name))
        prepare_data(pd_.data, sft=pd_.sft)
        train = pd.read_parquet(tmp_path / name / "train.parquet")
        objectives[name] = train["extra_info"].map(lambda e: int(e["k"])).value_counts().to_dict()
    assert 4 not in objectives["base"] and objectives["mix"][4] > 0
    assert objectives["mix"][1] == objectives["base"][1] and objectives["mix"][2] == objectives["base"][2]
    for bad, why in ((["2:1", "1:1"], "each k once, in increasing order"), (["4:x"], "not K:SHARE"),
                     (["4:1.5"], r"share in \(0, 1\]")):
        with pytest.raises(SystemExit):
            learning._args(["--rl-mix", *bad])
        assert re.search(why, capsys.readouterr().err)


def test_rl_set_changes_a_params_key_of_every_rl_variant_and_nothing_the_variants_set(
        learning, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--rl-set mempo.multi_rule=mean`: every RL job trains with partial credit, each variant
    keeps its own keys, the study has a workdir of its own; keys the variants or the study set,
    and keys params.yaml does not have, are refused by name before anything runs."""
    a = learning._args(["--rl-set", "mempo.multi_rule=mean", "mempo.format_penalty=0.1", "--variants", "grpo",
                        "mempo_half", "--workdir", str(tmp_path / "w")])
    assert a.rl_set == {"mempo.multi_rule": "mean", "mempo.format_penalty": 0.1}
    assert a.workdir == tmp_path / "w" / "full-set-mempo.multi_rule=mean-mempo.format_penalty=0.1"
    inputs = {"sft-memory": tmp_path / "sft", "data": tmp_path / "data", "corpus": tmp_path / "corpus.jsonl"}
    grpo, half = (learning.rl_params(v, 3, a, inputs) for v in ("grpo", "mempo_half"))
    assert grpo.mempo.multi_rule == half.mempo.multi_rule == "mean" and grpo.mempo.format_penalty == 0.1
    assert (grpo.mempo.lambda_mem, half.mempo.lambda_mem, grpo.train.seed) == (0.0, 0.5, 3)
    plain = learning.rl_params("grpo", 3, learning._args(["--variants", "grpo"]), inputs)
    assert plain.mempo.multi_rule == "all"
    for bad, why in ((["mempo.lambda_mem=1"], "mempo.lambda_mem: set by the study or its variants"),
                     (["train.steps=3"], "train.steps: set by the study"),
                     (["mempo.multi_rul=mean"], "mempo.multi_rul.*unknown key"),
                     (["mempo.multi_rule=most"], "mempo.multi_rule"), (["novalue"], "not KEY=VALUE")):
        with pytest.raises(SystemExit):
            learning._args(["--rl-set", *bad])
        assert re.search(why, capsys.readouterr().err), bad


def test_sft_set_changes_the_teacher_and_sft_params_of_the_start_trained_here(
        learning, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--sft-set sft.memory_layout=queue`: the data stage, the teacher and each SFT job get the
    key, the study has a workdir of its own; keys the study sets, keys outside `sft.`, bad
    values and a saved start (whose SFT is not trained here) are refused before anything runs."""
    a = learning._args(["--sft-set", "sft.memory_layout=queue", "--variants", "grpo", "--workdir", str(tmp_path / "w")])
    assert a.sft_set == {"sft.memory_layout": "queue"}
    assert a.workdir == tmp_path / "w" / "full-sft-sft.memory_layout=queue"
    w = tmp_path / "w"
    inputs = {"policy": w / "policy", "teacher": w / "teacher", "sft-memory": w / "sft-memory" / "model"}
    assert learning.teacher_params(a, w / "world", w / "data", w / "c.jsonl", w / "policy", w / "t").sft.memory_layout \
        == learning.sft_params("memory", a, inputs).sft.memory_layout == "queue"
    assert learning.data_overrides(a, w / "world", w / "data")["sft.memory_layout"] == "queue"
    plain = learning._args(["--variants", "grpo"])
    assert learning.sft_params("memory", plain, inputs).sft.memory_layout == "now"
    assert learning.sft_params("memory", a, inputs).sft.out == str(w / "sft-memory")
    for bad, why in ((["sft.out=x"], "sft.out: only sft"), (["mempo.lambda_mem=0"], "mempo.lambda_mem: only sft"),
                     (["sft.memory_layout=list"], "sft.memory_layout"),
                     (["sft.memory_layout=queue", "--start", str(tmp_path)], "not with --start")):
        args = ["--sft-set", bad[0], *bad[1:]]
        with pytest.raises(SystemExit):
            learning._args(args)
        assert re.search(why, capsys.readouterr().err), bad
