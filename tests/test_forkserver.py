"""``tierckpt.testing.forkserver``: a rank forked from a server that imported torch is what a rank
started as an interpreter is to the script it runs (its argv, path, environment, directory, output,
exit status, SIGKILL), without the import; launch_ranks uses it where a server is set for the script."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tierckpt.testing import failures, launch_ranks
from tierckpt.testing.forkserver import ForkServer
from tierckpt.testing.ranks import _FORK_SERVERS, fork_ranks_from

SCRIPT = """\
import json, os, random, signal, sys, time
mode = sys.argv[1]
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
    "extra": os.environ.get("EXTRA"), "random": random.random(), "torch": "torch" in sys.modules,
}), flush=True)
rank = int(os.environ["RANK"])
if mode == "kill" and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "exit":
    sys.exit(rank + 3)
if mode == "raise" and rank == 0:
    raise ValueError("raised in rank 0")
if mode == "hang" and rank == 1:
    time.sleep(60)
"""


@pytest.fixture
def forked(tmp_path: Path) -> Iterator[Path]:
    """A script whose ranks launch_ranks forks from a server of this test's own."""
    script = tmp_path / "scripts" / "show.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    saved = dict(_FORK_SERVERS)
    server = ForkServer()
    fork_ranks_from({"show.py": server})
    try:
        yield script
    finally:
        fork_ranks_from(saved)
        server.close()


def _said(output: str) -> dict[str, object]:
    return json.loads(output.splitlines()[0])


def test_a_forked_rank_gets_its_own_argv_path_environment_and_random_state(forked: Path) -> None:
    exits = launch_ranks([sys.executable, str(forked), "ok"], 2, env={"EXTRA": "x"}, timeout_s=120)
    assert failures(exits) == ""
    said = [_said(e.output) for e in exits]
    assert [s["rank"] for s in said] == ["0", "1"]
    assert all(s["argv"] == [str(forked), "ok"] and s["path0"] == str(forked.parent) for s in said)
    assert all(s["cwd"] == os.getcwd() and s["extra"] == "x" for s in said)
    assert all(s["torch"] for s in said)  # imported by the server, not by the script
    assert said[0]["random"] != said[1]["random"]  # reseeded in each rank, as a new interpreter is


@pytest.mark.parametrize("mode, codes", [("kill", [0, -9]), ("exit", [3, 4]), ("raise", [1, 0])])
def test_a_forked_rank_ends_as_a_started_one_would(forked: Path, mode: str, codes: list[int]) -> None:
    exits = launch_ranks([sys.executable, str(forked), mode], 2, timeout_s=120)
    assert [e.returncode for e in exits] == codes
    if mode == "raise":
        assert "ValueError: raised in rank 0" in exits[0].output


@pytest.mark.slow
def test_a_forked_rank_past_the_deadline_is_killed(forked: Path) -> None:
    begun = time.monotonic()
    exits = launch_ranks([sys.executable, str(forked), "hang"], 2, timeout_s=3)
    assert [e.returncode for e in exits] == [0, None] and time.monotonic() - begun < 30


def test_scripts_without_a_server_and_other_commands_start_interpreters(forked: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.py"
    other.write_text(SCRIPT)
    (alone,) = launch_ranks([sys.executable, str(other), "ok"], 1, timeout_s=120)
    assert alone.returncode == 0 and _said(alone.output)["torch"] is False
