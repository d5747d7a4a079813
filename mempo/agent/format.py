"""The MemPO turn format: the ONE home of the system prompt, the user template and the tags.

Every assistant turn is

    <mem> summary of everything useful so far </mem>
    <think> reasoning </think>
    <search> query </search>            (or <access> title or doc id </access>,
                                         or, to finish, <answer> a1; a2; ... </answer>)

and the environment answers a search / access with `<information> ... </information>`.
Both trainers, the data stage (verl parquet `prompt` = `build_messages(question)`), the
scripted teacher and the evaluation import from here; nothing else spells a tag.

    from mempo.agent.format import build_messages, parse_turn
    msgs = build_messages("Who founded X?")                  # first turn: question only
    turn = parse_turn("<mem> X was founded in 1900 </mem> <search> X founder </search>")
    turn.action, turn.argument, turn.valid                   # -> "search", "X founder", True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["search", "answer", "access"]

MEM_OPEN, MEM_CLOSE = "<mem>", "</mem>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
ACCESS_OPEN, ACCESS_CLOSE = "<access>", "</access>"
INFO_OPEN, INFO_CLOSE = "<information>", "</information>"

TAGS: list[str] = [
    MEM_OPEN, MEM_CLOSE, THINK_OPEN, THINK_CLOSE, SEARCH_OPEN, SEARCH_CLOSE,
    ANSWER_OPEN, ANSWER_CLOSE, ACCESS_OPEN, ACCESS_CLOSE, INFO_OPEN, INFO_CLOSE,
]
ACTIONS: tuple[Action, ...] = ("search", "answer", "access")

# Generation stops right after an action closes; the environment then replies.
STOP_SEQUENCES: list[str] = [SEARCH_CLOSE, ANSWER_CLOSE, ACCESS_CLOSE]

# Separator between objectives in a multi-objective answer (same as mempo.tasks).
ANSWER_SEP = ";"

SYSTEM_PROMPT = (
    "You are a research assistant that answers questions by searching a knowledge base. "
    "You work in turns. Every turn you write, in this order:\n"
    "1. <mem> ... </mem>: your memory. Rewrite it every turn so that it keeps every fact "
    "you have found that is useful for the question, and nothing else. Earlier turns will "
    "not be shown to you again; only this memory and your last action with its result.\n"
    "2. <think> ... </think>: your reasoning about what to do next.\n"
    "3. Exactly one action:\n"
    "   <search> query </search> to search the knowledge base; the results come back "
    "between <information> and </information>;\n"
    "   <access> title or doc id </access> to read a whole article, one chunk at a time;\n"
    "   <answer> final answer </answer> when you know the answer. For several questions "
    "separated by ';', answer all of them in order, separated by ';'.\n"
    "Write nothing after the action."
)

USER_QUESTION_TEMPLATE = "Question: {question}"
USER_MEMORY_TEMPLATE = "Your memory so far:\n" + MEM_OPEN + " {memory} " + MEM_CLOSE
USER_LAST_ACTION_TEMPLATE = "Your last action:\n{action}\n{observation}"

# Corrective observation for a turn without a valid action (Search-R1 style): it tells the
# model the format again; the turn also counts against the episode's format reward.
INVALID_TURN_OBSERVATION = (
    "Your previous turn was not in the required format ({error}). Write <mem> ... </mem>, "
    "then <think> ... </think>, then exactly one of <search> query </search>, "
    "<access> title </access> or <answer> final answer </answer>, and nothing after it."
)

# Answer probe for the memory reward: the rendered prompt ends with this assistant prefix and
# the scored continuation is " " + answer (the leading space keeps BPE word boundaries as
# they are when the model writes `<answer> a`).
ANSWER_PROBE_PREFIX = ANSWER_OPEN


@dataclass(frozen=True)
class ParsedTurn:
    """What `parse_turn` found in one assistant response.

    Attributes:
        mem: text inside the first `<mem>...</mem>` (stripped), or None.
        think: text inside the first `<think>...</think>` (stripped), or None.
        action: "search" | "answer" | "access", or None when no action tag closes.
        argument: the action's argument (stripped), or None.
        valid: the turn follows the format exactly (see `parse_turn`).
        error: why it is not valid ("" when valid).
        mem_span: (start, end) character offsets of the raw memory content between the
            tags in the parsed text (unstripped), or None. Used to build token masks.
    """

    mem: str | None
    think: str | None
    action: Action | None
    argument: str | None
    valid: bool
    error: str
    mem_span: tuple[int, int] | None = None

    def action_text(self) -> str:
        """The action as it appeared, normalised: `<search> q </search>` ("" if none)."""
        if self.action is None:
            return ""
        return f"<{self.action}> {self.argument or ''} </{self.action}>"


_TAG_RE = re.compile(r"</?(mem|think|search|answer|access|information)>")


def _block(text: str, name: str) -> tuple[str, int, int, int, int] | None:
    """First `<name>...</name>`: (content, open_start, content_start, content_end, close_end)."""
    op, cl = f"<{name}>", f"</{name}>"
    i = text.find(op)
    if i < 0:
        return None
    j = text.find(cl, i + len(op))
    if j < 0:
        return None
    return text[i + len(op):j], i, i + len(op), j, j + len(cl)


def parse_turn(text: str) -> ParsedTurn:
    """Parse one assistant response. Never raises, whatever the text.

    A turn is valid when: it starts (after whitespace) with one `<mem>...</mem>`; then an
    optional `<think>...</think>`; then exactly one action tag pair (search, access or
    answer) with a non-empty argument; nothing but whitespace after the action; no tag
    appears twice and no `<information>` tag is written by the model. The parts found are
    returned even when the turn is invalid (e.g. an answer without a memory), so
    evaluation can still score the answer.
    """
    try:
        return _parse_turn(text if isinstance(text, str) else str(text))
    except Exception as e:  # noqa: BLE001 - the contract is "never raises on model output"
        return ParsedTurn(None, None, None, None, False, f"unparseable turn: {type(e).__name__}")


def _parse_turn(text: str) -> ParsedTurn:
    mem_b = _block(text, "mem")
    think_b = _block(text, "think")
    mem = mem_b[0].strip() if mem_b else None
    think = think_b[0].strip() if think_b else None
    mem_span = (mem_b[2], mem_b[3]) if mem_b else None

    # The action is the earliest closed action block after the memory (if any).
    after = mem_b[4] if mem_b else 0
    found: list[tuple[int, Action, tuple[str, int, int, int, int]]] = []
    for name in ACTIONS:
        b = _block(text[after:], name)
        if b is not None:
            found.append((b[1], name, b))
    found.sort(key=lambda f: f[0])
    action: Action | None = None
    argument: str | None = None
    act_b = None
    if found:
        _, action, act_b = found[0]
        argument = act_b[0].strip()

    errors: list[str] = []
    counts: dict[str, int] = {}
    for m in _TAG_RE.finditer(text):
        counts[m.group(0)] = counts.get(m.group(0), 0) + 1
    if mem_b is None:
        errors.append("no <mem> ... </mem>")
    elif text[:mem_b[1]].strip():
        errors.append("text before <mem>")
    if action is None:
        errors.append("no closed <search>, <access> or <answer> action")
    elif not argument:
        errors.append(f"empty <{action}>")
    if len(found) > 1:
        errors.append("more than one action")
    if any(c > 1 for c in counts.values()):
        errors.append("a tag appears more than once")
    if counts.get(INFO_OPEN) or counts.get(INFO_CLOSE):
        errors.append("the model wrote <information>")
    if act_b is not None:
        tail = text[after + act_b[4]:]
        if tail.strip():
            errors.append("text after the action")
        if think_b is not None and not (mem_b is None or mem_b[4] <= think_b[1] and think_b[4] <= after + act_b[1]):
            errors.append("<think> not between <mem> and the action")
        between = text[after:after + act_b[1]]
        if think_b is not None:
            between = between.replace(text[think_b[1]:think_b[4]], "", 1)
        if _TAG_RE.sub("", between).strip():
            errors.append("text outside the tags")
    valid = not errors
    return ParsedTurn(mem, think, action, argument, valid, "; ".join(errors), mem_span)


def truncate_tokens(text: str, tokenizer: Any | None, max_tokens: int | None) -> str:
    """Cut `text` to at most `max_tokens` tokens of `tokenizer` (appends " ..." when cut).

    Without a tokenizer, whitespace words stand in for tokens. `max_tokens=None` keeps all.
    """
    if max_tokens is None:
        return text
    if tokenizer is None:
        words = text.split()
        return text if len(words) <= max_tokens else " ".join(words[:max_tokens]) + " ..."
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=True).rstrip() + " ..."


def format_observation(
    body: str, tokenizer: Any | None = None, max_tokens: int | None = None
) -> str:
    """Wrap a tool result as `<information> body </information>`, the body cut to `max_tokens`."""
    return f"{INFO_OPEN} {truncate_tokens(body.strip(), tokenizer, max_tokens)} {INFO_CLOSE}"


def invalid_turn_observation(error: str) -> str:
    """The corrective observation an invalid turn receives (an `<information>` block)."""
    return f"{INFO_OPEN} {INVALID_TURN_OBSERVATION.format(error=error or 'format')} {INFO_CLOSE}"


def build_user_content(
    question: str,
    memory: str | None = None,
    last_action: str | None = None,
    last_observation: str | None = None,
) -> str:
    """The user message of a memory-context turn (see `build_messages`)."""
    parts = [USER_QUESTION_TEMPLATE.format(question=question.strip())]
    if memory is not None:
        parts.append(USER_MEMORY_TEMPLATE.format(memory=memory.strip()))
    if last_action:
        parts.append(USER_LAST_ACTION_TEMPLATE.format(
            action=last_action.strip(), observation=(last_observation or "").strip()).rstrip())
    return "\n\n".join(parts)


def build_messages(
    question: str,
    memory: str | None = None,
    last_action: str | None = None,
    last_observation: str | None = None,
    system_prompt: str = SYSTEM_PROMPT,
) -> list[dict[str, str]]:
    """Chat messages for one memory-context turn: `[system, user]`.

    The user message holds the question, then (from turn 2) the previous turn's memory,
    then the previous action (`<search> q </search>`) with its observation
    (`<information> ... </information>`). Nothing older: this is MemPO's flat context.
    `build_messages(question)` is the first turn, written by the data stage into verl's
    parquet `prompt` column.
    """
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": build_user_content(question, memory, last_action, last_observation)},
    ]


def answer_probe_messages(question: str, memory: str | None) -> list[dict[str, str]]:
    """Messages for the memory reward P(a* | q, mem): only the question and that memory.

    Render with `render_prompt(tok, msgs, ANSWER_PROBE_PREFIX)`; the gold answer is then
    scored as the continuation `" " + answer` (see `answer_continuation`).
    """
    return build_messages(question, memory=memory if memory is not None else "")


def answer_continuation(answer: str) -> str:
    """The text scored after `ANSWER_PROBE_PREFIX`: `" " + answer` (stripped answer)."""
    return " " + answer.strip()


def render_prompt(tokenizer: Any, messages: list[dict[str, str]], assistant_prefix: str = "") -> str:
    """Chat-template `messages` as text ending with the assistant generation prompt (+ prefix).

    Tokenizers without a chat template get a plain `role: content` layout.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return text + assistant_prefix
