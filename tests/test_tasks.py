"""Multi-objective composition on any FlashRAG set."""

from __future__ import annotations

import pytest

from mempo.tasks import Task, compose_multi_objective, single_task


def _items(n: int) -> list[Task]:
    return [single_task(f"q{i}", f"question {i}?", [f"ans{i}", f"alt{i}"], {"type": "single"}) for i in range(n)]


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_compose_joins_questions_and_answers(k: int) -> None:
    items = _items(40)
    tasks = compose_multi_objective(items, k=k, seed=3)
    assert len(tasks) == 40 // k
    used = [sid for t in tasks for sid in t.metadata["source_ids"]]
    assert len(used) == len(set(used))  # no question twice
    by_id = {i.id: i for i in items}
    for t in tasks:
        objs = t.objectives
        assert len(objs) == k == t.metadata["k"]
        assert t.question == "; ".join(o.question for o in objs)
        assert list(t.golden_answers) == ["; ".join(o.answers[0] for o in objs)]
        for sid, o in zip(t.metadata["source_ids"], objs, strict=True):
            assert o.answers == by_id[sid].golden_answers  # all aliases kept


def test_compose_is_deterministic_and_seeded() -> None:
    items = _items(32)
    a = compose_multi_objective(items, k=4, seed=1)
    b = compose_multi_objective(items, k=4, seed=1)
    c = compose_multi_objective(items, k=4, seed=2)
    assert [t.question for t in a] == [t.question for t in b]
    assert [t.question for t in a] != [t.question for t in c]


def test_compose_errors() -> None:
    with pytest.raises(ValueError, match="k must be"):
        compose_multi_objective(_items(4), k=17)
    with pytest.raises(ValueError, match="need"):
        compose_multi_objective(_items(4), k=2, n_tasks=3)


def test_objectives_of_plain_question() -> None:
    item = _items(1)[0]
    assert [(o.question, list(o.answers)) for o in item.objectives] == [("question 0?", ["ans0", "alt0"])]


def _hop(entity: str, value: str, doc: str = "1") -> dict[str, str]:
    return {"entity": entity, "relation": "born_in", "value": value, "doc_id": doc}


def test_a_single_question_is_one_objective_with_its_chain() -> None:
    from mempo.tasks import Hop, task_from_obj

    t = task_from_obj({"id": 7, "question": " Where was Ann born? ", "golden_answers": ["Oslo", "OSL"],
                       "metadata": {"type": "single", "part": "sft", "chain": [_hop("Ann", "Oslo")]}})
    assert (t.id, t.k, t.part, t.golden_answers) == ("7", 1, "sft", ("Oslo", "OSL"))
    (o,) = t.objectives
    assert (o.question, o.answers, o.id) == ("Where was Ann born?", ("Oslo", "OSL"), "7")
    assert o.chain == (Hop("Ann", "born_in", "Oslo", "1"),)
    assert "chain" not in t.metadata and o.metadata["type"] == "single"
    assert t.answer_lists == [["Oslo", "OSL"]] and t.source_ids == ["7"]
    assert task_from_obj(t.to_dict()) == t  # the FlashRAG form reads back to an equal task


def test_a_composed_task_keeps_each_objectives_answers_and_chain() -> None:
    from mempo.tasks import task_from_obj

    singles = [task_from_obj({"id": f"q{i}", "question": f"Where was P{i} born?", "golden_answers": [f"C{i}", "x"],
                              "metadata": {"chain": [_hop(f"P{i}", f"C{i}")]}}) for i in range(6)]
    (t,) = compose_multi_objective(singles, k=3, n_tasks=1, seed=0)
    assert t.k == 3 and t.golden_answers == ("; ".join(o.answers[0] for o in t.objectives),)
    assert all(o.chain is not None and o.chain[0].value == o.answers[0] for o in t.objectives)
    assert t.answer_lists == [list(singles[int(o.id[1:])].golden_answers) for o in t.objectives]
    back = task_from_obj(t.to_dict())
    assert back == t and back.source_ids == [o.id for o in t.objectives]


def test_a_missing_chain_is_none_not_an_error() -> None:
    from mempo.agent.teacher import ScriptedTeacher
    from mempo.tasks import task_from_obj

    t = task_from_obj({"id": "nq-1", "question": "who wrote it?", "golden_answers": ["Ann"]})
    assert t.objectives[0].chain is None
    composed = task_from_obj({"id": "c", "question": "a?; b?", "golden_answers": ["1; 2"], "metadata": {
        "objectives": [{"question": "a?", "golden_answers": ["1"]},
                       {"question": "b?", "golden_answers": ["2"], "metadata": {"chain": [_hop("B", "2")]}}]}})
    assert [o.chain is None for o in composed.objectives] == [True, False]
    assert [o.id for o in composed.objectives] == ["c.0", "c.1"]
    with pytest.raises(ValueError, match="objective 0 has no metadata.chain"):
        ScriptedTeacher(None)._plan(composed)


@pytest.mark.parametrize(("metadata", "field"), [
    ({"chain": [{"entity": "A", "relation": "born_in"}]}, "metadata.chain[0].value"),
    ({"chain": "A born in B"}, "metadata.chain"),
    ({"objectives": [{"question": "a?", "golden_answers": ["1"]}, {"question": "b?"}]},
     "metadata.objectives[1].golden_answers"),
    ({"objectives": [{"question": "", "golden_answers": ["1"]}]}, "metadata.objectives[0].question"),
    ({"objectives": [{"question": "a?", "golden_answers": ["1"],
                      "metadata": {"chain": [{"entity": "A", "relation": "r", "value": ""}]}}]},
     "metadata.objectives[0].metadata.chain[0].value"),
    ({"objectives": "a?; b?"}, "metadata.objectives"),
])
def test_bad_input_names_the_file_row_and_field(tmp_path, metadata: dict, field: str) -> None:
    import json

    from mempo.datasets import load_qa
    from mempo.errors import DataError

    path = tmp_path / "qa.jsonl"
    rows = [{"id": "ok", "question": "q?", "golden_answers": ["a"]},
            {"id": "bad", "question": "q?", "golden_answers": ["a"], "metadata": metadata}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        load_qa(path)
    assert (e.value.path, e.value.row, e.value.field) == (str(path), 2, field)
    assert f"{path}:2 field '{field}'" in e.value.one_line()
