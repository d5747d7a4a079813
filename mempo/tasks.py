"""Multi-objective tasks: k questions composed into one (MEM1 / MemPO style).

    tasks = compose_multi_objective(items, k=4, n_tasks=100, seed=0)

A task's question is the k questions joined with "; "; its `golden_answers` holds one
string, the objectives' first answers joined with "; " (`"a1; a2; ..."`), and
`metadata.objectives` keeps each objective's question and full answer list, so rewards score
each objective against all of its accepted answers. Works on any FlashRAG-format set.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from mempo.datasets import QAItem

OBJECTIVE_SEP = "; "
MAX_OBJECTIVES = 16


def objectives_of(item: QAItem | dict[str, Any]) -> list[dict[str, Any]]:
    """The objectives of a task: `[{"question", "golden_answers"}]` (one for a plain question)."""
    d = item.to_dict() if isinstance(item, QAItem) else item
    objs = (d.get("metadata") or {}).get("objectives")
    if objs:
        return [{"question": o["question"], "golden_answers": list(o["golden_answers"])} for o in objs]
    return [{"question": d["question"], "golden_answers": list(d["golden_answers"])}]


def compose_multi_objective(
    items: Sequence[QAItem],
    k: int,
    n_tasks: int | None = None,
    seed: int = 0,
    id_prefix: str | None = None,
) -> list[QAItem]:
    """Compose k-objective tasks from `items`, each item used at most once.

    Args:
        items: FlashRAG questions (any source).
        k: objectives per task, 1..16. k=1 returns the items unchanged except for ids
            and the `objectives` metadata.
        n_tasks: how many tasks (default: as many as `len(items) // k` allows).
        seed: shuffling seed; same seed, same tasks.
        id_prefix: id of task i is `f"{id_prefix}-k{k}-{i:05d}"` (default: "task").
    """
    if not 1 <= k <= MAX_OBJECTIVES:
        raise ValueError(f"k must be in 1..{MAX_OBJECTIVES}, got {k}")
    pool = list(items)
    rng = random.Random(seed)
    rng.shuffle(pool)
    possible = len(pool) // k
    n = possible if n_tasks is None else n_tasks
    if n > possible:
        raise ValueError(f"{n} tasks of k={k} need {n * k} questions; only {len(pool)} given")
    prefix = id_prefix or "task"
    tasks: list[QAItem] = []
    for i in range(n):
        group = pool[i * k:(i + 1) * k]
        objectives = [
            {"id": q.id, "question": q.question.strip(), "golden_answers": list(q.golden_answers),
             "metadata": q.metadata}
            for q in group
        ]
        tasks.append(QAItem(
            id=f"{prefix}-k{k}-{i:05d}",
            question=OBJECTIVE_SEP.join(o["question"] for o in objectives),
            golden_answers=[OBJECTIVE_SEP.join(o["golden_answers"][0] for o in objectives)],
            metadata={
                "type": "multi_objective" if k > 1 else (group[0].metadata.get("type") or "single"),
                "k": k,
                "objectives": objectives,
                "source_ids": [q.id for q in group],
                "part": group[0].metadata.get("part"),
            },
        ))
    return tasks
