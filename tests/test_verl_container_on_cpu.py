"""The train image without a Docker engine: TransferQueue and the plug-in's imports go in with
their dependencies under constraints that keep the base image's stack, the build fails when
verl or TransferQueue miss a requirement, and the non-root user has a folder to write in
(the same uid the RayJob's pods run as)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "containers" / "train"


def _run(script: str, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = None
    if path:
        import os

        env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, str(TRAIN / script), *args], capture_output=True, text=True, env=env)


def test_check_deps_passes_here_and_names_a_missing_requirement(tmp_path):
    assert _run("check_deps.py", "verl", "TransferQueue").returncode == 0  # this venv has them all
    dist = tmp_path / "needs_things-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: needs-things\nVersion: 1.0\n"
                                   "Requires-Dist: no-such-package-xyz>=1\n"
                                   "Requires-Dist: numpy<0.1\n"
                                   "Requires-Dist: also-missing; extra == \"gpu\"\n")
    proc = _run("check_deps.py", "needs-things", path=str(tmp_path))
    assert proc.returncode == 1
    assert "no-such-package-xyz (not installed)" in proc.stderr
    assert re.search(r"numpy \S+ \(wants <0.1\)", proc.stderr)
    assert "also-missing" not in proc.stderr  # extras are not required


def test_constraints_pin_installed_versions_and_fill_the_rest_from_the_lock(tmp_path):
    from importlib import metadata

    lock = tmp_path / "requirements.lock"
    lock.write_text("# comment\ntorch==1.0.0\nmsgspec==0.22.0\nsurely-not-installed-pkg==3.2.1\n")
    out = _run("pip_constraints.py", str(lock)).stdout.splitlines()
    pins = dict(line.split("==", 1) for line in out)
    assert pins["torch"] == metadata.version("torch")  # installed wins over the lock
    assert pins["surely-not-installed-pkg"] == "3.2.1"
    assert len(pins) == len(out)  # one pin per distribution


def test_dockerfile_installs_transfer_queue_with_deps_and_gives_the_user_a_folder():
    from mempo.config import ClusterParams
    from mempo.orchestration.rayjob_manifest import base_rayjob

    text = (TRAIN / "Dockerfile").read_text()
    joined = re.sub(r"\\\n\s*", " ", text)
    tq_lines = [line for line in joined.splitlines() if "TransferQueue" in line and line.startswith("RUN")]
    assert tq_lines and all("--no-deps" not in line.split("TransferQueue")[1].split("&&")[0] for line in tq_lines)
    assert "pip install -c /tmp/constraints.txt -r /tmp/extra.txt" in joined
    assert "python check_deps.py verl TransferQueue" in joined
    root = re.search(r"^ENV MEMPO_PROJECT_ROOT=(\S+)", text, re.M).group(1)
    user = re.findall(r"^USER (\d+)", text, re.M)[-1]
    assert re.search(rf"install -d -o {user} -g {user} -m 0755 {re.escape(root)}", joined)
    assert root.startswith("/app/")  # relative outputs/ under the WORKDIR land in it
    pod = base_rayjob(ClusterParams())["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == user
