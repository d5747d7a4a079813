"""MLflow GenAI scoring of eval samples, and the check that it agrees with our own numbers.

    from mempo.evaluation.genai import check_genai
    check_genai(rows, items, per_agent=20)    # inside an active MLflow run; raises on disagreement

`genai_scores` runs `mlflow.genai.evaluate` with code scorers (the same `mempo.rewards`
functions, through `answer_scores`), so each sample is an MLflow trace with its
assessments; `check_genai` is why the stage runs it: MLflow's mean EM / F1 / substring EM
over a subset must equal the runner's, or the stage fails.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mempo.errors import MempoError
from mempo.tasks import Task


def genai_subset(rows: Sequence[Mapping[str, Any]], per_agent: int) -> list[Mapping[str, Any]]:
    """The first rows of each (agent, benchmark), about `per_agent` rows per agent in all."""
    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    per_pair = max(1, per_agent // max(1, len(benches)))
    taken: dict[tuple[str, str], int] = {}
    out = []
    for r in rows:
        key = (r["agent"], r["benchmark"])
        if taken.get(key, 0) < per_pair:
            taken[key] = taken.get(key, 0) + 1
            out.append(r)
    return out


def genai_scores(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Score samples with `mlflow.genai.evaluate` and code scorers (EM, F1, substring EM, the
    `mempo.rewards` functions through `answer_scores`), one evaluation per agent in a nested
    MLflow run `genai-<agent>`; each sample becomes an MLflow trace with its assessments.

    Runs offline against sqlite with no LLM judge. It logs a trace per sample (about 0.3 s
    each on sqlite here), which is why the runner scores a subset (`mlflow_genai_samples`).
    Rows may carry `_objectives` (per-objective gold lists, `Task.answer_lists`).

    Returns `{agent: {"em": mean, "f1": mean, "substring_em": mean}}` as MLflow computed them.
    """
    import os

    import mlflow
    from mlflow.genai.scorers import scorer

    from mempo.evaluation.metrics import answer_scores as _scores

    def _score(name: str) -> Any:
        def fn(outputs: dict[str, Any], expectations: dict[str, Any]) -> float:
            return float(_scores(outputs.get("prediction") or None, expectations["golden_answers"],
                                 expectations.get("objectives"))[name])

        fn.__name__ = name
        return scorer(fn)

    scorers = [_score("em"), _score("f1"), _score("substring_em")]
    out: dict[str, dict[str, float]] = {}
    # sqlite serialises writers: parallel trace logging only exhausts the connection pool.
    saved = {k: os.environ.get(k) for k in ("MLFLOW_GENAI_EVAL_MAX_WORKERS", "MLFLOW_GENAI_EVAL_MAX_SCORER_WORKERS")}
    if mlflow.get_tracking_uri().startswith("sqlite"):
        for k in saved:
            os.environ.setdefault(k, "1")
    try:
        for agent in dict.fromkeys(r["agent"] for r in rows):
            data = []
            for r in rows:
                if r["agent"] != agent:
                    continue
                expectations: dict[str, Any] = {"golden_answers": list(r["golden_answers"])}
                if r.get("_objectives"):
                    expectations["objectives"] = [list(o) for o in r["_objectives"]]
                data.append({
                    "inputs": {"question": r["question"], "benchmark": r["benchmark"], "id": r["id"]},
                    "outputs": {"prediction": "" if r["truncated"] else r["prediction"]},
                    "expectations": expectations,
                })
            with mlflow.start_run(run_name=f"genai-{agent}", nested=True):
                res = mlflow.genai.evaluate(data=data, scorers=scorers)
            out[agent] = {m.split("/")[0]: float(v) for m, v in res.metrics.items() if m.endswith("/mean")}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def check_genai(rows: list[dict[str, Any]], items: Mapping[str, Sequence[Task]], per_agent: int) -> None:
    """Score a subset with `mlflow.genai.evaluate` and check it agrees with our own numbers."""
    by_id = {(b, it.id): it for b, its in items.items() for it in its}
    subset = [dict(r) for r in genai_subset(rows, per_agent)]
    for r in subset:
        r["_objectives"] = by_id[(r["benchmark"], r["id"])].answer_lists
    genai = genai_scores(subset)
    for agent, scores in genai.items():
        mine = [r for r in subset if r["agent"] == agent]
        for metric, value in scores.items():
            own = sum(r[metric] for r in mine) / len(mine)
            if not math.isclose(own, value, abs_tol=1e-9):
                raise MempoError(f"mlflow.genai.evaluate {agent}/{metric} = {value} disagrees with {own}")
