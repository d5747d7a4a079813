"""`mempo index publish`: `current` is swapped atomically to a relative link, and anything
that is not a finished build folder inside the root is refused before the link moves."""

from __future__ import annotations

import os

import pytest

from mempo.errors import DataError
from mempo.orchestration.publish import publish_index


def _build(root, name):
    (root / name).mkdir(parents=True)
    (root / name / "manifest.json").write_text("{}")


def test_publish_swaps_a_relative_link_that_survives_remounting(tmp_path):
    root = tmp_path / "indexes"
    _build(root, "run-1")
    _build(root, "run-2")
    assert publish_index(root, "run-1")["previous"] is None
    result = publish_index(root, "run-2")
    assert result == {"current": str(root / "current"), "target": "run-2", "previous": "run-1"}
    assert os.readlink(root / "current") == "run-2"
    moved = tmp_path / "mounted-elsewhere"
    root.rename(moved)  # another pod mounts the volume at another path: the link still resolves
    assert (moved / "current" / "manifest.json").is_file()
    assert sorted(p.name for p in moved.iterdir()) == ["current", "run-1", "run-2"]  # no temp link left


@pytest.mark.parametrize("build", ["", "..", ".", "current", "a/b", "../etc", ".hidden"])
def test_publish_refuses_names_outside_the_root(tmp_path, build):
    with pytest.raises(DataError, match="folder name inside the index root"):
        publish_index(tmp_path, build)


def test_publish_refuses_unfinished_builds_and_a_real_current_folder(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(DataError, match="no manifest.json"):
        publish_index(tmp_path, "half")
    with pytest.raises(DataError, match="no such index folder"):
        publish_index(tmp_path, "missing")
    _build(tmp_path, "ok")
    (tmp_path / "current").mkdir()
    with pytest.raises(DataError, match="not a symlink"):
        publish_index(tmp_path, "ok")
    assert (tmp_path / "current").is_dir()
