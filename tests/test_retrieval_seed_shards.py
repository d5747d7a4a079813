"""Reusing another index's embedding shards (`reuse_embeddings_from`): a copy killed halfway
must not leave a truncated shard that the resumed build would take as finished."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from mempo.retrieval.index import EMB_DIR, _seed_shards, shard_path

STATE = {"corpus_sha256": "c0ffee", "encoder": "enc", "dim": 4, "probe": [0.5], "shard_size": 8}


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / EMB_DIR).mkdir(parents=True)
    for i in range(2):
        with open(shard_path(src, i), "wb") as fh:
            np.save(fh, np.full((8, 4), i, dtype=np.float16))
    (src / "manifest.json").write_text(json.dumps({
        "method": "dense", "count": 16, "shards": 2, "dim": 4, "shard_size": 8,
        "corpus": {"sha256": "c0ffee"}, "encoder": {"name": "enc", "probe": [0.5]}}))
    return src


def test_a_copy_killed_halfway_leaves_no_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _source(tmp_path)
    work = tmp_path / "work"
    (work / EMB_DIR).mkdir(parents=True)

    def cross_device(a: object, b: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    real_copyfile = shutil.copyfile

    def dies_halfway(a: str, b: str, *args: object, **kwargs: object) -> None:
        data = Path(a).read_bytes()
        Path(b).write_bytes(data[: len(data) // 2])
        raise KeyboardInterrupt  # killed mid-copy

    monkeypatch.setattr(os, "link", cross_device)
    monkeypatch.setattr(shutil, "copyfile", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        _seed_shards(work, src, STATE)
    assert not shard_path(work, 0).exists()
    assert [p.name for p in (work / EMB_DIR).iterdir()] == []

    monkeypatch.setattr(shutil, "copyfile", real_copyfile)
    _seed_shards(work, src, STATE)
    for i in range(2):
        assert np.array_equal(np.load(shard_path(work, i)), np.load(shard_path(src, i)))
