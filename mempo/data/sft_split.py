"""The SFT stage's tasks, written by the data stage: `sft.parquet` and `sft_val.parquet`.

    rows = sft_split_rows(params.sft, ability)     # in `mempo data prepare` (params `sft:`)
    train, val = load_sft_split("data/prepared")   # in `mempo train sft`

The scripted teacher solves these tasks to make the cold start's trajectories. They are the
knowledge world's questions (`sft.world`), train split of part `sft.part` (entity-disjoint
from RL's `rl` part), `sft.max_questions` of them after a seeded shuffle, plus
`sft.multi_tasks` composed k-objective tasks for each k in `sft.multi_k`; val the same with
the `val_*` keys. Rows are in verl's schema (`mempo.data.schema`) with each objective's hop
chain kept, which the teacher walks.

Why in the data stage: the SFT stage used to re-read and re-compose the world's QA itself,
bypassing the data stage's gates and outputs; now the task mix is decided, validated and
versioned in one place, and SFT reads it. No dedup or leakage filtering is applied here,
so the tasks are the ones SFT always composed (the output gate still checks them).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mempo.errors import DataError
from mempo.tasks import Task

SFT_FILES = {"sft": "train", "sft_val": "val"}  # file stem -> the rows' extra_info.split


def sft_tasks(
    world: str | Path, split: str, part: str | None, max_questions: int | None,
    multi_k: Sequence[int], multi_tasks: int, seed: int,
) -> list[Task]:
    """The teacher's tasks: single questions of `split` (optionally one `part`) plus
    `multi_tasks` composed k-objective tasks for each k in `multi_k` (from the same pool)."""
    from mempo.datasets import load_qa
    from mempo.tasks import compose_multi_objective

    items = load_qa(Path(world) / "qa" / f"{split}.jsonl")
    if part:
        items = [q for q in items if q.part == part]
    if not items:
        raise DataError(f"no questions with part '{part}'", path=Path(world) / "qa" / f"{split}.jsonl")
    rng = random.Random(seed)
    rng.shuffle(items)
    singles = items[:max_questions] if max_questions else items
    tasks = list(singles)
    for k in multi_k:
        n = min(multi_tasks, len(items) // k)
        if k > 1 and n > 0:
            tasks += compose_multi_objective(items, k=k, n_tasks=n, seed=seed + k, id_prefix=f"sft-{split}")
    return tasks


def wants_sft_split(sft: Any, sources: Sequence[str | Path]) -> bool:
    """Whether the data stage writes the SFT split: the teacher runs (no `sft.trajectories`)
    and the stage reads the world it solves (`sft.world`'s train questions are one of the
    data `sources`). A run on real QA sets, which have no chains, writes none."""
    if sft is None or sft.trajectories:
        return False
    train = (Path(sft.world) / "qa" / "train.jsonl").resolve()
    return train.is_file() and any(Path(s).resolve() == train for s in sources)


def sft_split_rows(sft: Any, ability: str) -> dict[str, list[dict[str, Any]]]:
    """`{"sft": rows, "sft_val": rows}` in verl's schema from the `sft:` params (`SFTParams`)."""
    from mempo.data.schema import to_verl_row

    tasks = {
        "sft": sft_tasks(sft.world, "train", sft.part or None, sft.max_questions, sft.multi_k,
                         sft.multi_tasks, sft.seed),
        "sft_val": sft_tasks(sft.world, "val", None, sft.val_questions, sft.val_multi_k,
                             sft.val_multi_tasks, sft.seed),
    }
    source = Path(sft.world).name
    return {stem: [to_verl_row(t, data_source=source, split=SFT_FILES[stem], index=i, ability=ability)
                   for i, t in enumerate(ts)]
            for stem, ts in tasks.items()}


def write_sft_split(sft: Any, folder: str | Path, ability: str = "fact-reasoning") -> dict[str, int]:
    """Write `sft.parquet` and `sft_val.parquet` into `folder` without the data stage's gates
    (tests and benchmarks that need only the teacher's tasks). Returns rows per file stem."""
    from mempo.data.schema import write_prepared

    paths = dict(zip(SFT_FILES, sft_split_paths(folder), strict=True))
    return {stem: write_prepared(rows, paths[stem]) for stem, rows in sft_split_rows(sft, ability).items()}


def sft_split_paths(folder: str | Path) -> tuple[Path, Path]:
    """(train, val) file paths of the SFT split in the data stage's output folder."""
    train, val = (Path(folder) / f"{stem}.parquet" for stem in SFT_FILES)
    return train, val


def load_sft_split(folder: str | Path) -> tuple[list[Task], list[Task]]:
    """The SFT (train, val) tasks the data stage wrote to `folder`, in their written order.

    Raises `DataError` naming the missing file (run `mempo data prepare`, or set
    `sft.trajectories` to train on episodes from elsewhere).
    """
    from mempo.data.schema import load_prepared

    out = []
    for path in sft_split_paths(folder):
        if not path.is_file():
            raise DataError("no SFT task split: run `mempo data prepare` (with sft.world holding the "
                            "knowledge world), or set sft.trajectories", path=path)
        out.append([p.task for p in load_prepared(path)])
    return out[0], out[1]
