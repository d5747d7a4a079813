"""mempo.training.checkpoint: exact round trip, atomicity, pruning, resume resolution."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mempo.errors import DataError


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(16, 4)  # draws from the torch RNG, so RNG state matters
        loss = (model(x) - x.sum(-1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def test_resume_from_checkpoint_gives_identical_weights(tmp_path: Path) -> None:
    from mempo.training.checkpoint import (
        TrainerState,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )

    model, opt, sched = _setup()
    _train(model, opt, sched, 3)
    save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=3, data_position={"i": 3}))
    random.random(), np.random.rand()
    _train(model, opt, sched, 4)
    straight = [p.detach().clone() for p in model.parameters()]

    model2, opt2, sched2 = _setup(seed=99)  # different init: everything must come from the checkpoint
    state = load_checkpoint(latest_checkpoint(tmp_path), model2, opt2, sched2)
    assert state.step == 3 and state.data_position == {"i": 3}
    _train(model2, opt2, sched2, 4)
    for a, b in zip(straight, model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_latest_ignores_partial_folders_and_prunes_old(tmp_path: Path) -> None:
    from mempo.training.checkpoint import (
        TrainerState,
        latest_checkpoint,
        list_checkpoints,
        save_checkpoint,
    )

    model, opt, sched = _setup()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=step), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000002", "step-0000003"]
    (tmp_path / "step-0000009").mkdir()  # a folder without state.pt is not a checkpoint
    (tmp_path / ".tmp-step-0000010.123.abcd").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-0000003"


def test_resolve_resume(tmp_path: Path) -> None:
    from mempo.training.checkpoint import resolve_resume

    assert resolve_resume("auto", tmp_path / "none") is None
    assert resolve_resume("never", tmp_path) is None
    with pytest.raises(DataError, match="not a checkpoint"):
        resolve_resume(str(tmp_path), tmp_path)


def test_auto_resume_skips_checkpoints_of_another_config(tmp_path: Path) -> None:
    from mempo.training.checkpoint import (
        TrainerState,
        list_checkpoints,
        resolve_resume,
        save_checkpoint,
    )
    from mempo.training.fingerprint import config_fingerprint

    model, opt, sched = _setup()
    fp = config_fingerprint({"train": {"lr": 1e-3, "steps": 10, "resume": "auto"}})
    # steps / resume may change between a run and its resumption
    assert fp == config_fingerprint({"train": {"lr": 1e-3, "steps": 50, "resume": "never"}})
    save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=2, extra={"fingerprint": fp}))
    assert resolve_resume("auto", tmp_path, fp) is not None
    other = config_fingerprint({"train": {"lr": 5e-4, "steps": 10}})
    with pytest.raises(DataError, match="different training config"):
        resolve_resume(str(list_checkpoints(tmp_path)[0]), tmp_path, other)
    assert resolve_resume("auto", tmp_path, other) is None
    assert list_checkpoints(tmp_path) == []


def test_a_config_mismatch_moves_checkpoints_aside_and_says_so(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """One exploratory --set must not delete a long run's checkpoints: they are moved aside."""
    from mempo.training.checkpoint import TrainerState, resolve_resume, save_checkpoint
    from mempo.training.fingerprint import config_fingerprint

    model, opt, sched = _setup()
    root = tmp_path / "checkpoints"
    fp = config_fingerprint({"train": {"lr": 1e-3}})
    save_checkpoint(root, model, opt, sched, TrainerState(step=7, extra={"fingerprint": fp}))
    with caplog.at_level("WARNING"):
        assert resolve_resume("auto", root, config_fingerprint({"train": {"lr": 5e-4}})) is None
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.stale-")]
    assert (aside / "step-0000007" / "state.pt").exists()
    assert str(aside) in caplog.text and "moved" in caplog.text


def _mutate_same_size_same_mtime(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_run_fingerprint_covers_input_contents_not_only_size_and_mtime(tmp_path: Path) -> None:
    from mempo.training.fingerprint import run_fingerprint

    policy = tmp_path / "policy"
    (policy / "sub").mkdir(parents=True)
    (policy / "config.json").write_text('{"hidden": 32}')
    (policy / "sub" / "weights.bin").write_bytes(b"\x00" * 4096)
    data = tmp_path / "train.jsonl"
    data.write_text('{"q": 1}\n')
    cache = tmp_path / "cache.json"
    cfg = {"train": {"lr": 1e-3, "policy": str(policy), "data": str(data)}}
    inputs = {"policy": policy, "data": data}
    first = run_fingerprint(cfg, inputs, cache)
    assert first == run_fingerprint(cfg, inputs, cache)
    _mutate_same_size_same_mtime(policy / "sub" / "weights.bin")
    second = run_fingerprint(cfg, inputs, cache)
    assert second != first
    _mutate_same_size_same_mtime(data)
    third = run_fingerprint(cfg, inputs, cache)
    assert third != second
    # Where the inputs live does not matter, only what they hold.
    moved = tmp_path / "elsewhere"
    policy.rename(moved)
    cfg2 = {"train": {"lr": 1e-3, "policy": str(moved), "data": str(data)}}
    assert run_fingerprint(cfg2, {"policy": moved, "data": data}, cache) == third


def test_input_hash_cache_rereads_only_changed_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mempo.training.fingerprint as ck

    folder = tmp_path / "index"
    folder.mkdir()
    for i in range(5):
        (folder / f"shard-{i}.bin").write_bytes(bytes([i]) * 1000)
    cache = tmp_path / "cache.json"
    monkeypatch.setattr(ck, "_RACY_NS", 20_000_000)  # files older than 20 ms may be cached
    time.sleep(0.05)
    reads: list[str] = []
    real = ck.sha256_file
    monkeypatch.setattr(ck, "sha256_file", lambda p, *a, **k: (reads.append(Path(p).name), real(p, *a, **k))[1])
    h1 = ck.input_hash(folder, cache)
    assert len(reads) == 5
    reads.clear()
    assert ck.input_hash(folder, cache) == h1 and reads == []
    (folder / "shard-3.bin").write_bytes(b"x" * 1000)  # same size
    assert ck.input_hash(folder, cache) != h1 and reads == ["shard-3.bin"]
    reads.clear()
    ck.input_hash(folder, cache)
    assert reads == ["shard-3.bin"]  # written just now: not trusted to the cache yet


def test_input_hash_of_a_retrieval_service_is_its_index_not_its_port(tmp_path: Path) -> None:
    """`mempo pipeline run` serves the index on a new port each run: a resume must still match."""
    from mempo.retrieval import open_retriever
    from mempo.retrieval.server import create_app
    from mempo.retrieval.serving import BackgroundServer
    from mempo.training.fingerprint import input_hash

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1", "contents": "A\\nalpha"}\n{"id": "2", "contents": "B\\nbeta"}\n')
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "1", "contents": "A\\nalpha"}\n')
    backing = open_retriever(str(corpus))
    with BackgroundServer(create_app(backing, manifest=backing.manifest)) as a, \
            BackgroundServer(create_app(backing, manifest=backing.manifest)) as b:
        assert a.url != b.url
        assert input_hash(a.url) == input_hash(b.url)
        backing2 = open_retriever(str(other))
        with BackgroundServer(create_app(backing2, manifest=backing2.manifest)) as c:
            assert input_hash(c.url) != input_hash(a.url)
    # verl never contacts the service from the launcher: the URL itself is the identity.
    assert input_hash("http://127.0.0.1:9/", probe_services=False) != input_hash("http://127.0.0.1:8/",
                                                                                  probe_services=False)


def test_a_truncated_newest_checkpoint_is_not_complete(tmp_path: Path) -> None:
    from mempo.training.checkpoint import (
        STATE_FILE,
        TrainerState,
        latest_checkpoint,
        save_checkpoint,
    )

    model, opt, sched = _setup()
    for step in (1, 2):
        save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=step))
    newest = tmp_path / "step-0000002" / STATE_FILE
    newest.write_bytes(newest.read_bytes()[:100])
    assert latest_checkpoint(tmp_path).name == "step-0000001"


def test_resume_falls_back_to_the_previous_checkpoint_when_the_newest_is_corrupt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from mempo.training.checkpoint import STATE_FILE, TrainerState, resume_training, save_checkpoint

    model, opt, sched = _setup()
    _train(model, opt, sched, 2)
    save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=2, extra={"fingerprint": "f"}))
    good = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, sched, 2)
    save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=4, extra={"fingerprint": "f"}))
    newest = tmp_path / "step-0000004" / STATE_FILE
    data = bytearray(newest.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x5A  # same size, different bytes: only the hash check can tell
    newest.write_bytes(bytes(data))

    model2, opt2, sched2 = _setup(seed=5)
    with caplog.at_level("WARNING"):
        state = resume_training("auto", tmp_path, "f", model2, opt2, sched2)
    assert state is not None and state.step == 2
    for a, b in zip(good, model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert "step-0000004" in caplog.text


def test_a_planted_pickle_is_never_executed(tmp_path: Path) -> None:
    """A checkpoint on a shared volume is data: loading it must not run code (weights_only)."""
    from mempo.training.checkpoint import (
        STATE_FILE,
        TrainerState,
        load_checkpoint,
        resume_training,
        save_checkpoint,
        write_checkpoint_manifest,
    )

    model, opt, sched = _setup()
    save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=1, extra={"fingerprint": "f"}))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    ckpt = tmp_path / "step-0000001"
    torch.save({"model": Evil()}, ckpt / STATE_FILE)
    write_checkpoint_manifest(ckpt)  # the attacker can rewrite the manifest as well
    with pytest.raises(DataError, match="cannot load"):
        load_checkpoint(ckpt, model, opt, sched)
    assert resume_training("auto", tmp_path, "f", model, opt, sched) is None
    assert not marker.exists()


def test_retire_checkpoints_removes_every_step(tmp_path: Path) -> None:
    from mempo.training.checkpoint import (
        TrainerState,
        list_checkpoints,
        retire_checkpoints,
        save_checkpoint,
    )

    model, opt, sched = _setup()
    for step in (1, 2):
        save_checkpoint(tmp_path, model, opt, sched, TrainerState(step=step))
    (tmp_path / ".tmp-step-0000003.1.abcd").mkdir()
    assert retire_checkpoints(tmp_path) == 2
    assert list_checkpoints(tmp_path) == [] and not list(tmp_path.glob("step-*"))
    assert not list(tmp_path.glob(".tmp-*"))
