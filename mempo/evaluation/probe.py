"""The memory probe: how much of the gold answer an agent's final memory still holds.

    from mempo.evaluation.probe import add_memory_probe
    add_memory_probe(rows, engine)      # sets rows[i]["memory_probe"] in place

Scores with the evaluated model itself (teacher-forced, no generation), so it needs the
local model (backend hf); with backend openai the column stays NaN.
"""

from __future__ import annotations

from typing import Any

from mempo.evaluation.agents import MULTI_TURN_AGENTS
from mempo.evaluation.engine import Engine


def add_memory_probe(rows: list[dict[str, Any]], engine: Engine, batch_size: int = 16) -> None:
    """Set `memory_probe` = P(gold answer | question, final memory) on rows with a memory.

    P is `mempo.advantage.answer_probability` (geometric-mean token probability of the
    first gold answer, teacher-forced after the answer-probe prompt). Rows without a memory,
    or without a local model (backend openai), keep NaN.
    """
    if engine.model is None:
        return
    from mempo.advantage import answer_probability
    from mempo.agent.format import (
        ANSWER_PROBE_PREFIX,
        answer_continuation,
        answer_probe_messages,
        render_prompt,
    )

    todo = [r for r in rows if r["agent"] in MULTI_TURN_AGENTS and r.get("final_memory")]
    if not todo:
        return
    prompts = [render_prompt(engine.tokenizer, answer_probe_messages(r["question"], r["final_memory"]),
                             ANSWER_PROBE_PREFIX) for r in todo]
    answers = [answer_continuation(r["golden_answers"][0]) for r in todo]
    probs = answer_probability(engine.model, engine.tokenizer, prompts, answers, batch_size=batch_size).prob
    for r, p in zip(todo, probs.tolist(), strict=True):
        r["memory_probe"] = float(p)
