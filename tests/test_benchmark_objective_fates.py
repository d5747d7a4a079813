"""`benchmarks/objective_fates.py`: each evaluated episode's end and objective fates from its
sample row, and their shares and per-variant means, on hand-built rows (the evaluation itself is
`mempo eval`'s code, tested in test_eval_e2e.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from benchmark_helpers import load_benchmark

from mempo.errors import MempoError


def fates_mod():
    return load_benchmark("objective_fates")


def _row(task: str, prediction: str, turns: list[tuple[str | None, str | None]], **extra):
    return {"id": task, "benchmark": "k2", "prediction": prediction, "error": "", "hit_turn_limit": 0.0,
            "transcript": json.dumps([{"memory": m, "observation": o} for m, o in turns]), **extra}


def _task(answers: list[str], questions: list[str]) -> SimpleNamespace:
    return SimpleNamespace(answer_lists=[[x] for x in answers], objectives=[SimpleNamespace(question=q) for q in questions])


TASKS = {"a": _task(["Paris", "1900"], ["Where was A born?", "When was B born?"]),
         "b": _task(["Rome", "Oslo"], ["Where was C born?", "Where was D born?"])}


def test_row_fates_score_each_part_and_name_how_the_episode_ended():
    m = fates_mod()
    row = _row("a", "Paris; 1901", [("none yet", "... Paris ... 1900 ..."), ("Answer 1: Paris.", None)])
    assert m.row_fates(row, [["Paris"], ["1900"]]) == ("answered", ["right", "retrieved, never in a memory"])
    cut = _row("b", "", [("Answer 1: Rome.", "... Oslo ..."), ("Looking for the second.", None)], hit_turn_limit=1.0)
    assert m.row_fates(cut, [["Rome"], ["Oslo"]]) == (
        "turn limit", ["in a memory, then dropped", "retrieved, never in a memory"])


def test_shares_are_over_objectives_and_episodes_and_means_over_seeds():
    m = fates_mod()
    rows = [_row("a", "Paris; 1900", [("Answer: Paris, 1900.", "... Paris 1900 ...")]),
            _row("b", "Rome; Lima", [("Rome", "... Rome ...")])]
    shares = m.fate_shares(rows, TASKS)
    assert shares["tasks"] == 2 and shares["ended"] == {"answered": 1.0}
    assert shares["fates"]["right"] == pytest.approx(0.75) and shares["fates"]["never retrieved"] == pytest.approx(0.25)
    assert shares["fates_by_objective"]["2"]["never retrieved"] == pytest.approx(0.5)
    assert sum(shares["fates"].values()) == pytest.approx(1.0)
    assert shares["order"]["no question"] == 1.0  # neither memory names a question in progress
    other = m.fate_shares(rows[:1], TASKS)  # a second seed that solved all it saw
    summary = m.summarise([("grpo", 0, {"k2": shares, "k4": shares}), ("grpo", 1, {"k2": other, "k4": other})])
    assert summary["grpo"]["seeds"] == [0, 1]
    assert summary["grpo"]["k2"]["fates"]["right"] == pytest.approx((0.75 + 1.0) / 2)
    assert set(summary["grpo"]["k2"]["per_seed"]) == {"0", "1"}


def test_the_order_the_memories_take_the_objectives_on():
    """`objective_order` reads the question after "Now:" (the head of the queue layout's list)
    from each memory; `order_kind` names the walk, and the shares are over episodes."""
    from mempo.agent.teacher import now_question, objective_order

    m = fates_mod()
    qs = ["Where was A born?", "When was B born?", "Who founded C?"]
    assert now_question("Answers: x. Now: When was B born?; Who founded C? B was born in 1900.") == qs[1]
    assert now_question("Answers: x; y.") is None and now_question(None) is None
    walks = {"all in order": [f"Now: {qs[0]}", f"Now: {qs[0]} A was born in Rome.", f"Answers: Rome. Now: {qs[1]}",
                              f"Answers: Rome; 1900. Now: {qs[2]}", "Answers: Rome; 1900; D."],
             "in order, stopped early": [f"Now: {'; '.join(qs)}", f"Answers: Rome. Now: {'; '.join(qs[1:])}"],
             "skipped one": [f"Now: {qs[0]}", f"Answers: Rome. Now: {qs[2]}"],
             "went back": [f"Now: {qs[0]}", f"Now: {qs[1]}", f"Now: {qs[0]}"],
             "miscopied": [f"Now: {qs[0]}", "Now: When was Bee born?"],
             "no question": ["Nothing found yet.", None]}
    assert objective_order(walks["all in order"], qs) == [1, 2, 3]
    assert objective_order(walks["miscopied"], qs) == [1, 0]
    for kind, memories in walks.items():
        assert m.order_kind(objective_order(memories, qs), 3) == kind, kind
    assert m.order_kind([2, 3], 3) == "skipped one"  # started past objective 1
    task = _task(["Rome", "1900", "D"], qs)
    rows = [_row("t", "Rome; 1900; D", [(mem, None) for mem in walks[kind]])
            for kind in ("all in order", "all in order", "skipped one", "no question")]
    order = m.fate_shares(rows, {"t": task})["order"]
    assert order == {"all in order": 0.5, "in order, stopped early": 0.0, "skipped one": 0.25, "went back": 0.0,
                     "miscopied": 0.0, "no question": 0.25}


def test_a_missing_checkpoint_is_named(tmp_path):
    m = fates_mod()
    a = SimpleNamespace(from_pipeline=tmp_path, start=None, workdirs=[tmp_path / "w"], variants=["grpo"], seeds=[7])
    with pytest.raises(MempoError, match="no rl-grpo-seed7/model in"):
        m.models(a, tmp_path / "sft")


def test_a_saved_start_gives_the_sft_checkpoint_and_the_study_s_world(tmp_path, tiny_world):
    """--start: the SFT checkpoint is the saved start's (checked against the study's world, the
    first workdir's world/), then the RL checkpoints of the workdirs."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from mempo.training.starts import save_start

    m = fates_mod()
    sft = tmp_path / "sft" / "model"
    sft.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(sft / "model.safetensors"))
    (tmp_path / "sft" / "metrics.json").write_text("{}")
    work = tmp_path / "w"
    shutil.copytree(tiny_world, work / "world")
    save_start(tmp_path / "start", {"memory": (sft, tmp_path / "sft" / "metrics.json")}, work / "world")
    (work / "rl-grpo-seed7" / "model").mkdir(parents=True)
    a = SimpleNamespace(from_pipeline=None, start=tmp_path / "start", workdirs=[work], variants=["grpo"], seeds=[7])
    assert m.start(a) == (work / "world", tmp_path / "start" / "memory" / "model")
    assert m.models(a, m.start(a)[1]) == [("sft", None, tmp_path / "start" / "memory" / "model"),
                           ("grpo", 7, work / "rl-grpo-seed7" / "model")]
    with pytest.raises(MempoError, match="--start needs --workdirs"):
        m.start(SimpleNamespace(from_pipeline=None, start=tmp_path / "start", workdirs=[]))
    # --study-sft: the checkpoint the first workdir's study trained, once it exists
    own = SimpleNamespace(from_pipeline=None, start=None, workdirs=[work])
    with pytest.raises(MempoError, match="--study-sft: no trained SFT checkpoint at .*sft-memory"):
        m.start(own)
    shutil.copytree(sft, work / "sft-memory" / "model")
    (work / "sft-memory" / "model" / "config.json").write_text("{}")
    assert m.start(own) == (work / "world", work / "sft-memory" / "model")
    with pytest.raises(MempoError, match="--study-sft needs --workdirs"):
        m.start(SimpleNamespace(from_pipeline=None, start=None, workdirs=[]))
    manifest = work / "world" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"qa/test.jsonl": "', '"qa/test.jsonl": "0'))
    with pytest.raises(MempoError, match="another world"):
        m.start(a)


def test_replot_redraws_from_the_written_file_and_names_a_file_that_is_not_one(tmp_path, capsys):
    """--replot: the plot (bars, per objective position right / never retrieved, and the order
    the memories took the objectives on) from the JSON alone; a file without results is refused
    by name, with nothing written."""
    m = fates_mod()
    rows = [_row("a", "Paris; 1900", [("Answer: Paris, 1900.", "... Paris 1900 ...")]),
            _row("b", "Rome; Lima", [("Rome", "... Rome ...")])]
    shares = m.fate_shares(rows, TASKS)
    summary = m.summarise([("sft", None, {"k2": shares, "k4": shares}), ("grpo", 0, {"k2": shares, "k4": shares})])
    out = tmp_path / "fates.json"
    out.write_text(json.dumps({"results": summary}))
    assert m.main(["--replot", str(out)]) == 0
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    three = Image.open(png).size[1]
    assert three > Image.open(png).size[0]  # three rows of panels: fates, per position, order
    # a file written before the order was measured: its two rows only
    for name in summary:
        for s in m.SETS:
            summary[name][s].pop("order")
    out.write_text(json.dumps({"results": summary}))
    assert m.main(["--replot", str(out)]) == 0
    assert Image.open(png).size[0] / 2 < Image.open(png).size[1] < three
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"benchmark": "decode"}))
    assert m.main(["--replot", str(bad)]) == 2
    assert "other.json: not an objective_fates.py output" in capsys.readouterr().err
    assert not bad.with_suffix(".png").exists()
    half = tmp_path / "half.json"  # results without the per-position shares
    half.write_text(json.dumps({"results": {"grpo": {s: {"fates": summary["grpo"][s]["fates"]} for s in m.SETS}}}))
    assert m.main(["--replot", str(half)]) == 2
    assert "half.json: not an objective_fates.py output (KeyError" in capsys.readouterr().err
    assert not half.with_suffix(".png").exists()
