"""No image runs a pre-release Python: apt pins and python image tags name final releases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "containers").glob("*/Dockerfile"))
# Debian/Ubuntu versions of a pre-release sort below the release with "~" (3.11.0~rc1);
# upstream tags spell it 3.11.0rc1 / 3.13.0a2 / 3.12.0b4.
PRE_RELEASE = re.compile(r"~(rc|a|b|alpha|beta)\d*|\d(rc|a|b)\d+(\b|-|$)", re.IGNORECASE)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_python_is_a_final_release(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    pins = re.findall(r"\b(python3(?:\.\d+)?(?:-[a-z]+)?)=(\S+)", text)
    tags = re.findall(r"^FROM\s+\S*python:(\S+)", text, flags=re.MULTILINE | re.IGNORECASE)
    for name, version in pins:
        assert not PRE_RELEASE.search(version), f"{dockerfile}: {name}={version} is a pre-release"
    for tag in tags:
        assert not PRE_RELEASE.search(tag), f"{dockerfile}: python:{tag} is a pre-release"
