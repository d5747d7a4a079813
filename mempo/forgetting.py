"""Forgetting: did an agent's memory drop an objective's answer it had already seen?

The mechanism the memory advantage exists to fix: on a k-objective task the memory must
carry each finished objective's answer until the final `<answer>`. An episode *forgets*
when, for some objective, one of its gold answers appeared in a memory (or, with
`sources=SEEN`, also in an observation), and a LATER memory written before the final answer
no longer contains any of them. The forgetting rate is the share of k >= 2 episodes that
forget.

    turns = [MemoryStep(memory="Nothing found yet.", observation="... born in Paris ..."),
             MemoryStep(memory="Answer 1: Paris.", observation="... founded in 1900 ..."),
             MemoryStep(memory="Answer 2: 1900.", observation=None)]       # Paris dropped
    objective_forgotten([["Paris"], ["1900"]], turns)    # -> [True, False]
    episode_forgot([["Paris"], ["1900"]], turns)         # -> True

Why memories only by default: an answer often shows up in a passage before the agent has
any reason to look for it (objective 3's city in objective 1's search results). The
scripted teacher, whose memory never drops an answer it has stored, "forgets" 5-18 % of its
k = 2..4 episodes under the observation-or-memory rule (60 tasks per k on the small world),
and 0 % under the memory rule. `sources=SEEN` (the literal rule: an answer seen in an
observation must be kept) is reported beside it as `forgetting_rate_seen`.

Timing: the observation of turn t is the environment's reply to it, first visible to the
memory of turn t+1; a memory written at turn t is checked against the memories of turns
t+1 .. T-1 (the last turn writes its memory before its answer, so it counts). A turn that
wrote no memory counts as a memory without the answer. Matching uses the project's answer
normaliser (`mempo.rewards.normalize_answer`) and whole words, so "Paris" is not found in
"Parisian". Pure functions; the trainers' logs and the evaluation call these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mempo.rewards import normalize_answer


@dataclass(frozen=True)
class MemoryStep:
    """One turn as forgetting sees it: the memory the turn wrote (None: none) and the
    environment's observation of its action (None after an answer or when there was none)."""

    memory: str | None
    observation: str | None = None


MEMORY_ONLY = ("memory",)
SEEN = ("memory", "observation")


def _contains(text: str | None, answers: Sequence[str]) -> bool:
    if not text:
        return False
    hay = f" {normalize_answer(text)} "
    return any((g := normalize_answer(a)) and f" {g} " in hay for a in answers)


def objective_forgotten(objectives: Sequence[Sequence[str]], steps: Sequence[MemoryStep],
                        sources: Sequence[str] = MEMORY_ONLY) -> list[bool]:
    """Per objective (gold answer list each): True when its answer appeared in one of
    `sources` ("memory", "observation") and a later memory lacks it (module docstring)."""
    out: list[bool] = []
    memories = [s.memory for s in steps]
    for answers in objectives:
        first_check: int | None = None  # the first turn whose memory must hold the answer
        for t, step in enumerate(steps):
            if any(_contains(getattr(step, src), answers) for src in sources):
                first_check = t + 1
                break
        if first_check is None:
            out.append(False)
            continue
        out.append(any(not _contains(m, answers) for m in memories[first_check:]))
    return out


def episode_forgot(objectives: Sequence[Sequence[str]], steps: Sequence[MemoryStep],
                   sources: Sequence[str] = MEMORY_ONLY) -> bool:
    """True when any objective of the episode was forgotten."""
    return any(objective_forgotten(objectives, steps, sources))


def forgetting_rate(episodes: Iterable[tuple[Sequence[Sequence[str]], Sequence[MemoryStep]]],
                    sources: Sequence[str] = MEMORY_ONLY) -> float | None:
    """Share of k >= 2 episodes (objectives, steps) that forgot; None when there is none."""
    flags = [episode_forgot(objs, steps, sources) for objs, steps in episodes if len(objs) >= 2]
    return sum(flags) / len(flags) if flags else None


# Where each objective of a finished episode ended up (`objective_fates`), in the order a
# reader follows an answer: retrieved? written to a memory? still there at the end? answered?
FATES = ("right", "never retrieved", "retrieved, never in a memory", "in a memory, then dropped",
         "in the last memory, answered wrong")


def objective_fates(objectives: Sequence[Sequence[str]], steps: Sequence[MemoryStep],
                    correct: Sequence[float | bool]) -> list[str]:
    """Per objective, why its answer part came out right or wrong (one of `FATES`):

    - "right": `correct[i]` (the objective's EM);
    - "never retrieved": no observation of the episode contains a gold answer (the agent
      answered, or ran out of turns, without having retrieved it);
    - "retrieved, never in a memory": an observation held it, no memory ever did;
    - "in a memory, then dropped": a memory held it, the last memory does not (forgetting);
    - "in the last memory, answered wrong": the last memory held it and the answer part
      still missed it.

    A gold answer can turn up in a passage retrieved for another objective, so "retrieved"
    means "was in front of the agent", not "was searched for". Matching as `_contains`.

        steps = [MemoryStep("Looking for the city.", "... born in Paris ..."),
                 MemoryStep("Answer 1: Paris.", None)]
        objective_fates([["Paris"], ["1900"]], steps, [1.0, 0.0])  # -> ["right", "never retrieved"]
    """
    if len(correct) != len(objectives):
        raise ValueError(f"{len(correct)} objective scores for {len(objectives)} objectives")
    memories = [s.memory for s in steps]
    last = memories[-1] if memories else None  # a last turn without a memory kept nothing
    fates = []
    for answers, ok in zip(objectives, correct, strict=True):
        if ok:
            fates.append(FATES[0])
        elif _contains(last, answers):
            fates.append(FATES[4])
        elif any(_contains(m, answers) for m in memories):
            fates.append(FATES[3])
        elif any(_contains(s.observation, answers) for s in steps):
            fates.append(FATES[2])
        else:
            fates.append(FATES[1])
    return fates
