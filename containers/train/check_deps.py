"""Fail the image build when a distribution's requirements are not installed.

    python check_deps.py verl TransferQueue mempo-pipeline

verl and mempo go into the base image with --no-deps (its stack must not move), so nothing
else would notice a requirement the base image lacks until a Ray worker imports it on a GPU
node. Extras (`; extra == ...`) are skipped; environment markers are evaluated.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement


def missing(dist_name: str) -> list[str]:
    """Requirements of `dist_name` that are not installed (as `name (spec)` strings)."""
    out = []
    for text in metadata.requires(dist_name) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{req.name} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name} {version} (wants {req.specifier})")
    return out


def main(names: list[str]) -> int:
    problems = {name: missing(name) for name in names}
    for name, items in problems.items():
        for item in items:
            print(f"{name} requires {item}", file=sys.stderr)
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
