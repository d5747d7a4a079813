"""`mempo data prepare`: FlashRAG QA sets -> verl-schema `train.parquet` / `val.parquet`, and
the SFT stage's task split `sft.parquet` / `sft_val.parquet`.

    mempo data prepare                       # params.yaml `data:` (the knowledge world)
    mempo data prepare --out data/prepared --leakage fail

Steps, all deterministic for a seed:

1. Gate the inputs: the `qa` contract on every source and every evaluation set
   (reports in `<validate.out>/qa/<label>/`); a failure stops here.
2. Load the sources; keep train questions of the listed `train_parts` (world: `rl`).
3. Deduplicate by normalised question within each split; drop train questions that are also
   in val.
4. Leakage: a question (or any objective of a composed one) whose normalised text is in an
   evaluation set is dropped and counted (`leakage: drop`) or fails the stage (`fail`).
5. Compose: for every `{k, share}` in `compositions`, `share` of each source's questions
   (seeded sample) composed k at a time with `mempo.tasks.compose_multi_objective`.
6. Shuffle each split (seeded), number the rows, and build verl rows (`mempo.data.schema`).
   With the `sft:` params given (the CLI passes them), the teacher in use (no
   `sft.trajectories`) and `sft.world`'s train questions among the sources, also the SFT
   split from `sft.world` (`mempo.data.sft_split`).
7. Gate the output: the `prepared` contract on each parquet inside the temporary folder;
   only then is the folder renamed into place with `summary.json` and `manifest.json`.

A failure at any step leaves the previous output folder as it was (or none).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mempo.config import DataParams, ValidateParams
from mempo.datasets import load_qa
from mempo.errors import DataError, ValidationFailed
from mempo.io import atomic_dir, sha256_file, write_json
from mempo.tasks import Task, compose_multi_objective

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
# The `sft:` keys that decide the SFT split (the data stage reads them; see sft_split).
SFT_KEYS = ("world", "part", "max_questions", "multi_k", "multi_tasks", "val_questions", "val_multi_k",
            "val_multi_tasks", "seed")


@dataclass
class SourceItem:
    """A question with where it came from."""

    item: Task
    source: str
    path: str


@dataclass
class Drops:
    """Questions removed before composition, by reason (counts and a few ids each)."""

    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, item: SourceItem, keep: int = 10) -> None:
        self.counts[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < keep:
            ex.append(f"{item.source}:{item.item.id}")


def _derived_seed(seed: int, *parts: object) -> int:
    """A stable per-(split, source, k) seed, so adding a source does not reshuffle the others."""
    text = "/".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def _objective_norms(item: Task, normalize: Callable[[str], str]) -> list[str]:
    return [normalize(o.question) for o in item.objectives]


def gate_inputs(data: DataParams, validation: ValidateParams) -> list[str]:
    """Run the `qa` contract on every source and eval set; returns the report folders."""
    from mempo.validation import validate_data

    folders = []
    targets = [(f"{s.name}-{s.split}", s.path) for s in data.sources]
    targets += [(f"eval-{Path(p).stem}", p) for p in data.eval_sets]
    seen: set[str] = set()
    for label, path in targets:
        if path in seen:
            continue
        seen.add(path)
        folder = Path(validation.out) / "qa" / label
        validate_data("qa", path, validation, report_dir=folder)
        folders.append(str(folder))
    return folders


def load_sources(data: DataParams, drops: Drops) -> dict[str, list[SourceItem]]:
    """Every source's questions by split, train filtered to `train_parts`."""
    by_split: dict[str, list[SourceItem]] = {s: [] for s in SPLITS}
    for src in data.sources:
        for item in load_qa(src.path):
            si = SourceItem(item, src.name, src.path)
            part = item.part
            if src.split == "train" and data.train_parts is not None and part is not None \
                    and part not in data.train_parts:
                drops.add("train_part_filtered", si)
                continue
            by_split[src.split].append(si)
    if not by_split["train"]:
        raise DataError("no train questions (check data.sources and data.train_parts)", field="data.sources")
    return by_split


def dedup_and_check_leakage(
    by_split: dict[str, list[SourceItem]],
    eval_norms: dict[str, str],
    normalize: Callable[[str], str],
    data: DataParams,
    drops: Drops,
) -> dict[str, list[SourceItem]]:
    """Deduplicate each split, drop train questions seen in val, and apply the leakage rule.

    `eval_norms` maps a normalised evaluation question to the file it is in.
    Raises `ValidationFailed` when `leakage == "fail"` and any question overlaps.
    """
    leaks: list[str] = []
    val_norms = {n for si in by_split["val"] for n in _objective_norms(si.item, normalize)}
    out: dict[str, list[SourceItem]] = {}
    for split in SPLITS:
        kept: list[SourceItem] = []
        seen: set[str] = set()
        for si in by_split[split]:
            key = normalize(si.item.question)
            if data.dedup and key in seen:
                drops.add(f"{split}_duplicate", si)
                continue
            norms = _objective_norms(si.item, normalize)
            hit = next((n for n in norms if n in eval_norms), None)
            if hit is not None:
                if data.leakage == "fail":
                    leaks.append(f"{si.path} id={si.item.id!r} (also in {eval_norms[hit]})")
                drops.add(f"{split}_eval_leak", si)
                continue
            if split == "train" and data.dedup and any(n in val_norms for n in norms):
                drops.add("train_in_val", si)
                continue
            seen.add(key)
            kept.append(si)
        out[split] = kept
    if leaks:
        raise ValidationFailed(
            f"{len(leaks)} questions are also in an evaluation set (data.leakage=fail): "
            + "; ".join(leaks[:10]) + (" ..." if len(leaks) > 10 else ""),
            field="question",
        )
    if not out["train"]:
        raise DataError("no train questions left after dedup and the leakage check", field="data.sources")
    return out


def compose_split(items: Sequence[SourceItem], split: str, data: DataParams) -> list[tuple[str, Task]]:
    """`(data_source, task)` for every composition of every source in this split, shuffled."""
    by_source: dict[str, list[Task]] = {}
    for si in items:
        by_source.setdefault(si.source, []).append(si.item)
    tasks: list[tuple[str, Task]] = []
    for source, pool in by_source.items():
        for comp in data.compositions:
            rng = random.Random(_derived_seed(data.seed, split, source, comp.k, "sample"))
            n_take = int(len(pool) * comp.share)
            picked = rng.sample(pool, n_take) if n_take < len(pool) else list(pool)
            if len(picked) < comp.k:
                log.warning("%s/%s: %d questions, too few for k=%d; composition skipped",
                            source, split, len(picked), comp.k)
                continue
            composed = compose_multi_objective(
                picked, comp.k, seed=_derived_seed(data.seed, split, source, comp.k, "compose"),
                id_prefix=f"{source}-{split}")
            tasks.extend((source, t) for t in composed)
    random.Random(_derived_seed(data.seed, split, "shuffle")).shuffle(tasks)
    return tasks


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    s = sorted(values)

    def q(p: float) -> float:
        return float(s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))])

    return {"n": len(s), "min": float(s[0]), "p50": q(0.5), "p90": q(0.9), "max": float(s[-1]),
            "mean": round(sum(s) / len(s), 3)}


def summarize(rows_by_split: dict[str, list[dict[str, Any]]], drops: Drops) -> dict[str, Any]:
    """Counts by split x source / type / k, question and answer length distributions, drops."""
    out: dict[str, Any] = {"splits": {}, "dropped": dict(sorted(drops.counts.items())),
                           "dropped_examples": drops.examples}
    for split, rows in rows_by_split.items():
        objs = [o for r in rows for o in r["extra_info"]["objectives"]]
        out["splits"][split] = {
            "rows": len(rows),
            "by_source": dict(sorted(Counter(r["data_source"] for r in rows).items())),
            "by_k": {str(k): v for k, v in sorted(Counter(r["extra_info"]["k"] for r in rows).items())},
            "by_type": dict(sorted(Counter(o["type"] or "unknown" for o in objs).items())),
            "objectives": len(objs),
            "question_chars": _quantiles([len(r["extra_info"]["question"]) for r in rows]),
            # Length of each objective's first (canonical) answer, in words and characters.
            "answer_words": _quantiles([len(o["golden_answers"][0].split()) for o in objs]),
            "answer_chars": _quantiles([len(o["golden_answers"][0]) for o in objs]),
            "answers_per_objective": _quantiles([len(o["golden_answers"]) for o in objs]),
        }
    return out


@dataclass
class PrepareResult:
    """What `prepare_data` wrote: the folder, row counts per split, the summary."""

    out: str
    rows: dict[str, int]
    summary: dict[str, Any]
    reports: list[str]


def prepare_data(data: DataParams, validation: ValidateParams | None = None, sft: Any = None) -> PrepareResult:
    """Build `data.out/{train,val}.parquet`, `summary.json`, `manifest.json` (see module doc),
    and `sft.parquet` / `sft_val.parquet` when `sft` (the `sft:` params) asks for the
    teacher on a world this stage reads (`mempo.data.sft_split.wants_sft_split`).

    Raises:
        ValidationFailed: an input or the output broke its contract, or (leakage=fail) a
            question overlaps an evaluation set. Nothing is written to `data.out`.
        DataError: an input file cannot be read.
    """
    from mempo.data.schema import to_verl_row, write_prepared
    from mempo.data.sft_split import sft_split_rows, wants_sft_split
    from mempo.rewards import normalize_answer

    validation = validation or ValidateParams()
    reports = gate_inputs(data, validation) if data.gate else []

    drops = Drops()
    by_split = load_sources(data, drops)
    eval_norms: dict[str, str] = {}
    eval_questions: list[str] = []
    for path in data.eval_sets:
        for item in load_qa(path):
            for o in item.objectives:
                eval_norms.setdefault(normalize_answer(o.question), path)
                eval_questions.append(o.question)
    clean = dedup_and_check_leakage(by_split, eval_norms, normalize_answer, data, drops)

    rows_by_split: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        if not clean[split]:
            continue
        tasks = compose_split(clean[split], split, data)
        rows_by_split[split] = [
            to_verl_row(t, data_source=src, split=split, index=i, ability=data.ability)
            for i, (src, t) in enumerate(tasks)
        ]
    if wants_sft_split(sft, [s.path for s in data.sources]):
        rows_by_split.update(sft_split_rows(sft, data.ability))
    elif sft is not None and not sft.trajectories:
        log.info("no SFT split: the data sources do not include %s/qa/train.jsonl (SFT then needs "
                 "sft.trajectories)", sft.world)
    sft_inputs = [str(Path(sft.world) / "qa" / f"{s}.jsonl") for s in SPLITS] if "sft" in rows_by_split else []
    summary = summarize(rows_by_split, drops)

    with atomic_dir(data.out) as tmp:
        counts = {split: write_prepared(rows, tmp / f"{split}.parquet") for split, rows in rows_by_split.items()}
        if data.gate:
            _gate_output(tmp, data.out, validation, eval_questions, normalize_answer)
        write_json(tmp / "summary.json", summary)
        write_json(tmp / "manifest.json", {
            "stage": "data",
            "rows": counts,
            "files": {f"{s}.parquet": sha256_file(tmp / f"{s}.parquet") for s in counts},
            "inputs": {p: sha256_file(p) for p in dict.fromkeys(
                [s.path for s in data.sources] + list(data.eval_sets) + sft_inputs)},
            "params": data.model_dump(mode="json") | ({"sft": {k: getattr(sft, k) for k in SFT_KEYS}}
                                                     if sft_inputs else {}),
            "gates": {"inputs_qa_reports": reports, "output_prepared": "passed" if data.gate else "skipped"},
        })
    _log_summary(summary)
    return PrepareResult(str(data.out), counts, summary, reports)


def _gate_output(folder: Path, final_dir: str, validation: ValidateParams,
                 eval_questions: list[str], normalize: Callable[[str], str]) -> None:
    """The `prepared` contract on each parquet in the temporary folder (no report written)."""
    from mempo.validation.contracts import prepared_contract
    from mempo.validation.runner import run_contract

    for path in sorted(folder.glob("*.parquet")):
        contract = prepared_contract(path, validation, eval_questions, normalize)
        try:
            run_contract(contract, None, validation.sample_rows)
        except ValidationFailed as e:
            # Name the file as it would have been written, not the temporary folder.
            raise ValidationFailed(e.message, path=Path(final_dir) / path.name, row=e.row,
                                   field=e.field) from e


def _log_summary(summary: dict[str, Any]) -> None:
    for split, s in summary["splits"].items():
        log.info("data %s: %d rows by source %s, by k %s, by type %s; answer words p50=%s max=%s",
                 split, s["rows"], s["by_source"], s["by_k"], s["by_type"],
                 s["answer_words"].get("p50"), s["answer_words"].get("max"))
    if summary["dropped"]:
        log.info("data dropped: %s", summary["dropped"])


def run_data_stage(data: DataParams, validation: ValidateParams, params: Any = None) -> PrepareResult:
    """`prepare_data` inside an MLflow stage run: counts as metrics, summary as an artifact."""
    from mempo.tracking import log_json, log_metrics, stage_run

    inputs = {f"{s.name}_{s.split}": s.path for s in data.sources}
    with stage_run("data", params=params, data=inputs):
        result = prepare_data(data, validation, getattr(params, "sft", None))
        metrics = {f"rows_{k}": v for k, v in result.rows.items()}
        metrics.update({f"dropped_{k}": v for k, v in result.summary["dropped"].items()})
        for split, s in result.summary["splits"].items():
            metrics.update({f"{split}_k{k}": v for k, v in s["by_k"].items()})
        log_metrics(metrics)
        log_json(result.summary, "data_summary.json")
    return result
