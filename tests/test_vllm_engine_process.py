"""The vLLM worker runs in a process group of its own: a worker that hangs past its timeout is
stopped with every process it started (vLLM's engine core and workers are its children), and
the caller gets an error naming the timeout. A fake worker stands in for vLLM."""

from __future__ import annotations

import os
import sys
import time

import pytest

from dflash_trainer.errors import UserError
from dflash_trainer.models.vllm_engine import VLLMEngine

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it holds no cores or memory
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_a_hung_worker_is_stopped_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    fake = tmp_path / "python"
    # the "python" ignores the worker's arguments: it starts a child (like vLLM's engine core),
    # records its pid, and hangs
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    fake.chmod(0o755)
    engine = VLLMEngine(fake, "unused-target", timeout_s=3)
    t0 = time.perf_counter()
    with pytest.raises(UserError, match="made no progress within 3 s"):
        engine.run([[1, 2, 3]], 4)
    assert time.perf_counter() - t0 < 60
    child = int(pid_file.read_text())
    deadline = time.time() + 10
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the worker's child outlived the timeout"


_WORKER_LIKE = """
import subprocess, sys, time
sys.path.insert(0, {src!r})
from dflash_trainer.models import vllm_worker
vllm_worker._die_with_parent()
child = subprocess.Popen(["sleep", "300"])  # like vLLM's engine core
open({pids!r}, "w").write(f"{{child.pid}}")
time.sleep(300)
"""

_PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {code!r}], start_new_session=True)
time.sleep(300)
"""


def test_the_worker_and_its_children_end_when_the_project_is_killed(tmp_path):
    """The worker's watchdog: the project's process killed outright (no finally runs) still
    takes the worker and vLLM's processes with it."""
    import subprocess
    from pathlib import Path

    import dflash_trainer.models.vllm_worker as vw

    src = str(Path(vw.__file__).parents[2])
    pids = tmp_path / "pids"
    code = _WORKER_LIKE.format(src=src, pids=str(pids))
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(code=code)])
    deadline = time.time() + 60
    while not pids.exists() and time.time() < deadline:
        time.sleep(0.1)
    child = int(pids.read_text())
    assert _alive(child)
    parent.kill()
    parent.wait()
    deadline = time.time() + 15
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "vLLM's processes outlived the killed project process"
