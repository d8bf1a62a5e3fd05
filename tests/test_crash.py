"""Crash tests: SIGKILL a real process mid-flush, then a new Checkpointer must find a committed version.

The child (``crash_child.py``) saves a deterministic state per step to ram → nvme and says on stdout
what was saved and what ``handle.committed("nvme")`` confirmed. Whatever the moment of the kill, a new
Checkpointer on the same directory must sweep every temporary directory on open and restore a step at
least as new as the last one the child reported committed, bitwise equal to that step's state.

The last test runs a short form (20 kills) of ``benchmarks/crash_campaign.py``: ram → nvme → pfs with
promotion and pruning, killed at random and at chosen points of capture, flush, promotion, pruning and
the next open's sweep, with runs that roll back (``restore(step)`` of an earlier step, then saving on
from it) or save steps again (the full campaign runs 200).
"""

from __future__ import annotations

import importlib.util
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.format import version_dirname
from tierckpt.testing.ranks import start_script

from helpers import assert_bitwise

_CHILD = Path(__file__).with_name("crash_child.py")
_spec = importlib.util.spec_from_file_location("tierckpt_crash_child", _CHILD)
assert _spec is not None and _spec.loader is not None
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

_LINE_TIMEOUT_S = 120  # a deadlock guard only: every line normally comes within a second or two


@pytest.fixture(scope="module")
def big() -> torch.Tensor:
    return child.base()


class Child:
    """A running crash_child.py; its stdout lines arrive in a queue read with a deadline."""

    def __init__(self, root: Path, *args: str, log: Path) -> None:
        self._stderr = open(log, "wb")
        # Forked from the suite's fork server (tierckpt.testing.forkserver) where it has one.
        self.proc = start_script([sys.executable, str(_CHILD), str(root), *args], stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.log = log
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.committed: int | None = None
        self.saved: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def until(self, predicate: Callable[[list[str]], bool]) -> list[str]:
        """Read lines until ``predicate(words)`` holds; returns those words."""
        while True:
            try:
                line = self.lines.get(timeout=_LINE_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"the child said nothing for {_LINE_TIMEOUT_S}s; stderr: {self.stderr()}")
            if line is None:
                pytest.fail(f"the child exited ({self.proc.wait()}); stderr: {self.stderr()}")
            words = line.split()
            if words[0] == "committed":
                step = int(words[1])
                self.committed = step if self.committed is None else max(self.committed, step)
            elif words[0] == "saved":
                self.saved = int(words[1])
            if predicate(words):
                return words

    def count(self, kind: str, n: int) -> Callable[[list[str]], bool]:
        seen = {"n": 0}

        def predicate(words: list[str]) -> bool:
            if words[0] == kind:
                seen["n"] += 1
            return seen["n"] >= n

        return predicate

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stderr(self) -> str:
        self._stderr.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        try:
            self.kill()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._stderr.close()
            self._reader.join(timeout=10)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Child]]:
    children: list[Child] = []

    def start(*args: str) -> Child:
        c = Child(tmp_path / "nvme", *args, log=tmp_path / f"child-{len(children)}.stderr")
        children.append(c)
        return c

    try:
        yield start
    finally:
        for c in children:
            c.close()  # always killed and reaped, whatever the test did


def _recover(root: Path, big: torch.Tensor) -> Any:
    """Open the directory as a restarted job would; check the sweep; restore and verify."""
    with Checkpointer(child.config(str(root))) as ckpt:
        hidden = sorted(n for n in os.listdir(root) if n.startswith("."))
        assert hidden == [], f"left after open: {hidden}"
        restored = ckpt.restore_latest_sync()
        listing = sorted(os.listdir(root))
    if restored is not None:
        assert restored.tier == "nvme"
        expected = child.make_state(restored.step, big, restored.state["variant"])
        assert_bitwise(restored.state, expected)
    return restored, listing


@pytest.mark.parametrize("after", [1, 3, 6], ids=lambda n: f"after-committed-{n}")
def test_kill_after_a_commit_was_reported(spawn: Callable[..., Child], tmp_path: Path, big: torch.Tensor, after: int) -> None:
    c = spawn("loop")
    c.until(c.count("committed", after))
    c.kill()
    reported = c.committed
    assert reported is not None and reported >= after
    restored, listing = _recover(tmp_path / "nvme", big)
    assert restored is not None, listing
    assert restored.step >= reported, (restored.step, reported, listing)
    assert restored.state["variant"] == 0


@pytest.mark.parametrize("saves", [1, 4], ids=lambda n: f"after-save-{n}")
def test_kill_right_after_a_save(spawn: Callable[..., Child], tmp_path: Path, big: torch.Tensor, saves: int) -> None:
    c = spawn("loop")
    c.until(c.count("saved", saves))
    c.kill()
    reported = c.committed
    restored, listing = _recover(tmp_path / "nvme", big)
    if reported is not None:
        assert restored is not None and restored.step >= reported, (reported, listing)
    if restored is not None:  # whatever was committed is whole
        assert restored.step <= c.saved + 1


@pytest.mark.parametrize("point", ["data", "staged"])
def test_kill_at_a_point_of_the_commit_returns_the_previous_version(
    spawn: Callable[..., Child], tmp_path: Path, big: torch.Tensor, point: str
) -> None:
    root = tmp_path / "nvme"
    c = spawn("pause", point, "3")
    c.until(lambda words: words[0] == "paused")
    # The version being written is there under its temporary name only.
    leftovers = [n for n in os.listdir(root) if n.startswith(".tmp-step-000000000003-")]
    assert len(leftovers) == 1, os.listdir(root)
    assert not (root / version_dirname(3)).exists()
    c.kill()
    assert c.committed == 2
    restored, listing = _recover(root, big)
    assert restored is not None and restored.step == 2, listing
    assert listing == [version_dirname(1), version_dirname(2)]


def test_kill_while_replacing_a_committed_step_keeps_that_step(spawn: Callable[..., Child], tmp_path: Path, big: torch.Tensor) -> None:
    root = tmp_path / "nvme"
    c = spawn("pause", "replace", "3")
    c.until(lambda words: words[0] == "paused")
    # Between the two renames: the old step 3 moved aside, the new one still under its temporary name.
    assert not (root / version_dirname(3)).exists(), os.listdir(root)
    assert any(n.startswith(".tmp-step-000000000003-") for n in os.listdir(root))
    c.kill()
    assert c.committed == 3
    restored, listing = _recover(root, big)
    assert restored is not None, listing
    assert restored.step == 3, (restored.step, listing)  # not lost: step 3 was committed
    assert restored.state["variant"] == 0  # its replacement never was
    assert listing == [version_dirname(2), version_dirname(3)]


_CAMPAIGN = Path(__file__).resolve().parents[1] / "benchmarks" / "crash_campaign.py"


@pytest.mark.slow
@pytest.mark.parametrize("delta", [None, 3], ids=["whole", "delta"])
def test_a_short_crash_campaign_loses_nothing(tmp_path: Path, delta: int | None) -> None:
    """20 SIGKILLs (10 at random, 10 at kill points) of a run saving through ram → nvme → pfs; with
    ``delta``, both disk tiers store differential versions (a whole one every 3).

    Some runs roll back or save steps again. After each kill: nothing left to sweep once a new
    Checkpointer opened, every listed version verifies bitwise on its own and is marked abandoned
    exactly when the campaign's model of the lineages says so, the restore is bitwise what was saved,
    the newest live version listed and no older (by save call) than the newest version acknowledged
    committed on any tier, and each tier kept what retention must keep (see the campaign's docstring).
    About 25 s on 2 cores.
    """
    spec = importlib.util.spec_from_file_location("tierckpt_crash_campaign", _CAMPAIGN)
    assert spec is not None and spec.loader is not None
    campaign = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = campaign  # dataclasses look their module up while it runs
    spec.loader.exec_module(campaign)
    lines: list[str] = []
    report = campaign.campaign(20, seed=11, workdir=tmp_path, max_delay_s=1.0, log=lines.append, delta=delta)
    summary = "\n".join(lines)
    assert report["kills"] == 20, summary
    assert report["violations"] == [], summary
    assert report["versions_lost"] == 0, summary
    assert report["restores_ok"] == 20, summary
    # The campaign did what it is for: commits acknowledged on both tiers, pruned, killed at points.
    assert report["commits_acknowledged"].get("nvme", 0) > 0 and report["commits_acknowledged"].get("pfs", 0) > 0, summary
    assert report["targeted_hits"] >= 3, summary  # most of the 10 aimed kills reach their point
    assert report["versions_verified"] >= 20, summary
    # Runs went back: rollbacks that restored an earlier step and saved on from it, and rewinds.
    assert report["rollbacks_saving"] >= 1 and report["rewound_runs"] >= 1, summary
