"""Runs of consecutive items where each extends the one before: the turns of one
full-history episode, whose prompts grow by the last response and observation. SFT
(`sft.merge_prefix_turns`) and GRPO (`grpo_update.merge_turn_samples`) merge each run into one
sequence; this is the grouping both use.

    chained_runs([a, b, c], lambda prev, cur: ...)  # -> [[a, b], [c]]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def chained_runs(items: Sequence[T], extends: Callable[[T, T], bool]) -> list[list[T]]:
    """Split `items` in order into runs; an item joins the current run when
    `extends(previous item, item)` holds, else it starts a new run."""
    runs: list[list[T]] = []
    for item in items:
        if runs and extends(runs[-1][-1], item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs
