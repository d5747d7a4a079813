"""Every relative link in README.md and docs/*.md points at a file that exists.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_docs_links.py -q
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) outside code spans; the target stops at whitespace or ')'.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _headings(path: Path) -> set[str]:
    """GitHub-style anchors of a markdown file's headings."""
    anchors = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title)
            anchors.add(title.replace(" ", "-"))
    return anchors


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_docs_exist_and_readme_is_short():
    assert len(DOCS) > 1, "docs/*.md missing"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    for target in _links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _headings(dest):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"
