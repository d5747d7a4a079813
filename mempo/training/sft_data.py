"""SFT data: the scripted teacher's correct episodes on the data stage's SFT tasks, with
entity renaming, or episodes read from a jsonl, as the SFT stage's training samples.

    from mempo.training.sft_data import run_teacher, sft_samples, teacher_records
    train, val, stats = sft_samples(params, tokenizer)          # what `mempo train sft` trains on
    with open_retriever("data/world/corpus.jsonl") as r:
        train_r, val_r, stats = teacher_records(params, tokenizer, r)   # episode records only
    run_teacher(params)     # `mempo train teacher`: the records to sft.teacher_out (dvc.yaml's teacher stage)

Tasks are the data stage's SFT split (`data.out/sft.parquet`, `sft_val.parquet`, written by
`mempo data prepare` from the world's questions: `mempo.data.sft_split`); the teacher
(`mempo.agent.teacher.ScriptedTeacher`) runs them through the real retriever and tool env,
and only episodes it got right are kept (`teacher_episodes`). A share of them gets fresh
made-up entity names (`rename_entities`), so a small policy learns to copy names instead of
memorising them. With `sft.trajectories` set, the samples are read from that jsonl instead
(`load_sft_samples`), one of these per line:

    {"messages": [{"role": ..., "content": ...}, ...], "response": "<mem> ... </mem> ..."}
    {"turns": [{"messages": [...], "response": "..."}, ...], ...}      (one episode)
    {"question": "...", "turns": [{"response": "...", "observation": "...",
                                   "short_observation": null}, ...]}   (an episode record)

Episode records are rendered in a context (`render_episode`): the memory agent's prompts or
the whole history.

Why here and not in `mempo/agent/teacher.py`: the teacher is a turn policy any rollout can
run; filtering its episodes into SFT records, renaming entities and reading episode files is
training data preparation, built on `mempo.training.sft`'s sample type.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mempo.errors import DataError
from mempo.io import iter_jsonl, write_jsonl
from mempo.tasks import Task
from mempo.training.sft import SFTSample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeRecord:
    """One finished episode as text, context-free: the question and, per turn, the response,
    the environment's observation and its short form (shown once the turn is not the last)."""

    question: str
    turns: list[dict[str, str | None]]

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.question, "turns": self.turns}


def _check_messages(messages: Any, path: Path, row: int) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise DataError("must be a non-empty list of {role, content}", path=path, row=row, field="messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError("each message needs string 'role' and 'content'", path=path, row=row, field="messages")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _episode_record(obj: dict[str, Any], path: Path, row: int) -> EpisodeRecord:
    if not isinstance(obj.get("question"), str) or not obj["question"].strip():
        raise DataError("missing or empty", path=path, row=row, field="question")
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        raise DataError("must be a non-empty list of turns", path=path, row=row, field="turns")
    out: list[dict[str, str | None]] = []
    for turn in turns:
        resp = turn.get("response") if isinstance(turn, dict) else None
        if not isinstance(resp, str) or not resp.strip():
            raise DataError("each turn needs a non-empty 'response'", path=path, row=row, field="turns")
        for key in ("observation", "short_observation"):
            if turn.get(key) is not None and not isinstance(turn[key], str):
                raise DataError(f"'{key}' must be a string or null", path=path, row=row, field="turns")
        out.append({"response": resp, "observation": turn.get("observation"),
                    "short_observation": turn.get("short_observation")})
    return EpisodeRecord(obj["question"], out)


def load_sft_samples(path: str | Path, context: str = "memory") -> list[SFTSample]:
    """Read SFT samples from a jsonl of turns, episodes or episode records (module docstring);
    episode records are rendered in `context`."""
    path = Path(path)
    samples: list[SFTSample] = []
    for row, obj in iter_jsonl(path):
        if "question" in obj and "turns" in obj:
            samples.extend(render_episode(_episode_record(obj, path, row), context))
            continue
        turns = obj.get("turns") if "turns" in obj else [obj]
        if not isinstance(turns, list):
            raise DataError("must be a list of turns", path=path, row=row, field="turns")
        for turn in turns:
            if not isinstance(turn, dict):
                raise DataError("each turn must be an object", path=path, row=row, field="turns")
            resp = turn.get("response")
            if not isinstance(resp, str) or not resp.strip():
                raise DataError("missing or empty", path=path, row=row, field="response")
            samples.append(SFTSample(_check_messages(turn.get("messages"), path, row), resp))
    if not samples:
        raise DataError("no SFT samples in file", path=path)
    return samples


def write_sft_samples(path: str | Path, samples: Iterable[SFTSample]) -> int:
    """Write samples as the per-turn jsonl `load_sft_samples` reads (atomic). Returns the count."""
    return write_jsonl(path, ({"messages": s.messages, "response": s.response} for s in samples))


def episode_record(episode: Any) -> EpisodeRecord:
    """The text of a rollout `Episode` (`mempo.agent.rollout`), context-free."""
    return EpisodeRecord(episode.question, [
        {"response": t.response_text.strip(), "observation": t.observation, "short_observation": t.short_observation}
        for t in episode.turns])


def render_episode(record: EpisodeRecord, context: str = "memory", system_prompt: str | None = None) -> list[SFTSample]:
    """One `SFTSample` per turn: the messages of that turn in `context` ("memory": MemPO's
    question + last memory + last result; "full": the whole history, Search-R1 style), rebuilt
    by replaying the context builder, exactly what the policy sees -> the turn's response."""
    from mempo.agent.context import make_context
    from mempo.agent.format import SYSTEM_PROMPT, parse_turn

    ctx = make_context(context, record.question, system_prompt or SYSTEM_PROMPT)  # type: ignore[arg-type]
    out: list[SFTSample] = []
    for turn in record.turns:
        response = str(turn["response"])
        out.append(SFTSample(ctx.messages(), response.strip()))
        ctx.record_turn(response, parse_turn(response), turn.get("observation"), turn.get("short_observation"))
    return out


def sft_samples(params: Any, tokenizer: Any) -> tuple[list[SFTSample], list[SFTSample], dict[str, float]]:
    """The SFT stage's (train, val) samples in `rollout.context`, and data statistics: read from
    `sft.trajectories`, or the teacher's episodes on `sft.world`, then written (records and
    rendered samples) to `sft.out/trajectories/` for the other format's SFT stage to reuse."""
    p, context = params.sft, params.rollout.context
    t_data = time.perf_counter()
    data_stats: dict[str, float] = {}
    if p.trajectories:
        train_s = load_sft_samples(p.trajectories, context)
        val_s = load_sft_samples(p.val_trajectories, context) if p.val_trajectories else []
    else:
        from mempo.retrieval import open_retriever

        with open_retriever(p.retriever) as retriever:
            train_r, val_r, data_stats = teacher_records(params, tokenizer, retriever)
        trajectories = Path(p.out) / "trajectories"
        write_episode_records(trajectories, train_r, val_r)
        train_s = [s for r in train_r for s in render_episode(r, context)]
        val_s = [s for r in val_r for s in render_episode(r, context)]
        data_stats["samples"] = len(train_s)
        write_sft_samples(trajectories / "train.jsonl", train_s)
        write_sft_samples(trajectories / "val.jsonl", val_s)
    data_stats["data_seconds"] = time.perf_counter() - t_data
    return train_s, val_s, data_stats


def teacher_records(params: Any, tokenizer: Any, retriever: Any
                    ) -> tuple[list[EpisodeRecord], list[EpisodeRecord], dict[str, float]]:
    """The teacher's correct (train, val) episodes on the data stage's SFT tasks (in
    `data.out`), renamed as `sft.rename_entities` asks (val episodes never are), and the
    train statistics."""
    from mempo.data.sft_split import load_sft_split

    p = params.sft
    pool = name_word_pool(Path(p.world) / "corpus.jsonl") if p.rename_entities > 0 else None
    train_tasks, val_tasks = load_sft_split(params.data.out)
    train_r, stats = teacher_episodes(train_tasks, retriever, tokenizer, params.rollout, params.mempo.multi_rule,
                                      rename=p.rename_entities, seed=p.seed, name_pool=pool, layout=p.memory_layout)
    val_r, _ = teacher_episodes(val_tasks, retriever, tokenizer, params.rollout, params.mempo.multi_rule,
                                layout=p.memory_layout)
    return train_r, val_r, stats


def run_teacher(params: Any, tracking: bool = True) -> dict[str, float]:
    """The teacher stage (`mempo train teacher`): `teacher_records` written to `sft.teacher_out`
    as `{train,val}_episodes.jsonl`, with its statistics in `metrics.json`. Both SFT stages
    read these records (`sft.trajectories`), one in each context, so they can train side by
    side on the same episodes. Only the policy's tokenizer is loaded (token counts), no model."""
    from mempo.data.sft_split import sft_split_paths
    from mempo.training.stage import tracked

    p = params.sft
    data = dict(zip(("sft_tasks", "sft_val_tasks"), map(str, sft_split_paths(params.data.out)), strict=True))
    return tracked("teacher", tracking, lambda: _run_teacher(params), params=p,
                   data={"policy": p.policy, **data})  # as the SFT stage: the retriever may be a URL


def _run_teacher(params: Any) -> dict[str, float]:
    from mempo.io import write_json
    from mempo.retrieval import open_retriever
    from mempo.tracking import log_metrics
    from mempo.training.runtime import load_tokenizer

    p = params.sft
    t0 = time.perf_counter()
    with open_retriever(p.retriever) as retriever:
        train_r, val_r, stats = teacher_records(params, load_tokenizer(p.policy), retriever)
    out = Path(p.teacher_out)
    write_episode_records(out, train_r, val_r)
    metrics = {**{f"data_{k}": v for k, v in stats.items()}, "train_episodes": len(train_r),
               "val_episodes": len(val_r), "seconds": time.perf_counter() - t0}
    write_json(out / "metrics.json", metrics)
    log_metrics(metrics, prefix="teacher")
    log.info("teacher: %d train / %d val episodes -> %s", len(train_r), len(val_r), out)
    return metrics


def write_episode_records(folder: Path, train: Sequence[EpisodeRecord], val: Sequence[EpisodeRecord]) -> None:
    """`{val,train}_episodes.jsonl` in `folder`: the records `load_sft_samples` renders in
    either context (atomic, each file; train last, so its presence means both are there)."""
    write_jsonl(folder / "val_episodes.jsonl", (r.to_dict() for r in val))
    write_jsonl(folder / "train_episodes.jsonl", (r.to_dict() for r in train))


def _name_words(name: str) -> list[str]:
    """The made-up words of an entity name: capitalised, not ordinary vocabulary ("Textiles")."""
    from mempo.world.names import GENERIC_NAME_WORDS

    return [w for w in re.findall(r"[A-Za-z]+", name) if w[0].isupper() and w not in GENERIC_NAME_WORDS]


def _chain_words(item: Task) -> list[str]:
    """Made-up words of the entity names and values along every hop chain of a task."""
    words: list[str] = []
    for objective in item.objectives:
        for hop in objective.chain or ():
            for name in (hop.entity, hop.value):
                for w in _name_words(name):
                    if w not in words:
                        words.append(w)
    return words


def name_word_pool(corpus: str | Path) -> list[str]:
    """The made-up words of the corpus's article titles (its entity names), sorted: what
    `rename_entities` draws replacement names from."""
    from mempo.datasets import iter_corpus

    return sorted({w for passage in iter_corpus(corpus) for w in _name_words(passage.title)})


def rename_entities(samples: Sequence[SFTSample], item: Task, rng: Any,
                    pool: Sequence[str] | None = None) -> list[SFTSample]:
    """The samples of one episode with every made-up word of its chain's names (subject,
    bridge entities, answer) replaced by a fresh made-up word, consistently in the prompt,
    the observations and the response.

    Why: a small policy trained from scratch on a few thousand episodes learns the names of
    its training entities by heart (train loss falls, held-out EM stays near 0) instead of
    learning to copy a name from the question or a passage, which is what a held-out,
    entity-disjoint question needs. With other names per episode, memorising cannot help.

    Replacement words come from `pool` (e.g. `name_word_pool(corpus)`: words of the corpus's
    entity names, so the policy practises copying exactly the tokens names are made of; they
    are reassigned at random, so no fact about any entity is taught), or are made up when
    `pool` is None.
    """
    sub = entity_renamer(item, rng, pool)
    if sub is None:
        return list(samples)
    return [SFTSample([{"role": m["role"], "content": sub(m["content"])} for m in s.messages], sub(s.response))
            for s in samples]


def entity_renamer(item: Task, rng: Any, pool: Sequence[str] | None = None) -> Any:
    """The text substitution `rename_entities` applies (one fresh word per made-up word of
    the task's chain names, drawn with `rng`), or None when the chains name nothing."""
    from mempo.world.names import fresh_word

    words = _chain_words(item)
    if not words:
        return None
    mapping = {w: (rng.choice(pool) if pool else fresh_word(rng)) for w in words}
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + r")\b")

    def sub(text: str) -> str:
        return pattern.sub(lambda m: mapping[m.group(1)], text)

    return sub


def rename_record(record: EpisodeRecord, sub: Any) -> EpisodeRecord:
    """`record` with `sub` applied to its question and every turn's texts."""
    return EpisodeRecord(sub(record.question), [{k: (sub(v) if isinstance(v, str) else v) for k, v in t.items()}
                                                for t in record.turns])


def teacher_episodes(
    tasks: Sequence[Task], retriever: Any, tokenizer: Any, agent: Any, multi_rule: str = "all",
    rename: float = 0.0, seed: int = 0, name_pool: Sequence[str] | None = None, layout: str = "now",
) -> tuple[list[EpisodeRecord], dict[str, float]]:
    """Run the scripted teacher (memory `layout`, `sft.memory_layout`) on `tasks` through the
    real retriever and keep the episodes it got right (R^T = 1); a `rename` share of them gets
    fresh entity names (`rename_entities`, drawn with `seed`). Returns (episode records, stats)."""
    from mempo.agent.rollout import RolloutConfig, run_episodes
    from mempo.agent.teacher import ScriptedTeacher
    from mempo.agent.tools import ToolConfig, ToolEnv

    env = ToolEnv(retriever, tokenizer, ToolConfig(
        topk=agent.topk, observation_max_tokens=agent.observation_max_tokens,
        access_chunk_chars=agent.access_chunk_chars, short_text_chars=agent.short_text_chars))
    cfg = RolloutConfig(max_turns=max(agent.max_turns, 64), max_concurrent_episodes=agent.max_concurrent_episodes,
                        check_masks=agent.check_masks)
    episodes = run_episodes(list(tasks), ScriptedTeacher(tokenizer, layout), env, tokenizer, "memory", cfg)
    by_id = {t.id: t for t in tasks}
    rng = random.Random(seed)
    kept = [ep for ep in episodes if ep.outcome_reward(multi_rule=multi_rule) >= 1.0]
    records: list[EpisodeRecord] = []
    renamed = 0
    for ep in kept:
        rec = episode_record(ep)
        if rename > 0 and rng.random() < rename:
            sub = entity_renamer(by_id[ep.item_id], rng, name_pool)
            if sub is not None:
                rec = rename_record(rec, sub)
            renamed += 1
        records.append(rec)
    stats = {"episodes": len(episodes), "correct": len(kept),
             "teacher_em": len(kept) / max(len(episodes), 1), "renamed_episodes": renamed}
    return records, stats
