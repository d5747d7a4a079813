"""The prepared-data schema: verl's RL parquet rows, and the loader both trainers use.

One row per task (a question, or k questions composed into one):

    data_source   str    the source set's name (world, nq, hotpotqa, ...)
    prompt        list   chat messages from `mempo.agent.format.build_messages(question)`
    ability       str    "fact-reasoning" (Search-R1's value)
    reward_model  struct {"style": "rule", "ground_truth": {"target": [answer, ...]}}
    extra_info    struct index, split, id, question, k, type, source_ids, objectives
                         ([{id, question, golden_answers, type, hops, supporting_ids}])
    agent_name    str    "mem_agent" (verl's agent loop registry name)

`target` holds every accepted answer of a plain question, or the one string "a1; a2; ..."
of a k-objective task; per-objective answers are in `extra_info.objectives`, which
`mempo.rewards.compute_score` reads.

    rows = [to_verl_row(task, data_source="world", split="train", index=i) ...]
    write_prepared(rows, "data/prepared/train.parquet")
    tasks = load_prepared("data/prepared/train.parquet")   # -> list[PreparedTask]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mempo.datasets import QAItem
from mempo.errors import DataError
from mempo.io import atomic_path
from mempo.tasks import objectives_of

AGENT_NAME = "mem_agent"
DEFAULT_ABILITY = "fact-reasoning"
REWARD_STYLE = "rule"

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
_OBJECTIVE = pa.struct([
    ("id", pa.string()),
    ("question", pa.string()),
    ("golden_answers", pa.list_(pa.string())),
    ("type", pa.string()),
    ("hops", pa.int64()),
    ("supporting_ids", pa.list_(pa.string())),
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


def _objective_record(obj: dict[str, Any], fallback_id: str) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    hops = meta.get("hops")
    support = meta.get("supporting_ids")
    return {
        "id": str(obj.get("id", fallback_id)),
        "question": obj["question"].strip(),
        "golden_answers": [str(a) for a in obj["golden_answers"]],
        "type": str(meta["type"]) if meta.get("type") is not None else None,
        "hops": int(hops) if isinstance(hops, int) and not isinstance(hops, bool) else None,
        "supporting_ids": [str(s) for s in support] if isinstance(support, list) else None,
    }


def to_verl_row(
    task: QAItem,
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

    meta = task.metadata or {}
    raw_objs = meta.get("objectives")
    if raw_objs:
        objectives = [_objective_record(o, f"{task.id}.{i}") for i, o in enumerate(raw_objs)]
    else:
        objectives = [_objective_record({"id": task.id, **objectives_of(task)[0], "metadata": meta}, task.id)]
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
            "type": str(meta.get("type") or ("multi_objective" if len(objectives) > 1 else "single")),
            "source_ids": [str(s) for s in meta.get("source_ids") or [task.id]],
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
    """One prepared row as the trainers use it (see the module docstring for the columns)."""

    index: int
    id: str
    split: str
    data_source: str
    question: str
    golden_answers: list[str]
    objectives: list[dict[str, Any]]
    prompt: list[dict[str, str]]
    k: int
    type: str
    agent_name: str = AGENT_NAME
    source_ids: list[str] = field(default_factory=list)

    def to_qa_item(self) -> QAItem:
        """Back to the FlashRAG form (objectives in metadata), e.g. for the scripted teacher."""
        return QAItem(self.id, self.question, list(self.golden_answers), {
            "type": self.type, "k": self.k, "source_ids": list(self.source_ids),
            "objectives": [{"id": o["id"], "question": o["question"],
                            "golden_answers": list(o["golden_answers"])} for o in self.objectives],
        })


def load_prepared(path: str | Path) -> list[PreparedTask]:
    """Read a prepared parquet file (train.parquet / val.parquet) into `PreparedTask`s.

    Raises `DataError` naming the file and the missing column when it is not prepared data.
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
                index=int(ei["index"]), id=str(ei["id"]), split=str(ei["split"]),
                data_source=str(rec["data_source"]), question=str(ei["question"]),
                golden_answers=list(rec["reward_model"]["ground_truth"]["target"]),
                objectives=list(ei["objectives"]), prompt=list(rec["prompt"]), k=int(ei["k"]),
                type=str(ei["type"]), agent_name=str(rec["agent_name"]),
                source_ids=list(ei.get("source_ids") or []),
            ))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"malformed prepared row: {e}", path=path, row=row_no) from e
    return out
