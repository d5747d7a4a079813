"""Run a script as on a bare CUDA machine: only torch, transformers, tokenizers,
sentence-transformers and what they depend on are installed (plus the standard library and
this tree's `mempo`), and `--block NAME` removes more (e.g. pydantic).

    python tests/bare_python.py [--block pydantic ...] scripts/gpu_smoke.py --device cpu

It links the top-level files of those distributions (their dependency closure as installed
here, from importlib.metadata) into a temporary folder and runs the script with
`python -S` and that folder on PYTHONPATH, so everything else (faiss, bm25s, mlflow, pandas,
pyarrow, fastapi, ...) is simply not there: imports fail and `find_spec` finds nothing, as on
that machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

BARE = ("torch", "transformers", "tokenizers", "sentence-transformers")
REPO = Path(__file__).resolve().parents[1]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...], blocked: set[str]) -> set[str]:
    """The distributions `roots` need (extras off, markers evaluated here), minus `blocked`."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    stack = [canonical(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in seen or name in blocked:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(canonical(req.name))
    return seen


def link_site(target: Path, dists: set[str]) -> list[str]:
    """Symlink the top-level files of `dists` into `target`; returns the names linked."""
    linked = []
    for dist in metadata.distributions():
        if canonical(dist.metadata["Name"] or "") not in dists:
            continue
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops):
            src, dst = base / top, target / top
            if src.exists() and not dst.exists() and top != "__pycache__":
                dst.symlink_to(src)
                linked.append(top)
    return linked


def run(script_args: list[str], blocked: set[str] = frozenset(), **kwargs) -> subprocess.CompletedProcess:
    """Run `python -S SCRIPT ARGS` against the bare site (see module docstring)."""
    with tempfile.TemporaryDirectory(prefix="bare-site-") as tmp:
        site = Path(tmp)
        link_site(site, closure(BARE, {canonical(b) for b in blocked}))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(site)])
        return subprocess.run([sys.executable, "-S", *script_args], env=env, cwd=kwargs.pop("cwd", REPO), **kwargs)


def main() -> int:
    args = sys.argv[1:]
    blocked: set[str] = set()
    while args and args[0] == "--block":
        blocked.add(args[1])
        args = args[2:]
    return run(args, blocked).returncode


if __name__ == "__main__":
    sys.exit(main())
