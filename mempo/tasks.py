"""What a task is: a question with one or more objectives, parsed once where it is loaded.

    task = task_from_obj({"id": "q1", "question": "Who ...?", "golden_answers": ["Ann"]})
    task.objectives[0].answers          # ("Ann",)
    tasks = compose_multi_objective(tasks, k=4, n_tasks=100, seed=0)

A plain question is a task of one objective: its question, every accepted answer, and the
hop `chain` of `metadata.chain` when the knowledge world wrote one. A k-objective task
(MEM1 / MemPO style, `compose_multi_objective`) joins the k questions with "; "; its
`golden_answers` holds one string, the objectives' first answers joined with "; "
(`"a1; a2; ..."`), and each `Objective` keeps its own question, full answer list and chain,
so rewards score each objective against all of its accepted answers and the scripted
teacher walks each chain. Works on any FlashRAG-format set.

Why one type: the objectives were once worked out from `metadata` dicts at every site that
needed them (rewards, rollout, metrics, teacher, schema) under different rules. Readers
(`mempo.datasets.load_qa`, `mempo.data.schema.load_prepared`) build `Task`s; everything
after them reads the fields.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mempo.errors import DataError

OBJECTIVE_SEP = "; "
MAX_OBJECTIVES = 16


@dataclass(frozen=True)
class Hop:
    """One retrieval step of a knowledge-world chain: `entity`'s `relation` is `value`,
    stated in passage `doc_id` (empty when the source does not say)."""

    entity: str
    relation: str
    value: str
    doc_id: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"entity": self.entity, "relation": self.relation, "value": self.value, "doc_id": self.doc_id}


@dataclass(frozen=True)
class Objective:
    """One question of a task: its text, every accepted answer, its hop chain (None when the
    source has none, e.g. NQ), its source id and the source question's other metadata
    (type, hops, supporting_ids, ...; without `chain`)."""

    question: str
    answers: tuple[str, ...]
    chain: tuple[Hop, ...] | None = None
    id: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """A question (one objective) or k questions composed into one (k objectives).

    `golden_answers` is the task's target as its source wrote it (every accepted answer of a
    plain question, `"a1; a2; ..."` of a composed one); `metadata` is the source's metadata
    without `objectives` and `chain`, which live in `objectives`.
    """

    id: str
    question: str
    objectives: tuple[Objective, ...]
    golden_answers: tuple[str, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def k(self) -> int:
        """Objectives in the task."""
        return len(self.objectives)

    @property
    def answer_lists(self) -> list[list[str]]:
        """Every objective's accepted answers, in order: what rewards score against."""
        return [list(o.answers) for o in self.objectives]

    @property
    def part(self) -> str | None:
        """The source's `metadata.part` (knowledge world: sft | rl | val | test), if any."""
        part = self.metadata.get("part")
        return None if part is None else str(part)

    @property
    def source_ids(self) -> list[str]:
        """Ids of the questions the task was composed from (itself for a plain question)."""
        return [str(s) for s in self.metadata.get("source_ids") or [self.id]]

    def to_dict(self) -> dict[str, Any]:
        """The FlashRAG row `task_from_obj` reads back to an equal task."""
        meta = dict(self.metadata)
        if "source_ids" in meta:  # composed: objectives spelled out
            meta["objectives"] = [
                {"id": o.id, "question": o.question, "golden_answers": list(o.answers),
                 "metadata": _with_chain(o.metadata, o.chain)}
                for o in self.objectives]
        else:
            meta = _with_chain(meta, self.objectives[0].chain)
        return {"id": self.id, "question": self.question, "golden_answers": list(self.golden_answers),
                "metadata": meta}


def single_task(id: str, question: str, answers: Sequence[str], metadata: Mapping[str, Any] | None = None,
                chain: Sequence[Hop] | None = None) -> Task:
    """A one-objective task (a question written in code, e.g. `mempo eval ask` or a test)."""
    meta = dict(metadata or {})
    obj = Objective(question.strip(), tuple(answers), None if chain is None else tuple(chain), id, meta)
    return Task(id, question, (obj,), tuple(answers), meta)


def _with_chain(meta: Mapping[str, Any], chain: tuple[Hop, ...] | None) -> dict[str, Any]:
    out = dict(meta)
    if chain is not None:
        out["chain"] = [h.to_dict() for h in chain]
    return out


def _text(value: Any, what: str, path: str | Path | None, row: int | None, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float) or not str(value).strip():
        raise DataError(f"{what} must be a non-empty string, got {value!r}", path=path, row=row, field=name)
    return str(value)


def parse_chain(value: Any, path: str | Path | None = None, row: int | None = None,
                name: str = "metadata.chain") -> tuple[Hop, ...] | None:
    """A hop chain from its JSON form (`[{entity, relation, value, doc_id}]`); None when absent.

    Raises `DataError` naming the file, row and the hop's field (e.g. `metadata.chain[1].value`).
    """
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not value:
        raise DataError(f"must be a non-empty list of hops, got {type(value).__name__}",
                        path=path, row=row, field=name)
    hops = []
    for i, h in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(h, Mapping):
            raise DataError(f"must be an object, got {type(h).__name__}", path=path, row=row, field=where)
        doc = h.get("doc_id")
        hops.append(Hop(*(_text(h.get(key), key, path, row, f"{where}.{key}")
                          for key in ("entity", "relation", "value")),
                        doc_id="" if doc is None else str(doc)))
    return tuple(hops)


def _answers(value: Any, path: str | Path | None, row: int | None, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        raise DataError(f"must be a non-empty list of strings, got {value!r}", path=path, row=row, field=name)
    return tuple(_text(a, f"item {i}", path, row, name) for i, a in enumerate(value))


def objective_from_obj(obj: Any, index: int, task_id: str, path: str | Path | None = None,
                       row: int | None = None) -> Objective:
    """Objective `index` of a composed FlashRAG row (`metadata.objectives[index]`)."""
    name = f"metadata.objectives[{index}]"
    if not isinstance(obj, Mapping):
        raise DataError(f"must be an object, got {type(obj).__name__}", path=path, row=row, field=name)
    meta = obj.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise DataError(f"must be an object, got {type(meta).__name__}", path=path, row=row, field=f"{name}.metadata")
    return Objective(
        question=_text(obj.get("question"), "question", path, row, f"{name}.question").strip(),
        answers=_answers(obj.get("golden_answers"), path, row, f"{name}.golden_answers"),
        chain=parse_chain(meta.get("chain"), path, row, f"{name}.metadata.chain"),
        id=str(obj.get("id", f"{task_id}.{index}")),
        metadata={key: v for key, v in meta.items() if key != "chain"},
    )


def task_from_parts(tid: str, question: str, answers: Sequence[str], metadata: Mapping[str, Any],
                    path: str | Path | None = None, row: int | None = None) -> Task:
    """A `Task` from a FlashRAG row's checked id, question and answers and its metadata:
    objectives from `metadata.objectives` when the row was composed, else the question
    itself (its chain from `metadata.chain`). Raises `DataError` naming file, row and field."""
    objs = metadata.get("objectives")
    rest = {key: v for key, v in metadata.items() if key not in ("objectives", "chain")}
    if objs:
        if not isinstance(objs, list | tuple):
            raise DataError(f"must be a list of objectives, got {type(objs).__name__}",
                            path=path, row=row, field="metadata.objectives")
        if len(objs) > MAX_OBJECTIVES:
            raise DataError(f"{len(objs)} objectives; at most {MAX_OBJECTIVES}", path=path, row=row,
                            field="metadata.objectives")
        objectives = tuple(objective_from_obj(o, i, tid, path, row) for i, o in enumerate(objs))
    else:
        objectives = (Objective(question.strip(), tuple(answers), parse_chain(metadata.get("chain"), path, row),
                                tid, rest),)
    return Task(tid, question, objectives, tuple(answers), rest)


def task_from_obj(obj: Mapping[str, Any], path: str | Path | None = None, row: int | None = None) -> Task:
    """Parse one FlashRAG object (`id`, `question`, `golden_answers`, `metadata`) into a `Task`.

    Raises `DataError` naming the file, row and field (`mempo.datasets.qa_from_obj` checks
    the top-level fields the same way when reading a file).
    """
    from mempo.datasets import qa_from_obj

    return qa_from_obj(dict(obj), Path(path) if path is not None else Path("<task>"), row or 0)


def compose_multi_objective(
    items: Sequence[Task],
    k: int,
    n_tasks: int | None = None,
    seed: int = 0,
    id_prefix: str | None = None,
) -> list[Task]:
    """Compose k-objective tasks from `items`, each item used at most once.

    Args:
        items: plain questions (any source).
        k: objectives per task, 1..16. k=1 returns the items unchanged except for ids
            and the composed metadata.
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
    tasks: list[Task] = []
    for i in range(n):
        group = pool[i * k:(i + 1) * k]
        objectives = tuple(
            Objective(q.question.strip(), tuple(q.golden_answers), q.objectives[0].chain if q.k == 1 else None,
                      q.id, q.metadata)
            for q in group)
        tasks.append(Task(
            id=f"{prefix}-k{k}-{i:05d}",
            question=OBJECTIVE_SEP.join(o.question for o in objectives),
            golden_answers=(OBJECTIVE_SEP.join(o.answers[0] for o in objectives),),
            objectives=objectives,
            metadata={
                "type": "multi_objective" if k > 1 else (group[0].metadata.get("type") or "single"),
                "k": k,
                "source_ids": [q.id for q in group],
                "part": group[0].metadata.get("part"),
            },
        ))
    return tasks
