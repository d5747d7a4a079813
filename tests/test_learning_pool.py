"""`benchmarks/learning_pool.py`: studies of `benchmarks/learning.py` on different seeds pooled
into one paired comparison (two-level bootstrap with the per-task files, seeds only without)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_helpers import load_benchmark, study_job, write_study

from mempo.errors import MempoError
from mempo.evaluation.stats import paired_bootstrap
from mempo.io import write_json


@pytest.fixture(scope="module")
def learning():
    return load_benchmark("learning")


@pytest.fixture(scope="module")
def lp():
    return load_benchmark("learning_pool")


def _study(learning, path: Path, seeds: list[int], gain: dict[int, list[float]], rl_steps: int = 1) -> Path:
    """A study on `seeds`: mempo_half's per-task values on seed s are `gain[s]`, grpo's are all 0."""
    n = len(next(iter(gain.values())))
    return write_study(learning, path, seeds, {"grpo": {s: [0.0] * n for s in seeds}, "mempo_half": gain}, rl_steps)


def test_two_studies_pool_with_the_two_level_bootstrap_over_all_seeds(learning, lp, tmp_path):
    gain = {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 0.0], 2: [0.0, 0.0, 0.0, 0.0], 3: [1.0, 1.0, 1.0, 0.0]}
    s1 = _study(learning, tmp_path / "a" / "first.json", [0, 1], gain)
    s2 = _study(learning, tmp_path / "b" / "second.json", [2, 3], gain)
    out = lp.pool([lp.load_study(p, "mempo_half", "grpo") for p in (s1, s2)], "mempo_half", "grpo", 300)
    assert out["seeds"] == [0, 1, 2, 3] and out["resampled"].startswith("seeds, then tasks")
    d = out["pooled"]["k2/objective_em"]
    assert d["mean"] == pytest.approx((0.25 + 0.5 + 0.0 + 0.75) / 4) and d["seeds"] == 4
    assert d == paired_bootstrap([dict(zip(["t0", "t1", "t2", "t3"], gain[s], strict=True)) for s in range(4)],
                                 [{f"t{i}": 0.0 for i in range(4)}] * 4, 300)
    assert out["studies"]["first.json"]["k2/objective_em"] == pytest.approx(0.375)
    assert out["studies"]["second.json"]["k2/objective_em"] == pytest.approx(0.375)
    assert out["pooled"]["single/forgetting_rate"] is None  # no forgetting on single questions
    assert out["pooled"]["k4/forgetting_rate"]["mean"] == 0.0


def test_without_a_per_task_file_only_seeds_are_resampled(learning, lp, tmp_path, capsys):
    gain = {s: [1.0, 1.0, 0.0, 0.0] for s in range(4)}  # +0.5 on every seed
    s1 = _study(learning, tmp_path / "a" / "first.json", [0, 1], gain)
    s2 = _study(learning, tmp_path / "b" / "second.json", [2, 3], gain)
    learning.per_task_path(s1).unlink()  # a study from before the per-task files
    out_path = tmp_path / "pooled.json"
    assert lp.main([str(s1), str(s2), "--pair", "mempo_half", "grpo", "--out", str(out_path)]) == 0
    assert "seeds only" in capsys.readouterr().out
    d = json.loads(out_path.read_text())["pooled"]["k4/em"]
    assert (d["mean"], d["ci95_low"], d["ci95_high"], d["seeds"]) == (0.5, 0.5, 0.5, 4)
    # the forest plot beside the JSON
    assert (tmp_path / "pooled.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_studies_that_are_not_the_same_experiment_or_share_a_seed_are_refused(learning, lp, tmp_path, capsys):
    gain = {s: [1.0, 0.0] for s in range(3)}
    s1 = _study(learning, tmp_path / "a" / "first.json", [0, 1], gain)
    overlap = _study(learning, tmp_path / "b" / "second.json", [1, 2], gain)
    with pytest.raises(MempoError, match=r"second.json: seed 1 is also in .*first.json"):
        lp.pool([lp.load_study(p, "mempo_half", "grpo") for p in (s1, overlap)], "mempo_half", "grpo")
    longer = _study(learning, tmp_path / "c" / "third.json", [2], gain, rl_steps=2)
    assert lp.main([str(s1), str(longer), "--pair", "mempo_half", "grpo"]) == 2
    assert "third.json: config.rl_steps is 2" in capsys.readouterr().err
    with pytest.raises(MempoError, match="first.json: no variant 'mempo'"):
        lp.load_study(s1, "mempo", "grpo")
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert lp.main([str(s1), str(tmp_path / "bad.json"), "--pair", "mempo_half", "grpo"]) == 2
    assert "bad.json: not a learning study result" in capsys.readouterr().err
    import json

    study = json.loads(s1.read_text())
    del study["results"]["grpo"]["k4"]
    (tmp_path / "no_k4.json").write_text(json.dumps(study))
    with pytest.raises(MempoError, match=r"no_k4.json: not a learning study result \(KeyError: 'k4'\)"):
        lp.load_study(tmp_path / "no_k4.json", "mempo_half", "grpo")


def test_one_study_alone_compares_a_pair_its_summary_did_not(learning, lp, tmp_path):
    gain = {0: [1.0, 0.0], 1: [1.0, 1.0]}
    s1 = _study(learning, tmp_path / "only.json", [0, 1], gain)
    out = lp.pool([lp.load_study(s1, "grpo", "mempo_half")], "grpo", "mempo_half", 100)
    assert out["pooled"]["k2/em"]["mean"] == pytest.approx(-0.75) and out["seeds"] == [0, 1]


def test_a_malformed_per_task_file_is_refused_naming_it_and_the_line(learning, lp, tmp_path, capsys):
    import gzip

    gain = {0: [1.0, 0.0], 1: [1.0, 1.0]}
    s1 = _study(learning, tmp_path / "only.json", [0, 1], gain)
    side = learning.per_task_path(s1)
    lines = gzip.decompress(side.read_bytes()).decode().splitlines()
    side.write_bytes(gzip.compress(("\n".join(lines[:3] + ['{"variant": "grpo"'] + lines[3:]) + "\n").encode()))
    assert lp.main([str(s1), "--pair", "mempo_half", "grpo"]) == 2
    err = capsys.readouterr().err
    assert "only.per_task.jsonl.gz" in err and "4" in err and "invalid JSON" in err
    side.write_bytes(gzip.compress(("\n".join(lines[:1] + ['{"variant": "grpo", "seed": 0}'] + lines[1:]) + "\n").encode()))
    assert lp.main([str(s1), "--pair", "mempo_half", "grpo"]) == 2
    assert "only.per_task.jsonl.gz: row 2: KeyError" in capsys.readouterr().err


def test_reward_slopes_pool_over_every_studys_seeds_and_read_old_one_seed_studies(learning, lp, tmp_path):
    """Per-seed reward slopes pool across studies: from the study's `reward_trend`, or, in a study
    from before it that ran one seed, from its curve (which is that seed's)."""
    gain = {s: [1.0, 0.0] for s in range(3)}
    rising = [0.01 * i for i in range(8)]  # 1.0 per 100 steps in both halves
    a = learning._args(["--seeds", "1", "2", "--variants", "grpo", "mempo_half", "--rl-steps", "8",
                        "--bootstrap", "50", "--workdir", str(tmp_path)])
    results = {k: study_job([0.0, 0.0]) for k in ("untrained", "sft-memory", "sft-full")}
    for s in (1, 2):
        results[f"rl-grpo-seed{s}"] = study_job([0.0, 0.0], rising)
        results[f"rl-mempo_half-seed{s}"] = study_job(gain[s], [0.3] * 8)  # flat from the start
    new = tmp_path / "new" / "seeds1_2.json"
    write_json(new, learning.summarise(a, results))
    trend = learning.summarise(a, results)["reward_trend"]
    assert trend["grpo"]["late"]["mean"] == pytest.approx(1.0) and trend["grpo"]["verdict"] == "rising"
    assert trend["mempo_half"]["verdict"] == "flat"
    old = _study(learning, tmp_path / "old" / "seed0.json", [0], gain, rl_steps=8)
    study = json.loads(old.read_text())
    del study["reward_trend"]  # as written before the trend existed
    study["curves"]["grpo"] = [{"step": i + 1, "reward_mean": 0.5 - 0.02 * i} for i in range(8)]
    old.write_text(json.dumps(study))
    out = lp.pool([lp.load_study(p, "mempo_half", "grpo") for p in (old, new)], "mempo_half", "grpo", 100)
    g = out["reward_trend"]["grpo"]
    assert g["seeds"] == 3 and g["late"]["mean"] == pytest.approx((-2.0 + 1.0 + 1.0) / 3)
    assert g["early"]["ci95_low"] == pytest.approx(-2.0) and g["verdict"] == "undecided"
    # a study of several seeds without per-seed slopes cannot say: no trend rather than a wrong one
    del study["curves"]["grpo"]
    old.write_text(json.dumps(study))
    out = lp.pool([lp.load_study(p, "mempo_half", "grpo") for p in (old, new)], "mempo_half", "grpo", 100)
    assert "grpo" not in out["reward_trend"] and "mempo_half" in out["reward_trend"]


def test_the_gain_at_k4_minus_the_gain_at_k2_is_paired_by_seed(learning, lp, tmp_path):
    gain = {s: [1.0, 0.0] for s in range(3)}  # +0.5 on every set and seed
    path = _study(learning, tmp_path / "s" / "study.json", [0, 1, 2], gain)
    study = json.loads(path.read_text())
    study["results"]["mempo_half"]["k4"]["objective_em"]["per_seed"] = [0.6, 0.9, 0.5]  # k4 gains 0.6 / 0.9 / 0.5
    path.write_text(json.dumps(study))
    learning.per_task_path(path).unlink()
    out = lp.pool([lp.load_study(path, "mempo_half", "grpo")], "mempo_half", "grpo", 200)
    d = out["k4_minus_k2"]["objective_em"]
    assert d["mean"] == pytest.approx((0.1 + 0.4 + 0.0) / 3) and d["seeds"] == 3
    assert 0.0 <= d["ci95_low"] < d["mean"] < d["ci95_high"] <= 0.4 + 1e-9  # means of resampled seeds


def test_studies_from_different_sft_starts_are_refused(learning, lp, tmp_path, capsys):
    """The same settings and distinct seeds, but RL started from other SFT checkpoints: their
    own evaluation differs (old studies), or their recorded weights do (new ones)."""
    gain = {s: [1.0, 0.0] for s in range(4)}
    s1 = _study(learning, tmp_path / "a" / "first.json", [0, 1], gain)
    other = write_study(learning, tmp_path / "b" / "second.json", [2, 3],
                        {"grpo": {s: [0.0, 0.0] for s in (2, 3)}, "mempo_half": gain}, sft=[1.0, 0.0])
    assert lp.main([str(s1), str(other), "--pair", "mempo_half", "grpo"]) == 2
    err = capsys.readouterr().err
    assert "second.json: its RL start has sft single em 0.5, but" in err and "first.json's has 0.0" in err
    # the same evaluation, other weights: refused on the digest
    w1 = write_study(learning, tmp_path / "c" / "w1.json", [0, 1],
                     {"grpo": {s: [0.0, 0.0] for s in (0, 1)}, "mempo_half": gain}, start="x")
    w2 = write_study(learning, tmp_path / "d" / "w2.json", [2, 3],
                     {"grpo": {s: [0.0, 0.0] for s in (2, 3)}, "mempo_half": gain}, start="y")
    with pytest.raises(MempoError, match=r"w2.json: its RL start has weights sha256 of sft-(memory|full) 'y-sft-"):
        lp.pool([lp.load_study(p, "mempo_half", "grpo") for p in (w1, w2)], "mempo_half", "grpo", 50)
    # a study that recorded no digest (before learning.py wrote it) is compared on its evaluation
    third = _study(learning, tmp_path / "e" / "third.json", [2, 3], gain)
    out = lp.pool([lp.load_study(p, "mempo_half", "grpo") for p in (w1, third)], "mempo_half", "grpo", 50)
    assert out["seeds"] == [0, 1, 2, 3]
    assert json.loads(w1.read_text())["config"]["start"] == {"memory": "x-sft-memory", "full": "x-sft-full"}


def test_a_variant_run_later_joins_its_baselines_study_and_pairs_with_them_on_their_seeds(learning, lp, tmp_path,
                                                                                          capsys):
    """`base.json+later.json`: the later part trained one more variant from the same start (same
    weights digest, settings and seeds); it pairs task by task with the first part's baselines,
    and the joined study pools with another joined study on other seeds."""
    zeros = {s: [0.0, 0.0, 0.0, 0.0] for s in range(4)}
    half = {s: [1.0, 0.0, 0.0, 0.0] for s in range(4)}
    retain = {0: [1.0, 1.0, 0.0, 0.0], 1: [1.0, 1.0, 1.0, 0.0], 2: [0.0, 0.0, 0.0, 0.0], 3: [1.0, 0.0, 0.0, 0.0]}
    base = write_study(learning, tmp_path / "base.json", [0, 1], {"grpo": zeros, "mempo_half": half}, start="x")
    later = write_study(learning, tmp_path / "later.json", [0, 1], {"mempo_retain": retain}, start="x")
    joined = f"{base}+{later}"
    out_path = tmp_path / "retain_vs_grpo.json"
    assert lp.main([joined, "--pair", "mempo_retain", "grpo", "--bootstrap", "200", "--out", str(out_path)]) == 0
    out = json.loads(out_path.read_text())
    assert out["seeds"] == [0, 1] and list(out["studies"]) == ["base.json+later.json"]
    assert out["resampled"].startswith("seeds, then tasks")
    d = out["pooled"]["k2/objective_em"]
    assert d["mean"] == pytest.approx((0.5 + 0.75) / 2)
    assert d == paired_bootstrap([dict(zip(["t0", "t1", "t2", "t3"], retain[s], strict=True)) for s in (0, 1)],
                                 [{f"t{i}": 0.0 for i in range(4)}] * 2, 200)
    vs_half = lp.pool([lp.load_study(joined, "mempo_retain", "mempo_half")], "mempo_retain", "mempo_half", 50)
    assert vs_half["pooled"]["k4/em"]["mean"] == pytest.approx((0.25 + 0.5) / 2)
    # two joined studies on other seeds pool like any two studies
    base2 = write_study(learning, tmp_path / "b2" / "base2.json", [2, 3], {"grpo": zeros, "mempo_half": half},
                        start="x")
    later2 = write_study(learning, tmp_path / "b2" / "later2.json", [2, 3], {"mempo_retain": retain}, start="x")
    both = lp.pool([lp.load_study(p, "mempo_retain", "grpo") for p in (joined, f"{base2}+{later2}")],
                   "mempo_retain", "grpo", 50)
    assert both["seeds"] == [0, 1, 2, 3] and both["pooled"]["k2/em"]["mean"] == pytest.approx((2 + 3 + 0 + 1) / 16)
    # a part without its per-task file: the seeds only are resampled
    learning.per_task_path(later2).unlink()
    assert lp.load_study(f"{base2}+{later2}", "mempo_retain", "grpo")["per_task"] is None


def test_parts_of_other_starts_settings_or_the_same_variant_do_not_join(learning, lp, tmp_path, capsys):
    zeros = {s: [0.0, 0.0] for s in range(2)}
    base = write_study(learning, tmp_path / "base.json", [0, 1], {"grpo": zeros, "mempo_half": zeros}, start="x")
    other_start = write_study(learning, tmp_path / "o" / "later.json", [0, 1], {"mempo_retain": zeros}, start="y")
    assert lp.main([f"{base}+{other_start}", "--pair", "mempo_retain", "grpo"]) == 2
    assert "later.json: its RL start has weights sha256 of sft-" in capsys.readouterr().err
    longer = write_study(learning, tmp_path / "l" / "later.json", [0, 1], {"mempo_retain": zeros}, rl_steps=2,
                         start="x")
    with pytest.raises(MempoError, match=r"later.json: config.rl_steps is 2, but .*base.json has 1: not parts of one"):
        lp.load_study(f"{base}+{longer}", "mempo_retain", "grpo")
    again = write_study(learning, tmp_path / "g" / "later.json", [0, 1], {"grpo": zeros}, start="x")
    with pytest.raises(MempoError, match=r"later.json: variant 'grpo' is also in .*base.json"):
        lp.load_study(f"{base}+{again}", "mempo_half", "grpo")
    # a baseline both parts ran does not stop a pair of the others: only the pair is taken from them
    beside = write_study(learning, tmp_path / "b" / "later.json", [0, 1],
                         {"grpo": zeros, "mempo_retain": {s: [1.0, 0.0] for s in range(2)}}, start="x")
    st = lp.load_study(f"{base}+{beside}", "mempo_retain", "mempo_half")
    assert st["seeds"] == [0, 1] and st["per_seed"]["mempo_retain"]["k2"]["em"] == {0: 0.5, 1: 0.5}
    with pytest.raises(MempoError, match=r"later.json: variant 'grpo' is also in .*base.json"):
        lp.load_study(f"{base}+{beside}", "mempo_retain", "grpo")
    with pytest.raises(MempoError, match=r"missing.json: not a learning study result \(FileNotFoundError"):
        lp.load_study(f"{base}+{tmp_path / 'missing.json'}", "mempo_half", "grpo")


def test_a_labelled_part_run_with_another_rl_set_pairs_a_variant_with_itself(learning, lp, tmp_path, capsys):
    """`base.json+other.json@nap`: the part run with another --rl-set (here the no-answer
    penalty) has its RL variants named v@nap, so GRPO under the two reward settings pairs task
    by task; only rl_set may differ, and the output names the difference."""
    zeros = {s: [0.0, 0.0, 0.0, 0.0] for s in range(2)}
    nap = {0: [1.0, 1.0, 0.0, 0.0], 1: [1.0, 0.0, 0.0, 0.0]}
    base = write_study(learning, tmp_path / "base.json", [0, 1], {"grpo": zeros, "mempo_half": zeros}, start="x")
    other = write_study(learning, tmp_path / "o" / "other.json", [0, 1], {"grpo": nap, "mempo_half": zeros},
                        start="x", extra=("--rl-set", "mempo.no_answer_penalty=0.5"))
    # unlabelled, the other setting is refused, and the message says how to join it
    with pytest.raises(MempoError, match=r"other.json: config.rl_set is .*no_answer_penalty.*other.json@name"):
        lp.load_study(f"{base}+{other}", "mempo_half", "grpo")
    out_path = tmp_path / "nap.json"
    assert lp.main([f"{base}+{other}@nap", "--pair", "grpo@nap", "grpo", "--bootstrap", "200",
                    "--out", str(out_path)]) == 0
    assert "settings differ (base.json+other.json@nap): other.json: rl_set None vs" in capsys.readouterr().out
    out = json.loads(out_path.read_text())
    assert out["pair"] == ["grpo@nap", "grpo"] and out["seeds"] == [0, 1]
    assert out["settings_differ"]["base.json+other.json@nap"][str(other)]["rl_set"] == [
        None, {"mempo.no_answer_penalty": 0.5}]
    d = out["pooled"]["k2/objective_em"]
    assert d["mean"] == pytest.approx((0.5 + 0.25) / 2)
    assert d == paired_bootstrap([dict(zip(["t0", "t1", "t2", "t3"], nap[s], strict=True)) for s in (0, 1)],
                                 [{f"t{i}": 0.0 for i in range(4)}] * 2, 200)
    # within the labelled part its variants pair under their new names, and the start is kept
    st = lp.load_study(f"{base}+{other}@nap", "grpo@nap", "mempo_half@nap")
    assert st["per_seed"]["grpo@nap"]["k4"]["em"] == {0: 0.5, 1: 0.25} and st["start"] == lp.load_study(
        base, "grpo", "mempo_half")["start"]
    # budgets still must match
    longer = write_study(learning, tmp_path / "l" / "longer.json", [0, 1], {"grpo": nap}, rl_steps=2, start="x",
                         extra=("--rl-set", "mempo.no_answer_penalty=0.5"))
    with pytest.raises(MempoError, match=r"longer.json: config.rl_steps is 2"):
        lp.load_study(f"{base}+{longer}@nap", "grpo@nap", "grpo")
    with pytest.raises(MempoError, match="an empty label"):
        lp.load_study(f"{base}+{other}@", "grpo", "mempo_half")


def test_across_starts_pools_each_start_s_seeds_within_it(learning, lp, tmp_path, capsys):
    """--across-starts: studies of two starts (one of them in two files), seed numbers reused
    across starts; each start keeps its seeds in every replicate, and its own means are listed."""
    g = {0: [1.0, 0.0], 1: [1.0, 0.0], 2: [1.0, 0.0]}  # +0.5 on every set, every seed of start x
    x1 = write_study(learning, tmp_path / "a" / "x1.json", [0, 1],
                     {"grpo": {s: [0.0, 0.0] for s in (0, 1)}, "mempo_half": g}, start="x")
    x2 = write_study(learning, tmp_path / "b" / "x2.json", [2],
                     {"grpo": {2: [0.0, 0.0]}, "mempo_half": g}, start="x")
    y = write_study(learning, tmp_path / "c" / "y.json", [0, 1],  # seeds 0, 1 again: other runs
                    {"grpo": {s: [0.0, 0.0] for s in (0, 1)}, "mempo_half": {s: [0.0, 0.0] for s in (0, 1)}},
                    start="y")
    studies = [lp.load_study(p, "mempo_half", "grpo") for p in (x1, y, x2)]
    with pytest.raises(MempoError, match="different SFT checkpoints.*--across-starts"):
        lp.pool(studies, "mempo_half", "grpo", 50)
    out = lp.pool(studies, "mempo_half", "grpo", 300, across_starts=True)
    assert out["seeds"] == ["x-sft-me/0", "x-sft-me/1", "x-sft-me/2", "y-sft-me/0", "y-sft-me/1"]
    assert out["starts"]["x-sft-me"]["studies"] == ["x1.json", "x2.json"] and out["starts"]["y-sft-me"]["seeds"] == [0, 1]
    assert out["starts"]["x-sft-me"]["k4/objective_em"] == 0.5 and out["starts"]["y-sft-me"]["k4/objective_em"] == 0.0
    d = out["pooled"]["k2/objective_em"]
    # 3 seeds at +0.5 (tasks 1 and 0 resampled) and 2 at 0: the mean 0.3, never above 0.5 * 3/5
    assert d["mean"] == pytest.approx(0.3) and d["strata"] == 2 and d["ci95_high"] <= 0.6 + 1e-9
    assert out["resampled"].endswith("each seed within its start")
    dup = write_study(learning, tmp_path / "d" / "x3.json", [1],
                      {"grpo": {1: [0.0, 0.0]}, "mempo_half": g}, start="x")
    with pytest.raises(MempoError, match="seed 1 is also in .*x1.json: pooled seeds of one start"):
        lp.pool(studies + [lp.load_study(dup, "mempo_half", "grpo")], "mempo_half", "grpo", 50, across_starts=True)
    assert lp.main([str(x1), str(y), str(x2), "--pair", "mempo_half", "grpo", "--across-starts"]) == 0
    assert "start x-sft-me: 3 seeds" in capsys.readouterr().out


def test_parts_from_two_machines_join_on_the_weights_digest_with_across_machines(learning, lp, tmp_path, capsys):
    """The same SFT weights (digest) evaluated differently on another machine: refused as parts of
    one start, with the hint; `--across-machines` joins them, pairs task by task and lists the
    start rows that differ. Other weights, or no digest, stay refused with the flag too."""
    zeros = {s: [0.0, 0.0] for s in range(2)}
    retain = {0: [1.0, 0.0], 1: [1.0, 1.0]}
    base = write_study(learning, tmp_path / "base.json", [0, 1], {"grpo": zeros, "mempo_half": zeros}, start="x")
    there = write_study(learning, tmp_path / "m" / "there.json", [0, 1], {"mempo_retain": retain}, start="x",
                        sft=[1.0, 0.0])
    joined = f"{base}+{there}"
    assert lp.main([joined, "--pair", "mempo_retain", "grpo"]) == 2
    err = capsys.readouterr().err
    assert "there.json: its RL start has sft" in err and "join with --across-machines" in err
    out_path = tmp_path / "out.json"
    assert lp.main([joined, "--pair", "mempo_retain", "grpo", "--across-machines", "--bootstrap", "50",
                    "--out", str(out_path)]) == 0
    assert "across machines (base.json+there.json): there.json's start evaluates differently" in capsys.readouterr().out
    out = json.loads(out_path.read_text())
    assert out["pooled"]["k2/em"]["mean"] == pytest.approx(3 / 4)
    drift = out["across_machines"]["base.json+there.json"][str(there)]
    assert drift["sft single em"] == [0.0, 0.5] and not any(k.startswith("weights") for k in drift)
    same = write_study(learning, tmp_path / "s" / "same.json", [0, 1], {"mempo_retain": retain}, start="x")
    assert lp.load_study(f"{base}+{same}", "mempo_retain", "grpo", across_machines=True)["across_machines"] == {}
    other = write_study(learning, tmp_path / "o" / "other.json", [0, 1], {"mempo_retain": retain}, start="y")
    with pytest.raises(MempoError, match=r"other.json: its RL start has weights sha256 of sft-\w+ 'y-sft-\w+'.*"
                                         r"not the same SFT weights"):
        lp.load_study(f"{base}+{other}", "mempo_retain", "grpo", across_machines=True)
    old = write_study(learning, tmp_path / "n" / "old.json", [0, 1], {"grpo": zeros, "mempo_half": zeros})
    undigested = write_study(learning, tmp_path / "n2" / "later.json", [0, 1], {"mempo_retain": retain})
    with pytest.raises(MempoError, match=r"later.json: --across-machines joins parts on their SFT weights' sha256, "
                                         r"which neither"):
        lp.load_study(f"{old}+{undigested}", "mempo_retain", "grpo", across_machines=True)
    with pytest.raises(MempoError, match=r"later.json: --across-machines joins parts on their SFT weights' sha256, "
                                         r"but .*later.json did not record 'weights sha256 of sft-"):
        lp.load_study(f"{base}+{undigested}", "mempo_retain", "grpo", across_machines=True)
