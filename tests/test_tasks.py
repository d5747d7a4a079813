"""Multi-objective composition on any FlashRAG set."""

from __future__ import annotations

import pytest

from mempo.datasets import QAItem
from mempo.tasks import compose_multi_objective, objectives_of


def _items(n: int) -> list[QAItem]:
    return [QAItem(f"q{i}", f"question {i}?", [f"ans{i}", f"alt{i}"], {"type": "single"}) for i in range(n)]


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_compose_joins_questions_and_answers(k: int) -> None:
    items = _items(40)
    tasks = compose_multi_objective(items, k=k, seed=3)
    assert len(tasks) == 40 // k
    used = [sid for t in tasks for sid in t.metadata["source_ids"]]
    assert len(used) == len(set(used))  # no question twice
    by_id = {i.id: i for i in items}
    for t in tasks:
        objs = objectives_of(t)
        assert len(objs) == k == t.metadata["k"]
        assert t.question == "; ".join(o["question"] for o in objs)
        assert t.golden_answers == ["; ".join(o["golden_answers"][0] for o in objs)]
        for sid, o in zip(t.metadata["source_ids"], objs, strict=True):
            assert o["golden_answers"] == by_id[sid].golden_answers  # all aliases kept


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
    assert objectives_of(item) == [{"question": "question 0?", "golden_answers": ["ans0", "alt0"]}]
