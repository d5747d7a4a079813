"""Publish a new retrieval index: repoint `<root>/current` at `<root>/<build>` atomically.

    mempo index publish --root /mnt/mempo-indexes --build 2026-01-01T00-00-00_00-00

The link is RELATIVE (`current -> <build>`), so it resolves wherever the volume is mounted:
the `mempo_index` DAG's pods and the retriever Deployment mount the same claim. The swap is
a symlink created beside `current` and renamed over it (rename is atomic on POSIX), so a
reader sees the old index or the new one, never neither. No shell is involved: the DAG runs
this as `mempo index publish` (the DAG params travel as argv, not as shell text).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from mempo.errors import DataError

CURRENT = "current"


def publish_index(root: str | Path, build: str) -> dict[str, Any]:
    """Point `root/current` at `root/build` (a folder holding an index `manifest.json`).

    Args:
        root: the index root (one folder per build + `current`).
        build: the build's folder NAME inside root (no `/`, not `.`/`..`, not `current`).
    Returns:
        {"current": path of the link, "target": build, "previous": old target or None}.
    """
    root = Path(root)
    if not build or "/" in build or build in (".", "..", CURRENT) or build.startswith(".") or "\0" in build:
        raise DataError(f"the build must be a folder name inside the index root, got {build!r}",
                        path=root, field="build")
    target = root / build
    if target.is_symlink() or not target.is_dir():
        raise DataError("no such index folder (run the build first)", path=target)
    if not (target / "manifest.json").is_file():
        raise DataError("not an index folder: no manifest.json (did the build finish?)", path=target)
    link = root / CURRENT
    previous = os.readlink(link) if link.is_symlink() else None
    if link.exists() and not link.is_symlink():
        raise DataError("exists and is not a symlink; move it away before publishing", path=link)
    tmp = root / f".{CURRENT}.{uuid.uuid4().hex}.tmp"
    os.symlink(build, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename survives a crash of the node
    finally:
        os.close(fd)
    return {"current": str(link), "target": build, "previous": previous}
