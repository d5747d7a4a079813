"""Learning-study results (`benchmarks/learning.py --out` files) read back for pooling and
comparing: a study's settings, its seeds, per seed its values and, where the per-task file
(`<study>.per_task.jsonl.gz`) is beside it, per task. Used by `benchmarks/learning_pool.py`
(studies on other seeds) and `benchmarks/learning_budget.py` (the same seeds at another RL budget).
A study run in parts (a variant trained later from the same start, beside the baselines already
run) reads as one: `join_parts`, or a path argument `first.json+second.json`. A part run with
another `--rl-set` joins when labelled, `first.json+second.json@nap`: its RL variants are named
`grpo@nap`, ..., so the same variant under two reward settings pairs (`--pair grpo@nap grpo`).

    st = load_study(Path("benchmarks/results/learning_rl120.json"), "mempo_half", "grpo")
    st["seeds"], st["per_seed"]["grpo"]["k4"]["objective_em"][seed], st["per_task"]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mempo.errors import MempoError
from mempo.evaluation.stats import curve_slopes
from mempo.io import iter_jsonl

BENCHES = ("single", "k2", "k4")
METRICS = ("em", "objective_em", "forgetting_rate")
SAME = ("rl_steps", "batch_questions", "n_rollouts", "eval_tasks", "policy", "rl_mix", "rl_set")  # what must match to pool
# The start a study's RL variants train from: its SFT checkpoints, evaluated before RL (results
# `sft`, `sft_full`) on the same greedy test tasks, so one start gives the same numbers in every study.
START_VARIANTS = ("sft", "sft_full")
START_METRICS = ("em", "objective_em", "mean_prompt_tokens")
WEIGHTS_KEY = "weights sha256 of sft-"  # start_signature's keys for the SFT weights' digests
PART_SEP = "+"  # joins the parts of one study in a path argument: first.json+second.json
LABEL_SEP = "@"  # part.json@label: that part's RL variants are named variant@label (another reward setting)


def load_study(path: Path, a: str, b: str, across_machines: bool = False) -> dict[str, Any]:
    """The study's settings, the seeds both variants ran, and per seed and set its per-seed
    values (and per-task values, where its per-task file exists). `path` may name the parts of
    one study joined by '+' (`join_parts`, with its `across_machines`): `first.json+second.json`."""
    parts = [Path(p) for p in str(path).split(PART_SEP)] if not Path(path).exists() else [Path(path)]
    if len(parts) > 1 or split_label(parts[0])[1]:
        study, per_task = join_parts(parts, across_machines, variants=(a, b))
        path = parts[0].parent / PART_SEP.join(p.name for p in parts)
    else:
        study, per_task = read_study(parts[0])
    parts = [split_label(p)[0] for p in parts]
    try:
        seeds = study["config"]["seeds"]
        results = study["results"]
        for v in (a, b):
            if v not in seeds or v not in results:
                raise MempoError(f"{path}: no variant '{v}' (it has: {', '.join(sorted(seeds))})")
        per_seed = {v: {bench: {m: dict(zip(seeds[v], results[v][bench][m]["per_seed"], strict=True))
                                for m in METRICS} for bench in BENCHES} for v in (a, b)}
    except (KeyError, TypeError, ValueError) as e:
        raise MempoError(f"{path}: not a learning study result ({type(e).__name__}: {e})") from e
    common = [s for s in seeds[a] if s in seeds[b]]
    if per_task is not None:
        missing = [f"{v} seed {s} {bench}" for v in (a, b) for s in common for bench in BENCHES
                   if (v, s, bench) not in per_task]
        if missing:
            where = per_task_file(parts[0]) if len(parts) == 1 else f"the per-task files of {path}"
            raise MempoError(f"{where}: no per-task rows for {', '.join(missing[:4])}")
    return {"path": path, "config": study["config"], "seeds": common, "per_seed": per_seed, "per_task": per_task,
            "slopes": {v: reward_slopes(study, v) for v in (a, b)}, "start": start_signature(study),
            "across_machines": study.get("across_machines") or {},
            "settings_differ": study.get("settings_differ") or {}}


PerTask = dict[tuple[str, int, str], dict[str, dict[str, Any]]]


def per_task_file(path: Path) -> Path:
    return path.with_suffix(".per_task.jsonl.gz")


def read_study(path: Path) -> tuple[dict[str, Any], PerTask | None]:
    """A study's summary JSON and, where its per-task file is beside it, its per-task rows by
    (variant, seed, set) and task. Unreadable files: MempoError naming the file (and line)."""
    try:
        study = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MempoError(f"{path}: not a learning study result ({type(e).__name__}: {e})") from e
    if not isinstance(study, dict):
        raise MempoError(f"{path}: not a learning study result (a JSON {type(study).__name__}, not an object)")
    side = per_task_file(path)
    if not side.exists():
        return study, None
    per_task: PerTask = {}
    for n, row in iter_jsonl(side):  # malformed lines: DataError naming the file and line
        try:
            per_task.setdefault((row["variant"], int(row["seed"]), row["bench"]), {})[row["task"]] = row
        except (ValueError, KeyError, TypeError) as e:
            raise MempoError(f"{side}: row {n}: {type(e).__name__}: {e}") from e
    return study, per_task


def split_label(path: Path) -> tuple[Path, str | None]:
    """`part.json@label` -> (part.json, label); a path without a label (or an existing file whose
    name has the separator) -> (path, None)."""
    name = str(path)
    if Path(name).exists() or LABEL_SEP not in Path(name).name:
        return Path(name), None
    file, label = name.rsplit(LABEL_SEP, 1)
    if not label:
        raise MempoError(f"{name}: an empty label after '{LABEL_SEP}' (part.json{LABEL_SEP}label)")
    return Path(file), label


def relabel(study: dict[str, Any], per_task: PerTask | None, label: str) -> tuple[dict[str, Any], PerTask | None]:
    """The study with each RL variant v (`config.seeds`) named `v@label`, in its seeds, results,
    reward trends, curves and per-task rows; the start's rows (`sft`, `sft_full`) keep their names."""
    try:
        rl = set(study["config"]["seeds"])
        name = {v: f"{v}{LABEL_SEP}{label}" for v in rl}

        def rename(d: dict[str, Any] | None) -> dict[str, Any]:
            return {name.get(k, k): x for k, x in (d or {}).items()}

        out = {**study, "config": {**study["config"], "seeds": rename(study["config"]["seeds"])},
               "results": rename(study["results"]), "reward_trend": rename(study.get("reward_trend")),
               "curves": rename(study.get("curves"))}
    except (KeyError, TypeError, AttributeError) as e:
        raise MempoError(f"not a learning study result ({type(e).__name__}: {e})") from e
    tasks = None if per_task is None else {(name.get(v, v), s, b): rows for (v, s, b), rows in per_task.items()}
    return out, tasks


def join_parts(paths: list[Path], across_machines: bool = False, variants: tuple[str, ...] | None = None
               ) -> tuple[dict[str, Any], PerTask | None]:
    """Parts of one study as one: studies run at different times from one RL start (the same SFT
    weights, `check_same_start`) with the same settings (`SAME`), each training other RL
    variants. Seed s of every variant saw the same task order and all were evaluated on the same
    test tasks, so a variant added later pairs with the baselines already run, without training
    them again. Each RL variant must come from one part; the first part's start evaluation and
    settings stand for the whole. Per-task rows only where every part has its file. `variants`:
    take only these RL variants from the later parts (`load_study`'s pair), so parts that each ran
    the same baseline still join for a pair of the others; each of them must come from one part.

    `across_machines`: parts run on machines that evaluate the same weights differently (other
    CPU kernels) join on the SFT weights' sha256 alone, which both parts must have recorded;
    the start rows that differ are kept under `across_machines` (part -> key -> [first part's,
    this part's]), since the pairs then carry the machines' difference as well as the variants'.

    A labelled part (`part.json@label`, `split_label`) has its RL variants renamed `v@label`
    (`relabel`) and may differ from the first part in `rl_set` (the RL reward settings), and
    the first part, when labelled, from every other; the differences are kept under
    `settings_differ` (part -> key -> [first part's, this part's]). Budgets, mixture and test
    tasks must still match: the pair compares one variant under two settings, nothing else."""
    read = []
    for p in paths:
        file, label = split_label(p)
        study, tasks = read_study(file)
        read.append((file, *(relabel(study, tasks, label) if label else (study, tasks)), label))
    first_path, first, first_tasks, first_label = read[0]
    drift: dict[str, dict[str, list[Any]]] = {}
    differ: dict[str, dict[str, list[Any]]] = {}
    try:
        config = {**first["config"], "seeds": dict(first["config"]["seeds"])}
        results, trend = dict(first["results"]), dict(first.get("reward_trend") or {})
        curves = dict(first.get("curves") or {})
        owner = {v: first_path for v in config["seeds"]}
        per_task = dict(first_tasks) if first_tasks is not None else None
        for path, study, tasks, label in read[1:]:
            free = ("rl_set",) if label or first_label else ()
            check_same_settings(path, study["config"], first_path, first["config"],
                                "not parts of one study" + ("" if free else
                                                            f" (label a part run with another --rl-set: "
                                                            f"{path.name}{LABEL_SEP}name)"), but=free)
            for key in free:
                if study["config"].get(key) != first["config"].get(key):
                    differ.setdefault(str(path), {})[key] = [first["config"].get(key), study["config"].get(key)]
            sig, first_sig = start_signature(study), start_signature(first)
            if across_machines:
                differs = check_same_weights(path, sig, first_path, first_sig)
                if differs:
                    drift[str(path)] = differs
            else:
                digests = weight_digests(sig)
                check_same_start([{"path": first_path, "start": first_sig}, {"path": path, "start": sig}],
                                 hint=" (the weights' sha256 agree: parts run on machines that evaluate them "
                                      "differently join with --across-machines)"
                                 if digests and digests == weight_digests(first_sig) else "")
            for v, seeds in study["config"]["seeds"].items():
                if variants is not None and v not in variants:
                    continue
                if v in owner:
                    raise MempoError(f"{path}: variant '{v}' is also in {owner[v]}: a joined study takes each RL "
                                     "variant from one part")
                owner[v], config["seeds"][v], results[v] = path, seeds, study["results"][v]
                if v in (study.get("reward_trend") or {}):
                    trend[v] = study["reward_trend"][v]
                if v in (study.get("curves") or {}):
                    curves[v] = study["curves"][v]
                if per_task is not None and tasks is not None:
                    per_task.update({k: rows for k, rows in tasks.items() if k[0] == v})
            if tasks is None:
                per_task = None
    except (KeyError, TypeError, AttributeError) as e:
        raise MempoError(f"{PART_SEP.join(map(str, paths))}: not learning study results "
                         f"({type(e).__name__}: {e})") from e
    joined = {**first, "config": config, "results": results, "reward_trend": trend, "curves": curves}
    if drift:
        joined["across_machines"] = drift
    if differ:
        joined["settings_differ"] = differ
    return joined, per_task


def check_same_weights(path: Path, sig: dict[str, Any], first_path: Path, first_sig: dict[str, Any]
                       ) -> dict[str, list[Any]]:
    """For `join_parts(..., across_machines=True)`: refuse a part whose SFT weights' sha256
    differs from the first part's or that either did not record; returns the start rows
    (`start_signature`'s other keys) on which the two differ, as [first part's, this part's]."""
    weights = sorted({*weight_digests(sig), *weight_digests(first_sig)})
    if not weights:
        raise MempoError(f"{path}: --across-machines joins parts on their SFT weights' sha256, which neither "
                         f"{path} nor {first_path} recorded (learning.py's config.start)")
    for k in weights:
        missing = [p for p, s in ((path, sig), (first_path, first_sig)) if k not in s]
        if missing:
            raise MempoError(f"{path}: --across-machines joins parts on their SFT weights' sha256, but "
                             f"{missing[0]} did not record {k!r} (learning.py's config.start, since 2026-12-04)")
        if sig[k] != first_sig[k]:
            raise MempoError(f"{path}: its RL start has {k} {sig[k]!r}, but {first_path}'s has "
                             f"{first_sig[k]!r}: not the same SFT weights, on any machine")
    return {k: [first_sig[k], sig[k]] for k in sorted(sig) if k in first_sig and first_sig[k] != sig[k]}


def weight_digests(sig: dict[str, Any]) -> dict[str, Any]:
    """A start signature's (`start_signature`'s) SFT weights' sha256 entries."""
    return {k: v for k, v in sig.items() if k.startswith(WEIGHTS_KEY)}


def start_signature(study: dict[str, Any]) -> dict[str, Any]:
    """What identifies the SFT checkpoints a study's RL variants start from: the sha256 of their
    weights where the study recorded it (`config.start`, learning.py since 2026-12-04), and for
    every study the start policies' own greedy evaluation on its test tasks (per set: EM,
    objective EM, mean prompt tokens), which two studies of one start reproduce exactly."""
    sig: dict[str, Any] = {}
    for v in START_VARIANTS:
        res = (study.get("results") or {}).get(v) or {}
        for bench in BENCHES:
            for m in START_METRICS:
                mean = ((res.get(bench) or {}).get(m) or {}).get("mean")
                if mean is not None:
                    sig[f"{v} {bench} {m}"] = round(float(mean), 6)
    for fmt, digest in ((study.get("config") or {}).get("start") or {}).items():
        if digest:
            sig[f"{WEIGHTS_KEY}{fmt}"] = digest
    return sig


def check_same_settings(path: Path, config: dict[str, Any], first_path: Path, first: dict[str, Any],
                        what: str, but: tuple[str, ...] = ()) -> None:
    """Refuse a study whose settings (`SAME`, less the keys in `but`) differ from the first's;
    `what` ends the message."""
    for key in SAME:
        if key not in but and config.get(key) != first.get(key):
            raise MempoError(f"{path}: config.{key} is {config.get(key)!r}, but {first_path} has "
                             f"{first.get(key)!r}: {what}")


def check_same_start(studies: list[dict[str, Any]], hint: str = "") -> None:
    """Refuse studies (`load_study`'s) whose RL starts differ: two SFT checkpoints trained from
    the same params can still differ (another commit's numerics, another machine), and a
    difference pooled over them would mix two experiments. Compared on what both recorded."""
    first = studies[0]
    for st in studies[1:]:
        key = start_difference(st["start"], first["start"])
        if key is not None:
            value, other = st["start"][key], first["start"][key]
            raise MempoError(f"{st['path']}: its RL start has {key} {value!r}, but {first['path']}'s has {other!r}: "
                             "the studies start from different SFT checkpoints (or evaluate them differently); "
                             f"pool or compare only studies of one start{hint}")


def start_difference(x: dict[str, Any], y: dict[str, Any]) -> str | None:
    """The first key both start signatures (`start_signature`) recorded with different values;
    None where they agree on every key both recorded."""
    return next((k for k, v in x.items() if k in y and y[k] != v), None)


def same_start(x: dict[str, Any], y: dict[str, Any]) -> bool:
    return start_difference(x, y) is None


def group_by_start(studies: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Studies (`load_study`'s) in groups of one RL start each, groups and studies in the order
    given: a study joins the first group whose first study it agrees with (`same_start`)."""
    groups: list[list[dict[str, Any]]] = []
    for st in studies:
        home = next((g for g in groups if same_start(g[0]["start"], st["start"])), None)
        if home is None:
            groups.append([st])
        else:
            home.append(st)
    return groups


def reward_slopes(study: dict[str, Any], v: str) -> dict[int, dict[str, float | None]] | None:
    """Per seed, the slopes of variant v's training reward (`curve_slopes`): the study's own
    `reward_trend`, or, for a study from before it that ran v on one seed, its curve (the mean
    over one seed is that seed's curve). None where neither is there."""
    trend = (study.get("reward_trend") or {}).get(v)
    if trend:
        return {int(s): d for s, d in trend["per_seed"].items()}
    seeds, curve = study["config"]["seeds"].get(v, []), (study.get("curves") or {}).get(v)
    if len(seeds) == 1 and curve:
        return {seeds[0]: curve_slopes([row.get("reward_mean") for row in curve])}
    return None
