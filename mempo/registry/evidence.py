"""The evidence a model version carries: eval metrics read from files, tags written and read back.

    from mempo.registry.evidence import read_metrics_file, eval_set_fingerprints
    read_metrics_file("outputs/eval/metrics.json")       # {"memory/world/em": 0.41, ...}

A version's tags are kept to what a reader and the gate need: `metric.<key>` (the gate's
evidence), `headline.<key>` and `eval_set.<benchmark>` (the question count and sha256 of each
benchmark's questions). This module spells those tags and parses them back
(`version_metrics`, `version_eval_sets`); `mempo.registry.register` writes them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mempo.errors import DataError
from mempo.io import flatten_numbers

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

METRIC_TAG_PREFIX = "metric."
HEADLINE_TAG_PREFIX = "headline."
EVAL_SET_TAG_PREFIX = "eval_set."
DIGEST_CHARS = 16


def read_metrics_file(path: str | Path) -> dict[str, float]:
    """A flat `{key: number}` table from an eval metrics.json (nested dicts joined with "/")."""
    p = Path(path)
    if not p.is_file():
        raise DataError("metrics file not found (run the eval stage first)", path=p)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"not valid JSON: {e.msg}", path=p, row=e.lineno) from e
    if not isinstance(raw, dict):
        raise DataError("expected a JSON object of metrics", path=p)
    flat = flatten_numbers(raw)
    if not flat:
        raise DataError("no numeric metrics in the file", path=p)
    return flat


def version_metrics(version: Any, client: MlflowClient | None = None) -> dict[str, float]:
    """The metric table of a model version: its `metric.*` tags (the gate's evidence), then,
    with a `client`, any other metric linked to its logged model (the full evaluation)."""
    out: dict[str, float] = {}
    model_id = logged_model_id(version)
    if client is not None and model_id:
        from mlflow.exceptions import MlflowException

        try:
            for m in client.get_logged_model(model_id).metrics or []:
                out[m.key] = float(m.value)
        except MlflowException as e:
            log.warning("logged model %s of %s v%s not readable (%s); using its tags only",
                        model_id, version.name, version.version, e)
    for k, v in (version.tags or {}).items():
        if k.startswith(METRIC_TAG_PREFIX):
            try:
                out[k[len(METRIC_TAG_PREFIX):]] = float(v)
            except ValueError:
                continue
    return out


def logged_model_id(version: Any) -> str | None:
    """The id of the logged model a version points at (`models:/m-...` source), or None.

    The sqlite store does not keep `ModelVersion.model_id`; the source URI always has it.
    """
    model_id = getattr(version, "model_id", None)
    if model_id:
        return str(model_id)
    source = str(getattr(version, "source", "") or "")
    rest = source.removeprefix("models:/")
    return rest if rest != source and rest.startswith("m-") and "/" not in rest else None


def eval_set_tags(sets: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """`{"eval_set.<benchmark>": "n=16 sha256=98c9d493013eb104"}`: short enough to read in
    the MLflow UI; 16 hex digits of the hash are plenty to tell two question sets apart."""
    return {f"{EVAL_SET_TAG_PREFIX}{b}": f"n={s['n']} sha256={str(s['sha256'])[:DIGEST_CHARS]}"
            for b, s in sorted(sets.items())}


def version_eval_sets(version: Any) -> dict[str, dict[str, Any]] | None:
    """The eval sets recorded on a version (`eval_set.*` tags), or None when it has none."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in (version.tags or {}).items():
        if not k.startswith(EVAL_SET_TAG_PREFIX):
            continue
        fields = dict(part.split("=", 1) for part in str(v).split() if "=" in part)
        try:
            out[k[len(EVAL_SET_TAG_PREFIX):]] = {"n": int(fields["n"]), "sha256": fields["sha256"]}
        except (KeyError, ValueError):
            continue
    return out or None


def eval_set_fingerprints(samples_path: str | Path) -> dict[str, dict[str, Any]]:
    """`{benchmark: {"n": questions, "sha256": ...}}` of an eval stage's samples.parquet.

    The hash covers each question's id, text and gold answers (sorted by id), so two
    evaluations compare only if they asked exactly the same questions.
    """
    import pyarrow.parquet as pq

    p = Path(samples_path)
    if not p.is_file():
        raise DataError("samples.parquet not found (run the eval stage first)", path=p)
    cols = ["benchmark", "id", "question", "golden_answers"]
    try:
        rows = pq.read_table(p, columns=cols).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"not a samples.parquet with columns {cols} ({type(e).__name__}: {e})", path=p) from e
    per: dict[str, dict[str, str]] = {}
    for r in rows:
        line = json.dumps([str(r["id"]), str(r["question"]), [str(a) for a in r["golden_answers"] or []]],
                          ensure_ascii=False)
        per.setdefault(str(r["benchmark"]), {})[str(r["id"])] = line
    out: dict[str, dict[str, Any]] = {}
    for bench, items in sorted(per.items()):
        h = hashlib.sha256()
        for _, line in sorted(items.items()):
            h.update(line.encode())
            h.update(b"\n")
        out[bench] = {"n": len(items), "sha256": h.hexdigest()}
    return out
