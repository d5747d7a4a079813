"""Saved SFT starts (`mempo.training.starts`, `benchmarks/learning.py --start / --save-start`):
the same weights on any machine, checked before anything trains on them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from benchmark_helpers import load_benchmark
from safetensors.torch import save_file

from mempo.errors import DataError
from mempo.io import weights_sha256
from mempo.training.starts import START_FILE, load_start, save_start, world_identity

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "starts" / "c9cbcc85"


def _checkpoint(root: Path, value: float) -> tuple[Path, Path]:
    """A model folder with one safetensors weight file and a config, and an SFT metrics file."""
    model = root / "model"
    model.mkdir(parents=True)
    save_file({"w": torch.full((4, 4), value)}, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    metrics = root / "metrics.json"
    metrics.write_text(json.dumps({"steps": 12, "final_val_loss": 0.5}))
    return model, metrics


def test_a_saved_start_loads_with_its_weights_metrics_and_world(tmp_path: Path, tiny_world: Path) -> None:
    model, metrics = _checkpoint(tmp_path / "sft", 1.0)
    record = save_start(tmp_path / "start", {"memory": (model, metrics)}, tiny_world, note={"by": "test"})
    assert record["world"] == world_identity(tiny_world) == json.loads(
        (tiny_world / "manifest.json").read_text())["sha256"]
    assert record["formats"]["memory"]["sft"]["steps"] == 12 and record["by"] == "test"
    got = load_start(tmp_path / "start", ["memory"], tiny_world)["memory"]
    assert got["weights_sha256"] == weights_sha256(model) == record["formats"]["memory"]["weights_sha256"]
    assert (got["model"] / "config.json").read_text() == '{"model_type": "qwen2"}'
    assert json.loads(got["metrics"].read_text())["final_val_loss"] == 0.5
    assert json.loads((tmp_path / "start" / START_FILE).read_text()) == record


def test_changed_weights_another_world_or_a_missing_format_are_refused_by_name(
        tmp_path: Path, tiny_world: Path) -> None:
    model, metrics = _checkpoint(tmp_path / "sft", 1.0)
    start = tmp_path / "start"
    save_start(start, {"memory": (model, metrics)}, tiny_world)
    with pytest.raises(DataError, match="no 'full' checkpoint .*has: memory") as e:
        load_start(start, ["memory", "full"])
    assert e.value.path == str(start / START_FILE)
    other = tmp_path / "other-world"
    shutil.copytree(tiny_world, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["sha256"]["qa/test.jsonl"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"another world: qa/test.jsonl differ"):
        load_start(start, ["memory"], other)
    save_file({"w": torch.full((4, 4), 2.0)}, str(start / "memory" / "model" / "model.safetensors"))
    with pytest.raises(DataError, match="weights sha256 .* is not the recorded") as e:
        load_start(start, ["memory"], tiny_world)
    assert e.value.path == str(start / "memory" / "model")
    with pytest.raises(DataError, match="not a saved SFT start") as e:
        load_start(tmp_path / "sft", ["memory"])
    assert e.value.path == str(tmp_path / "sft" / START_FILE)


def test_a_failed_save_writes_nothing_and_keeps_the_previous_start(tmp_path: Path, tiny_world: Path) -> None:
    model, metrics = _checkpoint(tmp_path / "sft", 1.0)
    with pytest.raises(DataError, match="missing"):
        save_start(tmp_path / "new", {"memory": (model, tmp_path / "absent.json")}, tiny_world)
    assert not (tmp_path / "new").exists()
    save_start(tmp_path / "start", {"memory": (model, metrics)}, tiny_world)
    before = (tmp_path / "start" / START_FILE).read_text()
    with pytest.raises(DataError, match="start formats"):
        save_start(tmp_path / "start", {"memory": (model, metrics), "other": (model, metrics)}, tiny_world)
    with pytest.raises(DataError, match="no world manifest"):
        save_start(tmp_path / "start", {"memory": (model, metrics)}, tmp_path / "sft")
    assert (tmp_path / "start" / START_FILE).read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft", "start"]  # no temporary folder left


def test_the_learning_study_saves_and_reads_a_start(tmp_path: Path, tiny_world: Path) -> None:
    """`--save-start` after a study, `--start` in the next: its SFT inputs are the saved
    checkpoints, its cache its own; a start that does not fit stops the study with the reason."""
    learning = load_benchmark("learning")
    model, metrics = _checkpoint(tmp_path / "sft-memory", 3.0)
    a = learning._args(["--variants", "grpo", "mempo_half", "--workdir", str(tmp_path / "w"),
                        "--save-start", str(tmp_path / "starts" / "s1")])
    learning.save_study_start(a, {"sft-memory": model, "world": tiny_world})  # metrics beside the model
    assert "sft_set" not in json.loads((tmp_path / "starts" / "s1" / START_FILE).read_text())
    queue = learning._args(["--variants", "grpo", "--workdir", str(tmp_path / "w"), "--sft-set",
                            "sft.memory_layout=queue", "--save-start", str(tmp_path / "starts" / "q")])
    learning.save_study_start(queue, {"sft-memory": model, "world": tiny_world})
    record = json.loads((tmp_path / "starts" / "q" / START_FILE).read_text())
    assert record["sft_set"] == {"sft.memory_layout": "queue"}  # what the teacher and SFT ran with
    b = learning._args(["--start", str(tmp_path / "starts" / "s1"), "--variants", "grpo", "mempo_half",
                        "--workdir", str(tmp_path / "w")])
    assert b.workdir == tmp_path / "w" / "start-s1"
    inputs = learning.start_inputs(b, tiny_world)
    assert set(inputs) == {"sft-memory", "sft-memory-metrics"}
    assert weights_sha256(inputs["sft-memory"]) == weights_sha256(model)
    assert json.loads(inputs["sft-memory-metrics"].read_text()) == json.loads(metrics.read_text())
    with pytest.raises(SystemExit, match="--start: .*no 'full' checkpoint"):
        learning.start_inputs(learning._args(["--start", str(tmp_path / "starts" / "s1"), "--variants", "full"]),
                              tiny_world)
    with pytest.raises(SystemExit):
        learning._args(["--start", "x", "--from-pipeline", "."])


def test_the_committed_start_is_intact_and_fits_the_default_world(tmp_path: Path) -> None:
    """benchmarks/starts/c9cbcc85: the weights hash as recorded, trained on the world the
    default params generate today (a change to the world generator would orphan it), and the
    start of the committed studies that name it."""
    from mempo.config import load_params
    from mempo.world import generate_world

    p = load_params(REPO / "params.yaml", {})
    generate_world(tmp_path / "world", size=p.world.size, seed=p.world.seed)
    got = load_start(COMMITTED, ["memory"], tmp_path / "world")["memory"]
    assert got["weights_sha256"].startswith(COMMITTED.name)
    for other in sorted(d for d in COMMITTED.parent.iterdir() if d.is_dir() and d != COMMITTED):
        assert load_start(other, ["memory"], tmp_path / "world")["memory"]["weights_sha256"].startswith(other.name)
    study = json.loads((REPO / "benchmarks" / "results" / "learning_rl300_start3.json").read_text())
    assert study["config"]["start"]["memory"] == got["weights_sha256"]
