"""SFT data: the scripted teacher's correct episodes on the knowledge world, with entity
renaming, as the SFT stage's training samples.

    from mempo.training.sft_data import sft_samples, teacher_records
    train, val, stats = sft_samples(params, tokenizer)          # what `mempo train sft` trains on
    with open_retriever("data/world/corpus.jsonl") as r:
        train_r, val_r, stats = teacher_records(params, tokenizer, r)   # episode records only

Tasks are the world's train / val questions (`sft_tasks`: singles plus composed k-objective
tasks); the teacher (`mempo.agent.teacher.ScriptedTeacher`) runs them through the real
retriever and tool env, and only episodes it got right are kept (`teacher_episodes`). A
share of them gets fresh made-up entity names (`rename_entities`), so a small policy learns
to copy names instead of memorising them. With `sft.trajectories` set, the samples are read
from that jsonl instead (`mempo.training.sft.load_sft_samples`).

Why here and not in `mempo/agent/teacher.py`: the teacher is a turn policy any rollout can
run; choosing tasks, renaming entities and filtering episodes into SFT records is training
data preparation, built on `mempo.training.sft`'s record and sample types.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mempo.errors import DataError
from mempo.io import write_jsonl
from mempo.training.sft import (
    EpisodeRecord,
    SFTSample,
    episode_record,
    load_sft_samples,
    render_episode,
    write_sft_samples,
)


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
    """The teacher's correct (train, val) episodes on `sft.world` as `sft:` asks (questions,
    compositions, renaming; val episodes are never renamed) and the train statistics."""
    p = params.sft
    pool = name_word_pool(Path(p.world) / "corpus.jsonl") if p.rename_entities > 0 else None
    train_tasks = sft_tasks(p.world, "train", p.part or None, p.max_questions, p.multi_k, p.multi_tasks, p.seed)
    val_tasks = sft_tasks(p.world, "val", None, p.val_questions, p.val_multi_k, p.val_multi_tasks, p.seed)
    train_r, stats = teacher_episodes(train_tasks, retriever, tokenizer, params.rollout, params.mempo.multi_rule,
                                      rename=p.rename_entities, seed=p.seed, name_pool=pool)
    val_r, _ = teacher_episodes(val_tasks, retriever, tokenizer, params.rollout, params.mempo.multi_rule)
    return train_r, val_r, stats


def write_episode_records(folder: Path, train: Sequence[EpisodeRecord], val: Sequence[EpisodeRecord]) -> None:
    """`{val,train}_episodes.jsonl` in `folder`: the records `load_sft_samples` renders in
    either context (atomic, each file; train last, so its presence means both are there)."""
    write_jsonl(folder / "val_episodes.jsonl", (r.to_dict() for r in val))
    write_jsonl(folder / "train_episodes.jsonl", (r.to_dict() for r in train))


def _name_words(name: str) -> list[str]:
    """The made-up words of an entity name: capitalised, not ordinary vocabulary ("Textiles")."""
    from mempo.world.names import GENERIC_NAME_WORDS

    return [w for w in re.findall(r"[A-Za-z]+", name) if w[0].isupper() and w not in GENERIC_NAME_WORDS]


def _chain_words(item: Any) -> list[str]:
    """Made-up words of the entity names and values along every hop chain of a task."""
    from mempo.agent.teacher import objective_chains

    words: list[str] = []
    for chain, _ in objective_chains(item):
        for hop in chain:
            for name in (str(hop.get("entity", "")), str(hop.get("value", ""))):
                for w in _name_words(name):
                    if w not in words:
                        words.append(w)
    return words


def name_word_pool(corpus: str | Path) -> list[str]:
    """The made-up words of the corpus's article titles (its entity names), sorted: what
    `rename_entities` draws replacement names from."""
    from mempo.datasets import iter_corpus

    return sorted({w for passage in iter_corpus(corpus) for w in _name_words(passage.title)})


def rename_entities(samples: Sequence[SFTSample], item: Any, rng: Any,
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


def entity_renamer(item: Any, rng: Any, pool: Sequence[str] | None = None) -> Any:
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


def sft_tasks(
    world: str | Path, split: str, part: str | None, max_questions: int | None,
    multi_k: Sequence[int], multi_tasks: int, seed: int,
) -> list[Any]:
    """The teacher's tasks: single questions of `split` (optionally one `part`) plus
    `multi_tasks` composed k-objective tasks for each k in `multi_k` (from the same pool)."""
    from mempo.datasets import load_qa
    from mempo.tasks import compose_multi_objective

    items = load_qa(Path(world) / "qa" / f"{split}.jsonl")
    if part:
        items = [q for q in items if (q.metadata or {}).get("part") == part]
    if not items:
        raise DataError(f"no questions with part '{part}'", path=Path(world) / "qa" / f"{split}.jsonl")
    rng = random.Random(seed)
    rng.shuffle(items)
    singles = items[:max_questions] if max_questions else items
    tasks = list(singles)
    for k in multi_k:
        n = min(multi_tasks, len(items) // k)
        if k > 1 and n > 0:
            tasks += compose_multi_objective(items, k=k, n_tasks=n, seed=seed + k, id_prefix=f"sft-{split}")
    return tasks


def teacher_episodes(
    tasks: Sequence[Any], retriever: Any, tokenizer: Any, agent: Any, multi_rule: str = "all",
    rename: float = 0.0, seed: int = 0, name_pool: Sequence[str] | None = None,
) -> tuple[list[EpisodeRecord], dict[str, float]]:
    """Run the scripted teacher on `tasks` through the real retriever and keep the episodes it
    got right (R^T = 1); a `rename` share of them gets fresh entity names (`rename_entities`,
    drawn with `seed`). Returns (episode records, stats)."""
    from mempo.agent.rollout import RolloutConfig, run_episodes
    from mempo.agent.teacher import ScriptedTeacher
    from mempo.agent.tools import ToolConfig, ToolEnv

    env = ToolEnv(retriever, tokenizer, ToolConfig(
        topk=agent.topk, observation_max_tokens=agent.observation_max_tokens,
        access_chunk_chars=agent.access_chunk_chars, short_text_chars=agent.short_text_chars))
    cfg = RolloutConfig(max_turns=max(agent.max_turns, 64), max_concurrent_episodes=agent.max_concurrent_episodes,
                        check_masks=agent.check_masks)
    episodes = run_episodes(list(tasks), ScriptedTeacher(tokenizer), env, tokenizer, "memory", cfg)
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
