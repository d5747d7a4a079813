"""`mempo.training.runtime.die_with_parent`: a pool's workers end with the process that made
the pool, however it ends (a real spawned pool, a real SIGKILL)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_a_killed_parent_takes_its_pool_workers_with_it(tmp_path: Path) -> None:
    """Pool workers started with `die_with_parent` (the learning study's, objective_fates' and
    `mempo eval`'s): SIGKILL the pool's process and the worker running a job ends too, instead
    of running on."""
    import os
    import signal
    import subprocess
    import sys
    import time

    def alive(pid: int) -> bool:  # a zombie (dead, not yet reaped by whoever adopted it) is not
        try:
            return "\tZ" not in Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
        except (FileNotFoundError, IndexError):
            return False

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    script = tmp_path / "study.py"
    script.write_text(
        "import multiprocessing as mp, os, sys, time\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from mempo.training.runtime import die_with_parent\n"
        "if __name__ == '__main__':\n"
        "    pool = ProcessPoolExecutor(1, mp_context=mp.get_context('spawn'), initializer=die_with_parent,\n"
        "                               initargs=(os.getpid(),))\n"
        "    print(pool.submit(os.getpid).result(), flush=True)\n"
        "    pool.submit(time.sleep, 600)\n"
        "    time.sleep(600)\n")
    study = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker = int(study.stdout.readline())  # type: ignore[union-attr]
    assert alive(worker)  # while the study is
    study.send_signal(signal.SIGKILL)
    study.wait()
    for _ in range(200):  # the worker gets SIGTERM from the kernel; wait until it is gone
        if not alive(worker):
            break
        time.sleep(0.05)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail(f"worker {worker} outlived its study")
