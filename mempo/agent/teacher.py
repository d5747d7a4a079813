"""The scripted teacher: a `TurnPolicy` that solves knowledge-world tasks with real searches.

For each objective of a task (one for a plain question; k for a task from
`mempo.tasks.compose_multi_objective`) it walks the objective's hop `chain` hop by hop: it searches
for the hop's entity and relation through the retriever (a real `<search>`), checks that
the hop's value is in the returned passages, and falls back to `<access>` of the entity's
article (chunk after chunk) when the search missed it. Its memory keeps exactly what it has found: the facts of
the objective in progress, and for each finished objective its answer (a finished
objective's intermediate facts are no longer useful, so they are compressed away). When
every hop is found it answers `a1; a2; ...`; a hop it cannot find is answered "unknown",
so such trajectories score 0 and the SFT stage's correctness filter drops them.

On a k-objective task (k >= 2) the memory is laid out so that nothing has to be counted:
the finished objectives' answers as the final answer will list them, and the question in
progress copied from the task ("Answers: Paris; 1900. Now: Who founded X? X was founded by
Y."). The next prompt shows only the question and this memory; moving on to the next
objective is a copy of the text that follows the current question in the task, and the
final answer is a copy of the list. (A numbered layout, "Answer 1: ... Question 2: ...",
made a 2-layer policy skip or repeat objectives: k=2 all-correct 0.02 on 64 val tasks after
1,618 SFT steps.) At k=4 that copy is where policies fail: they jump from the question in
progress to a later one (benchmarks/objective_fates.py's "order"). `layout="queue"`
(`sft.memory_layout`) keeps the questions after the one in progress too ("Now: Who founded X?;
Where was Y born?"), so moving on drops the head of a list the memory already holds, and
nothing has to be found in the task. From one start (benchmarks/starts/97140847) the queue got
objective 2 of k=4 tasks right 0.20 of the time against 0.07, objectives 3-4 not more, and MemPO
trained from it answered k=2 tasks early, so `now` stays the default. (An earlier queue, "Now:
q2 ... Then: q3; q4", made the move itself right after 1,211 SFT steps but cost single-question
EM 0.24: docs/results.md.)

    teacher = ScriptedTeacher(tokenizer)               # or ScriptedTeacher(tokenizer, layout="queue")
    episodes = run_episodes(items, teacher, ToolEnv(retriever, tokenizer), tokenizer)

Works for any `TurnPolicy` consumer (the rollout loop, the SFT trajectory writer, the
context benchmark). It reads only the environment's observations, never the corpus.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mempo.agent.format import ANSWER_SEP
from mempo.agent.generation import Generation
from mempo.agent.rollout import TurnRequest
from mempo.rewards import normalize_answer
from mempo.tasks import OBJECTIVE_SEP, Task

# How a hop is phrased as a fact and as a search query.
_FACT = {
    "born_in": "{e} was born in {v}.",
    "birth_year": "{e} was born in {v}.",
    "works_for": "{e} works for {v}.",
    "founded_by": "{e} was founded by {v}.",
    "mayor": "The mayor of {e} is {v}.",
    "country": "{e} is in {v}.",
    "headquarters": "{e} is headquartered in {v}.",
    "author": "{e} was written by {v}.",
}
_QUERY = {
    "born_in": "{e} born in city",
    "birth_year": "{e} born year",
    "works_for": "{e} works for company",
    "founded_by": "{e} founded by",
    "mayor": "{e} mayor",
    "country": "{e} country",
    "headquarters": "{e} headquarters",
    "author": "{e} author",
}
# What the teacher says it is looking for, in its <think>.
_WANT = {
    "born_in": "the birth city", "birth_year": "the birth year", "works_for": "the employer",
    "founded_by": "the founder", "mayor": "the mayor", "country": "the country",
    "headquarters": "the headquarters city", "author": "the author",
}
NO_FACTS_YET = "Nothing found yet."
UNKNOWN_ANSWER = "unknown"
NOW = "Now: "  # heads the question in progress in a k >= 2 memory (either layout)
_NOW_RE = re.compile(r"(?:^|\s)" + NOW + r"(.*?\?)")


def now_question(memory: str | None) -> str | None:
    """The question a memory in the teacher's layout names as in progress: the text after
    "Now: " up to its first "?" (the head of the list in the queue layout); None without one."""
    m = _NOW_RE.search(memory or "")
    return m.group(1).strip() if m else None


def objective_order(memories: list[str | None], questions: list[str]) -> list[int]:
    """The objectives an episode's memories name as in progress, in the order visited: 1-based
    positions in `questions`, 0 for a question the task does not have (a miscopy); a repeat of
    the one before is dropped. The teacher visits 1..k; a policy may skip or go back.

        objective_order(["Now: A? x.", "Now: A? y.", "Now: C?", "Answers: 1; 2."], ["A?", "B?", "C?"])  # [1, 3]
    """
    qs = [q.strip() for q in questions]
    order: list[int] = []
    for memory in memories:
        q = now_question(memory)
        if q is not None:
            i = qs.index(q) + 1 if q in qs else 0
            if not order or order[-1] != i:
                order.append(i)
    return order


@dataclass
class _Hop:
    objective: int
    entity: str
    relation: str
    value: str


@dataclass
class _Plan:
    hops: list[_Hop]
    answers: list[str]
    questions: list[str]
    cursor: int = 0
    tried_access: bool = False
    found: list[bool] = field(default_factory=list)
    pending: bool = False  # an action for hops[cursor] is out; its observation comes next


_CHUNK_RE = re.compile(r"\[chunk (\d+)/(\d+)\]")


def _more_chunks(observation: str) -> bool:
    """Whether an access observation shows a chunk before the article's last one."""
    m = _CHUNK_RE.search(observation)
    return bool(m) and int(m.group(1)) < int(m.group(2))


def _want(hop: _Hop) -> str:
    return _WANT.get(hop.relation, "the " + hop.relation.replace("_", " "))


def _fact(hop: _Hop) -> str:
    return _FACT.get(hop.relation, "{e}: " + hop.relation.replace("_", " ") + " is {v}.").format(e=hop.entity, v=hop.value)


class ScriptedTeacher:
    """A scripted `TurnPolicy` for knowledge-world tasks (see the module docstring).

    Args:
        tokenizer: the policy tokenizer; responses are tokenised with it so the rollout's
            token records and masks are real.
        layout: the memory on k >= 2 tasks: "now" (the question in progress) or "queue" (it
            and the questions after it, `OBJECTIVE_SEP`-joined).
    """

    LAYOUTS = ("now", "queue")

    def __init__(self, tokenizer: Any, layout: str = "now") -> None:
        if layout not in self.LAYOUTS:
            raise ValueError(f"teacher memory layout {layout!r}: expected one of {', '.join(self.LAYOUTS)}")
        self.tokenizer = tokenizer
        self.layout = layout
        self._plans: dict[str, _Plan] = {}

    def _plan(self, item: Task) -> _Plan:
        hops: list[_Hop] = []
        for i, o in enumerate(item.objectives):
            if not o.chain:
                raise ValueError(f"task {item.id}: objective {i} has no metadata.chain (not a knowledge-world task)")
            hops.extend(_Hop(i, h.entity, h.relation, h.value) for h in o.chain)
        return _Plan(hops, [o.answers[0] for o in item.objectives], [o.question for o in item.objectives],
                     found=[False] * len(hops))

    def memory_text(self, plan: _Plan) -> str:
        """The memory after the hops before `plan.cursor`: answers of finished objectives,
        (k >= 2) the question of the objective in progress (with `layout="queue"` followed by the
        questions after it), and its facts found so far."""
        k = len(plan.answers)
        current = plan.hops[plan.cursor].objective if plan.cursor < len(plan.hops) else k
        parts: list[str] = []
        done = [self._objective_answer(plan, i) for i in range(min(current, k))]
        if k == 1 and done:
            parts.append(f"Answer: {done[0]}.")
        elif done:
            parts.append(f"Answers: {f'{ANSWER_SEP} '.join(done)}.")
        if k > 1 and current < k:
            todo = plan.questions[current:] if self.layout == "queue" else plan.questions[current:current + 1]
            parts.append(NOW + OBJECTIVE_SEP.join(todo))
        for j, h in enumerate(plan.hops[:plan.cursor]):
            if h.objective == current and plan.found[j]:
                parts.append(_fact(h))
        return " ".join(parts) or NO_FACTS_YET

    @staticmethod
    def _objective_answer(plan: _Plan, i: int) -> str:
        """Objective i's answer, or "unknown" when one of its hops was not found."""
        hops_i = [j for j, h in enumerate(plan.hops) if h.objective == i]
        return plan.answers[i] if all(plan.found[j] for j in hops_i) else UNKNOWN_ANSWER

    def _final_answer(self, plan: _Plan) -> str:
        return f"{ANSWER_SEP} ".join(self._objective_answer(plan, i) for i in range(len(plan.answers)))

    def next_turn_text(self, request: TurnRequest) -> str:
        """The teacher's response text for this turn (updates its per-episode plan)."""
        plan = self._plans.get(request.episode_id)
        if plan is None or request.turn_index == 0:
            plan = self._plans[request.episode_id] = self._plan(request.item)
        if plan.pending:
            plan.pending = False
            hop = plan.hops[plan.cursor]
            obs = normalize_answer(request.last_observation or "")
            if f" {normalize_answer(hop.value)} " in f" {obs} ":
                plan.found[plan.cursor] = True
                plan.cursor += 1
                plan.tried_access = False
            elif not plan.tried_access:
                plan.tried_access = True
                plan.pending = True
                mem = self.memory_text(plan)
                return (f"<mem> {mem} </mem> <think> The search did not show {_want(hop)} "
                        f"of {hop.entity}; I will read its article. </think> <access> {hop.entity} </access>")
            elif _more_chunks(request.last_observation or ""):
                plan.pending = True
                mem = self.memory_text(plan)
                return (f"<mem> {mem} </mem> <think> Not in this part of the article; I will read "
                        f"the next part. </think> <access> {hop.entity} </access>")
            else:
                plan.cursor += 1  # give up this hop; its objective will be answered "unknown"
                plan.tried_access = False
        mem = self.memory_text(plan)
        if plan.cursor >= len(plan.hops):
            self._plans.pop(request.episode_id, None)
            return (f"<mem> {mem} </mem> <think> I have what I need to answer. </think> "
                    f"<answer> {self._final_answer(plan)} </answer>")
        hop = plan.hops[plan.cursor]
        plan.pending = True
        query = _QUERY.get(hop.relation, "{e} " + hop.relation.replace("_", " ")).format(e=hop.entity)
        return (f"<mem> {mem} </mem> <think> Next I need {_want(hop)} of "
                f"{hop.entity}. </think> <search> {query} </search>")

    async def respond(self, request: TurnRequest) -> Generation:
        text = self.next_turn_text(request)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Generation(text=self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids, logprobs=None)
