"""How an evaluated episode ended: one outcome per sample row, and their shares.

    episode_outcome(row)            # -> "turn limit"
    outcome_shares(rows)            # -> {"correct": 0.25, "turn limit": 0.5, ...} (sums to 1)

EM says how many episodes were right; the outcome says why the others were not, which is
what a reader needs to tell a policy that loops until the turn budget runs out from one that
answers too early or loses an objective's answer from its memory. The outcomes, checked in
this order (the first that holds):

- `context limit`: the prompt outgrew the context window (`truncated`);
- `correct`: EM 1 (for k > 1: every objective right);
- `turn limit`: the turn budget ran out without an answer (`hit_turn_limit`);
- `no answer`: the episode ended without an `<answer>` (an invalid turn, an engine error);
- `wrong count` (k > 1): the answer has a number of `;`-separated parts other than k;
- `partly correct` (k > 1): some objectives right, not all;
- `wrong`: an answer of the right shape, every objective wrong.

Rows are `mempo.evaluation.metrics.SAMPLE_COLUMNS` rows (`samples.parquet`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from mempo.rewards import answer_parts

OUTCOMES = ("correct", "partly correct", "wrong", "wrong count", "no answer", "turn limit", "context limit")


def _flag(row: Mapping[str, Any], name: str) -> bool:
    value = row.get(name)
    if value is None:
        return False
    try:
        f = float(value)
    except (TypeError, ValueError):
        return False
    return not math.isnan(f) and f > 0


def episode_outcome(row: Mapping[str, Any]) -> str:
    """The outcome (one of `OUTCOMES`) of one sample row; see the module doc for the rules."""
    if _flag(row, "truncated"):
        return "context limit"
    if float(row.get("em") or 0.0) >= 1.0:
        return "correct"
    if _flag(row, "hit_turn_limit"):
        return "turn limit"
    prediction = str(row.get("prediction") or "").strip()
    if not prediction:
        return "no answer"
    k = int(row.get("k") or 1)
    if k > 1:
        if len(answer_parts(prediction)) != k:
            return "wrong count"
        if _flag(row, "objective_em"):
            return "partly correct"
    return "wrong"


def outcome_shares(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Share of rows per outcome, in `OUTCOMES` order, outcomes no row had left out ({} for no rows)."""
    counts = dict.fromkeys(OUTCOMES, 0)
    n = 0
    for r in rows:
        counts[episode_outcome(r)] += 1
        n += 1
    return {o: c / n for o, c in counts.items() if c} if n else {}
