"""The prepared-data schema: verl's RL parquet rows, and the loader both trainers use.

One row per task (a question, or k questions composed into one):

    data_source   str    the source set's name (world, nq, hotpotqa, ...)
    prompt        list   chat messages from `mempo.agent.format.build_messages(question)`
    ability       str    "fact-reasoning" (Search-R1's value)
    reward_model  struct {"style": "rule", "ground_truth": {"target": [answer, ...]}}
    extra_info    struct index, split, id, question, k, type, source_ids, objectives
                         ([{id, question, golden_answers, type, hops, supporting_ids,
                           chain: [{entity, relation, value, doc_id}] | null}])
    agent_name    str    "mem_agent" (verl's agent loop registry name)

`target` holds every accepted answer of a plain question, or the one string "a1; a2; ..."
of a k-objective task; per-objective answers are in `extra_info.objectives`, which
`mempo.rewards.compute_score` reads. Each objective keeps its hop `chain` (the knowledge
world's; null for sets without one), so the scripted teacher can solve a prepared task:
the SFT stage reads its tasks from the data stage's `sft.parquet` (`mempo.data.sft_split`).

    rows = [to_verl_row(task, data_source="world", split="train", index=i) ...]
    write_prepared(rows, "data/prepared/train.parquet")
    prepared = load_prepared("data/prepared/train.parquet")   # -> list[PreparedTask]
    tasks = [p.task for p in prepared]                        # -> list[mempo.tasks.Task]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mempo.errors import DataError
from mempo.io import atomic_path
from mempo.tasks import Objective, Task, parse_chain

AGENT_NAME = "mem_agent"
DEFAULT_ABILITY = "fact-reasoning"
REWARD_STYLE = "rule"

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
_HOP = pa.struct([("entity", pa.string()), ("relation", pa.string()), ("value", pa.string()),
                  ("doc_id", pa.string())])
_OBJECTIVE = pa.struct([
    ("id", pa.string()),
    ("question", pa.string()),
    ("golden_answers", pa.list_(pa.string())),
    ("type", pa.string()),
    ("hops", pa.int64()),
    ("supporting_ids", pa.list_(pa.string())),
    ("chain", pa.list_(_HOP)),
])
PREPARED_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(_MESSAGE)),
    ("ability", pa.string()),
    ("reward_model", pa.struct([
        ("style", pa.string()),
        ("ground_truth", pa.struct([("target", pa.list_(pa.string()))])),
    ])),
    ("extra_info", pa.struct([
        ("index", pa.int64()),
        ("split", pa.string()),
        ("id", pa.string()),
        ("question", pa.string()),
        ("k", pa.int64()),
        ("type", pa.string()),
        ("source_ids", pa.list_(pa.string())),
        ("objectives", pa.list_(_OBJECTIVE)),
    ])),
    ("agent_name", pa.string()),
])


def _objective_record(obj: Objective) -> dict[str, Any]:
    meta = obj.metadata
    hops = meta.get("hops")
    support = meta.get("supporting_ids")
    return {
        "id": obj.id,
        "question": obj.question,
        "golden_answers": list(obj.answers),
        "type": str(meta["type"]) if meta.get("type") is not None else None,
        "hops": int(hops) if isinstance(hops, int) and not isinstance(hops, bool) else None,
        "supporting_ids": [str(s) for s in support] if isinstance(support, list) else None,
        "chain": None if obj.chain is None else [h.to_dict() for h in obj.chain],
    }


def to_verl_row(
    task: Task,
    *,
    data_source: str,
    split: str,
    index: int,
    ability: str = DEFAULT_ABILITY,
) -> dict[str, Any]:
    """One verl RL row for `task` (a question or a composed k-objective task).

    The prompt comes from the core prompt module; nothing here spells the template.
    """
    from mempo.agent.format import build_messages

    objectives = [_objective_record(o) for o in task.objectives]
    return {
        "data_source": data_source,
        "prompt": build_messages(task.question),
        "ability": ability,
        "reward_model": {"style": REWARD_STYLE, "ground_truth": {"target": list(task.golden_answers)}},
        "extra_info": {
            "index": int(index),
            "split": split,
            "id": task.id,
            "question": task.question,
            "k": len(objectives),
            "type": str(task.metadata.get("type") or ("multi_objective" if len(objectives) > 1 else "single")),
            "source_ids": task.source_ids,
            "objectives": objectives,
        },
        "agent_name": AGENT_NAME,
    }


def write_prepared(rows: Sequence[dict[str, Any]], path: str | Path) -> int:
    """Write rows atomically as parquet with `PREPARED_SCHEMA`. Returns the row count."""
    try:
        table = pa.Table.from_pylist(list(rows), schema=PREPARED_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DataError(f"rows do not fit the prepared schema: {e}", path=path) from e
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return table.num_rows


@dataclass(frozen=True)
class PreparedTask:
    """One prepared row as the trainers use it: where it sits (index, split, data_source),
    the prompt verl feeds, and the `Task` (objectives, answers, chains) parsed from it."""

    index: int
    split: str
    data_source: str
    prompt: list[dict[str, str]]
    task: Task
    agent_name: str = AGENT_NAME


def _task_of(ei: dict[str, Any], target: list[str], path: Path, row: int) -> Task:
    """The `Task` of one row's `extra_info` and target; `DataError` names the field."""
    objs = ei.get("objectives")
    if not objs:
        raise DataError("no objectives", path=path, row=row, field="extra_info.objectives")
    objectives = []
    for i, o in enumerate(objs):
        name = f"extra_info.objectives[{i}]"
        if not o.get("question") or not o.get("golden_answers"):
            raise DataError("needs a question and answers", path=path, row=row, field=name)
        meta = {key: o[key] for key in ("type", "hops", "supporting_ids") if o.get(key) is not None}
        objectives.append(Objective(str(o["question"]), tuple(str(a) for a in o["golden_answers"]),
                                    parse_chain(o.get("chain"), path, row, f"{name}.chain"),
                                    str(o.get("id") or ""), meta))
    if int(ei["k"]) != len(objectives):
        raise DataError(f"k={ei['k']} but {len(objectives)} objectives", path=path, row=row, field="extra_info.k")
    meta: dict[str, Any] = {"type": str(ei["type"]), "k": len(objectives),
                            "source_ids": [str(s) for s in ei.get("source_ids") or []]}
    return Task(str(ei["id"]), str(ei["question"]), tuple(objectives), tuple(str(a) for a in target), meta)


def load_prepared(path: str | Path) -> list[PreparedTask]:
    """Read a prepared parquet file (train / val / sft / sft_val.parquet) into `PreparedTask`s.

    Raises `DataError` naming the file, the row and the missing column or field when it is
    not prepared data.
    """
    path = Path(path)
    if not path.exists():
        raise DataError("file not found", path=path)
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"not a readable parquet file: {e}", path=path) from e
    for col in PREPARED_SCHEMA.names:
        if col not in table.column_names:
            raise DataError("missing column (not prepared data?)", path=path, field=col)
    out: list[PreparedTask] = []
    for row_no, rec in enumerate(table.to_pylist(), start=1):
        ei = rec["extra_info"] or {}
        try:
            out.append(PreparedTask(
                index=int(ei["index"]), split=str(ei["split"]), data_source=str(rec["data_source"]),
                prompt=list(rec["prompt"]), agent_name=str(rec["agent_name"]),
                task=_task_of(ei, list(rec["reward_model"]["ground_truth"]["target"]), path, row_no),
            ))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"malformed prepared row: {e}", path=path, row=row_no) from e
    return out
