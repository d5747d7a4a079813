"""Answer scoring and the outcome reward R^T: the project's ONE answer normaliser.

Pure functions, no trainer needed. Metrics return per-sample values; aggregate with a mean.

    normalize_answer("The  U.S. Navy!")             # -> "us navy" (SQuAD / FlashRAG / Search-R1)
    exact_match("the Eiffel Tower", ["Eiffel Tower"])          # -> 1.0
    substring_match("It is the Eiffel Tower.", ["eiffel tower"])  # -> 1.0
    token_f1("Eiffel Tower Paris", ["Eiffel Tower"])           # -> 0.8 (P=2/3, R=1)
    multi_objective_scores("Paris; 1900", ["Paris", ["1901", "1900"]])
    # -> ObjectiveScores(per_objective=[1.0, 1.0], mean=1.0, all_correct=1.0, parts=2)
    outcome_reward(answer="Paris", golden_answers=["Paris"], format_valid=True)   # -> 1.0
    compute_score("world", "<mem> m </mem> <answer> Paris </answer>", ["Paris"])  # -> 1.0

Worked example of the outcome reward with a format penalty of 0.2 (`mempo.format_penalty`):
a correct answer in an episode with an invalid turn scores 1 - 0.2 = 0.8 when
`format_rule="penalty"`, and 0 under the default `format_rule="strict"` (MemPO: R^T = 1 only
when the answer is correct AND the format valid).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mempo.agent.format import ANSWER_SEP, ParsedTurn, parse_turn

MultiRule = Literal["all", "mean", "mean_k", "any"]
FormatRule = Literal["strict", "penalty", "ignore"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
# Answers that only match themselves in token F1 (FlashRAG / Search-R1 / HotpotQA rule): a
# prediction "no" shares no credit with "no idea", a gold "yes" none with "yes and no".
_EXACT_ONLY = frozenset({"yes", "no", "noanswer"})

PunctRule = Literal["delete", "space"]


def normalize_answer(text: str, punct: PunctRule = "delete") -> str:
    """Lowercase, delete punctuation, drop English articles, collapse whitespace.

    This is the standard normaliser of SQuAD, FlashRAG and Search-R1 (the numbers papers
    report), so "U.S." -> "us", "1,000" -> "1000", "O'Keefe" -> "okeefe". `punct="space"`
    replaces punctuation by a space instead ("Eiffel-Tower" -> "eiffel tower"); it is an
    option only, and makes results not comparable with published numbers.
    """
    s = str(text).lower()
    if punct == "delete":
        s = "".join(ch for ch in s if ch not in _PUNCT)
    elif punct == "space":
        s = "".join(" " if ch in _PUNCT else ch for ch in s)
    else:
        raise ValueError(f"unknown punctuation rule '{punct}' (delete | space)")
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _as_list(golden: str | Sequence[str]) -> list[str]:
    return [golden] if isinstance(golden, str) else [str(g) for g in golden]


def exact_match(prediction: str | None, golden_answers: str | Sequence[str], punct: PunctRule = "delete") -> float:
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0."""
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction, punct)
    return float(any(p == normalize_answer(g, punct) for g in _as_list(golden_answers)))


def substring_match(prediction: str | None, golden_answers: str | Sequence[str], punct: PunctRule = "delete") -> float:
    """1.0 when any normalised gold answer is a substring of the normalised prediction (a
    plain substring, exactly FlashRAG's `acc` and Search-R1's `subem_check`)."""
    if prediction is None:
        return 0.0
    p = normalize_answer(prediction, punct)
    return float(any(normalize_answer(gold, punct) in p for gold in _as_list(golden_answers)))


def token_f1(prediction: str | None, golden_answers: str | Sequence[str], punct: PunctRule = "delete") -> float:
    """Best token-level F1 between the normalised prediction and any gold answer, in [0, 1].

    As FlashRAG / Search-R1 / HotpotQA: yes / no / noanswer score 0 unless both sides are the
    same one of them, and an empty side scores 0.
    """
    if prediction is None:
        return 0.0
    pred_norm = normalize_answer(prediction, punct)
    pred = pred_norm.split()
    best = 0.0
    for g in _as_list(golden_answers):
        gold_norm = normalize_answer(g, punct)
        if (pred_norm in _EXACT_ONLY or gold_norm in _EXACT_ONLY) and pred_norm != gold_norm:
            continue
        gold = gold_norm.split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common == 0:
            continue
        prec, rec = common / len(pred), common / len(gold)
        best = max(best, 2 * prec * rec / (prec + rec))
    return best


@dataclass(frozen=True)
class ObjectiveScores:
    """Per-objective exact match of a `a1; a2; ...` answer and its aggregates (all in [0, 1]),
    and how many `;`-separated parts the answer had (0 for no answer)."""

    per_objective: list[float]
    mean: float
    all_correct: float
    parts: int = 0

    def score(self, rule: MultiRule = "all") -> float:
        """The task's correctness under `rule`: all objectives right; their mean; their mean
        only when the answer has exactly one part per objective, else 0 (`mean_k`: partial
        credit that does not pay an answer which dropped objectives); or any right."""
        if rule == "all":
            return self.all_correct
        if rule == "mean":
            return self.mean
        if rule == "mean_k":
            return self.mean if self.parts == len(self.per_objective) else 0.0
        if rule == "any":
            return float(any(self.per_objective))
        raise ValueError(f"unknown multi-objective rule '{rule}' (all | mean | mean_k | any)")


def answer_parts(prediction: str | None) -> list[str]:
    """The `;`-separated parts of an answer, stripped ([] for no answer): the objectives' answers
    in order, and what `mean_k` and the `wrong count` outcome count."""
    return [] if prediction is None else [p.strip() for p in prediction.split(ANSWER_SEP)]


def multi_objective_scores(
    prediction: str | None, objectives: Sequence[str | Sequence[str]]
) -> ObjectiveScores:
    """Score a `;`-separated answer against one gold answer list per objective, in order.

    Missing parts score 0; extra parts are ignored. `objectives[i]` is a string or a list of
    accepted answers for objective i.
    """
    k = len(objectives)
    parts = answer_parts(prediction)
    per = [exact_match(parts[i], objectives[i]) if i < len(parts) else 0.0 for i in range(k)]
    mean = sum(per) / k if k else 0.0
    return ObjectiveScores(per, mean, float(k > 0 and all(per)), len(parts))


def objective_answers(golden_answers: Sequence[str], extra_info: dict[str, Any] | None = None) -> list[list[str]]:
    """Per-objective gold answer lists: from `metadata.objectives` when given, else split
    the single gold string `a1; a2; ...` (one objective when there is no `;`)."""
    objs = None
    if extra_info:
        objs = extra_info.get("objectives") or (extra_info.get("metadata") or {}).get("objectives")
    if objs:
        return [_as_list(o["golden_answers"]) for o in objs]
    golds = _as_list(golden_answers)
    if len(golds) == 1 and ANSWER_SEP in golds[0]:
        return [[p.strip()] for p in golds[0].split(ANSWER_SEP)]
    return [golds]


def answer_correctness(
    answer: str | None,
    golden_answers: Sequence[str],
    objectives: Sequence[Sequence[str]] | None = None,
    multi_rule: MultiRule = "all",
) -> float:
    """Correctness in [0, 1]: EM for one objective, `multi_rule` over objectives otherwise."""
    objs = list(objectives) if objectives is not None else objective_answers(golden_answers)
    if len(objs) <= 1:
        return exact_match(answer, objs[0] if objs else golden_answers)
    return multi_objective_scores(answer, objs).score(multi_rule)


def episode_format_valid(turns: Sequence[str | ParsedTurn | Any]) -> bool:
    """An episode's format is valid when every turn is valid and the last one answers.

    `turns`: turn texts (parsed here), or anything with `valid` and `action` (a kept
    `ParsedTurn`, a rollout's `TurnRecord`), which is not parsed again.
    """
    if not turns:
        return False
    parsed = [parse_turn(t) if isinstance(t, str) else t for t in turns]
    return all(p.valid for p in parsed) and parsed[-1].action == "answer"


def outcome_reward(
    answer: str | None,
    golden_answers: Sequence[str],
    format_valid: bool,
    objectives: Sequence[Sequence[str]] | None = None,
    multi_rule: MultiRule = "all",
    format_rule: FormatRule = "strict",
    format_penalty: float = 0.0,
    no_answer_penalty: float = 0.0,
) -> float:
    """R^T: correctness of the final answer, gated or penalised by format validity.

    `format_rule`: "strict" (MemPO default: R = correct AND valid, so 0 when invalid),
    "penalty" (R = correct - format_penalty when invalid, floored at -format_penalty),
    "ignore" (R = correct).
    `no_answer_penalty`: an episode that ends without a final answer (`answer` None: the turn
    or context limit) scores -no_answer_penalty whatever the format rule; a wrong answer
    keeps 0. Default 0: no answer and a wrong answer score the same, as in MemPO. A positive
    value is an explicit push to answer before the turn limit.
    """
    if answer is None and no_answer_penalty:
        return -float(no_answer_penalty)
    correct = answer_correctness(answer, golden_answers, objectives, multi_rule)
    if format_valid or format_rule == "ignore":
        return correct
    if format_rule == "strict":
        return 0.0
    if format_rule == "penalty":
        return correct - format_penalty
    raise ValueError(f"unknown format rule '{format_rule}' (strict | penalty | ignore)")


def episode_score(
    answer: str | None,
    format_valid: bool,
    ground_truth: str | Sequence[str] | dict[str, Any],
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """R^T of an episode whose final answer and format validity are known (no parsing).

    `ground_truth` is the gold answer list (or a dict with `target` as verl's RL datasets
    store it, or a numpy array); `extra_info` may carry `objectives` /
    `metadata.objectives`. kwargs: `multi_rule`, `format_rule`, `format_penalty`
    (defaults: all, strict, 0.0). Example: `episode_score("Paris", True, ["Paris"])` -> 1.0.
    """
    if isinstance(ground_truth, dict):
        ground_truth = ground_truth.get("target", ground_truth.get("golden_answers", []))
    if hasattr(ground_truth, "tolist") and not isinstance(ground_truth, str):
        ground_truth = ground_truth.tolist()
    golds = _as_list(ground_truth)  # type: ignore[arg-type]
    return outcome_reward(
        answer, golds, bool(format_valid), objective_answers(golds, extra_info),
        multi_rule=kwargs.get("multi_rule", "all"),
        format_rule=kwargs.get("format_rule", "strict"),
        format_penalty=float(kwargs.get("format_penalty", 0.0)),
        no_answer_penalty=float(kwargs.get("no_answer_penalty", 0.0)),
    )


_TURN_SPLIT = re.compile(r"(?=<mem>)")


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str | Sequence[str] | dict[str, Any],
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """verl's `reward.custom_reward_function` signature: R^T of one decoded trajectory.

    `solution_str` is the model's output: one turn, or several turns concatenated (with
    `<information>` blocks between them); turns are split at each `<mem>`, observations are
    dropped, and every turn must be valid. The rest as `episode_score`. (`mem_agent`
    episodes are scored from their structured fields instead, see
    `mempo.verl_plugin.reward`.)
    """
    text = re.sub(r"<information>.*?</information>", " ", solution_str or "", flags=re.S)
    turns = [parse_turn(t) for t in _TURN_SPLIT.split(text) if t.strip()]
    answer = turns[-1].argument if turns and turns[-1].action == "answer" else None
    return episode_score(answer, episode_format_valid(turns), ground_truth, extra_info, **kwargs)
