"""Constraints for installing into the verl base image without disturbing it (build time).

    python pip_constraints.py requirements.lock > /tmp/constraints.txt
    pip install -c /tmp/constraints.txt TransferQueue==0.1.11

Every distribution already installed is pinned at its installed version (the base image's
CUDA/torch/SGLang stack stays as it is); anything else is pinned at our lock's version, so a
dependency the base image lacks is installed, at a version we tested, instead of skipped.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(lock: str) -> None:
    pins = {}
    for line in open(lock, encoding="utf-8"):
        line = line.strip()
        if line and not line.startswith("#") and "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = (name, version.split(";")[0].strip())
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            pins[canonical(name)] = (name, dist.version)
    for name, version in sorted(pins.values(), key=lambda p: canonical(p[0])):
        print(f"{name}=={version}")


if __name__ == "__main__":
    main(sys.argv[1])
