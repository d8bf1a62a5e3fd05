"""The host pool is prepared (faulted in, pinned) in the background, never on a restore's path.

The kernel call that faults pages in (``MADV_POPULATE_WRITE``) is replaced by a gate for the pool's
own thread only, so each test decides exactly how far the background preparation has got: no test
depends on how fast this machine faults memory. Pinning, slot by slot, is in test_pinning.py.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch

from tierckpt import Checkpointer
from tierckpt._buffers import prefault as real_prefault
from tierckpt.capture import prepare
from tierckpt.testing.inspect import host_pool

from helpers import assert_bitwise, fs_tier, memory_tier, ram_fs, tier_config

DEADLINE_S = 60


class Gate:
    """Stands in for the pool thread's page faulting: each call waits for a permit from the test.

    Calls from any other thread (a save preparing its own slot) fault for real at once.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._permits = threading.Semaphore(0)
        self.calls = 0  # faulting calls the pool's thread made
        self.entered = threading.Event()  # the pool's thread is inside a call
        self.saver_calls = 0
        monkeypatch.setattr(prepare, "prefault", self._prefault)

    def allow(self, n: int = 1 << 20) -> None:
        """Let the next ``n`` calls of the pool's thread through (default: all of them)."""
        self._permits.release(n)

    def drain(self) -> None:
        """Take back the permits no call used (a save that prepared its own slot first left them)."""
        while self._permits.acquire(blocking=False):
            pass

    def _prefault(self, view: memoryview) -> bool:
        if threading.current_thread().name != "tierckpt-pool":
            self.saver_calls += 1
            return real_prefault(view)
        self.calls += 1
        self.entered.set()
        assert self._permits.acquire(timeout=DEADLINE_S), "the test never let the pool's thread through"
        return real_prefault(view)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(monkeypatch)
    yield g
    g.allow()  # whatever the test did, no pool thread stays blocked


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g), "b": torch.randn(300, generator=g)}


def saved_once(tmp_path: Path, gate: Gate) -> dict:
    """A config whose nvme tier holds step 1, saved by a Checkpointer whose pool was let through."""
    config = ram_fs(tmp_path / "nvme", capacity="64MiB")
    gate.allow(4)  # 64 MiB: four pieces of 16 MiB, all of this Checkpointer's pool
    with Checkpointer(config) as ckpt:
        assert ckpt.save_sync(1, state(1)).committed_sync("nvme", timeout=DEADLINE_S)
        assert host_pool(ckpt).wait_prepared(DEADLINE_S)
    gate.drain()  # the next Checkpointer's thread starts with none
    return config


def test_construction_and_restore_do_not_wait_for_the_pool(tmp_path: Path, gate: Gate) -> None:
    config = saved_once(tmp_path, gate)
    gate.calls = gate.saver_calls = 0
    gate.entered.clear()
    # The pool's thread is held in its first fault: construction and a whole restore go on without it.
    with Checkpointer(config) as ckpt:
        assert gate.entered.wait(DEADLINE_S)
        pool = host_pool(ckpt)
        assert not any(pool.ready(slot) for slot in pool.slots)
        template = {"w": torch.zeros(256, 256), "b": torch.zeros(300)}
        restored = ckpt.restore_latest_sync(template)
        assert restored is not None and restored.step == 1
        assert_bitwise(template, state(1))
        assert gate.calls == 1 and not any(pool.ready(slot) for slot in pool.slots)
        gate.allow()
        assert pool.wait_prepared(DEADLINE_S)
        assert all(pool.ready(slot) for slot in pool.slots)


def test_a_save_before_its_slot_is_ready_prepares_that_slot_without_waiting_for_the_pool_thread(tmp_path: Path, gate: Gate) -> None:
    # 64 MiB in 2 slots: 32 MiB each, faulted in 16 MiB pieces by the pool's thread.
    with Checkpointer(ram_fs(tmp_path / "nvme", capacity="64MiB", snapshots=2)) as ckpt:
        assert gate.entered.wait(DEADLINE_S)  # held in slot 0's first piece, and kept there
        pool = host_pool(ckpt)
        first, second = pool.slots
        handle = ckpt.save_sync(1, state(1))  # gets slot 0, and faults it in itself
        assert handle.committed_sync("nvme", timeout=DEADLINE_S)
        assert pool.ready(first) and not pool.ready(second)
        assert gate.calls == 1 and gate.saver_calls == 1
        gate.allow()
        assert pool.wait_prepared(DEADLINE_S) and pool.ready(second)
        assert gate.calls == 3  # the piece it was held in, then slot 1's two: slot 0 was ready
        restored = ckpt.restore_latest_sync()
    assert restored is not None
    assert_bitwise(restored.state, state(1))


def test_a_slot_the_pool_thread_has_not_reached_is_faulted_by_whoever_needs_it(tmp_path: Path, gate: Gate) -> None:
    with Checkpointer(ram_fs(tmp_path / "nvme", capacity="64MiB", snapshots=2)) as ckpt:
        assert gate.entered.wait(DEADLINE_S)  # held inside slot 0
        pool = host_pool(ckpt)
        first, second = pool.slots
        pool.prepare(second)  # what a save given slot 1 does, in its own thread
        assert pool.ready(second) and not pool.ready(first)
        assert gate.saver_calls == 1 and gate.calls == 1
        gate.allow()
        assert pool.wait_prepared(DEADLINE_S) and pool.ready(first)
        assert gate.calls == 2  # slot 0's two pieces; slot 1 was ready when the thread got there


def test_a_restore_pauses_the_pool_thread_until_it_ends(tmp_path: Path, gate: Gate) -> None:
    config = saved_once(tmp_path, gate)
    gate.calls = 0
    gate.entered.clear()
    with Checkpointer(config) as ckpt:
        pool = host_pool(ckpt)
        preparer = pool.preparer()
        assert gate.entered.wait(DEADLINE_S)
        with preparer.paused():
            gate.allow()  # the piece under way finishes; then the thread waits for the pause to end
            assert preparer.idle.wait(DEADLINE_S)
            calls = gate.calls
            assert ckpt.restore_latest_sync() is not None
            assert gate.calls == calls
        assert pool.wait_prepared(DEADLINE_S)
        assert gate.calls > calls
        assert all(pool.ready(slot) for slot in pool.slots)


def test_close_during_the_fault_in_stops_the_pool_thread(tmp_path: Path, gate: Gate) -> None:
    ckpt = Checkpointer(ram_fs(tmp_path / "nvme", capacity="64MiB"))
    assert gate.entered.wait(DEADLINE_S)
    preparer = host_pool(ckpt).preparer()
    closing = threading.Thread(target=ckpt.close_sync)
    closing.start()
    gate.allow()
    closing.join(DEADLINE_S)
    assert not closing.is_alive()
    assert preparer.idle.is_set() and preparer.stopped()
    assert gate.calls == 1  # stopped after the piece it was in: 32 MiB a slot is two pieces of 16 MiB


def test_the_ram_tier_pool_is_prepared_in_the_background_too(tmp_path: Path, gate: Gate) -> None:
    config = tier_config(fs_tier("nvme", tmp_path / "nvme"), capacity="64MiB", ram=memory_tier(path=str(tmp_path / "shm")))
    gate.allow(4)  # 64 MiB: four pieces of 16 MiB, all of this Checkpointer's pool
    with Checkpointer(config) as ckpt:
        assert host_pool(ckpt).wait_prepared(DEADLINE_S)
        assert ckpt.save_sync(3, state(3)).committed_sync("nvme", timeout=DEADLINE_S)
    assert gate.calls == 4
    gate.entered.clear()
    # A new process finds the snapshot in the pool file and restores it while the pool's thread is held.
    with Checkpointer(config) as ckpt:
        assert gate.entered.wait(DEADLINE_S)
        restored = ckpt.restore_latest_sync()
        assert restored is not None and restored.tier == "ram"
        assert_bitwise(restored.state, state(3))
        pool = host_pool(ckpt)
        assert gate.calls == 5 and not any(pool.ready(slot) for slot in pool.slots)
        gate.allow()


def test_the_pool_thread_takes_at_most_a_quarter_of_a_core(tmp_path: Path) -> None:
    import time

    # Real faulting here (no gate): after each piece the thread rests three times the CPU time it took.
    began = time.monotonic()
    with Checkpointer(ram_fs(tmp_path / "nvme", capacity="256MiB")) as ckpt:
        pool = host_pool(ckpt)
        assert pool.wait_prepared(DEADLINE_S)
        took = time.monotonic() - began
        preparer = pool.preparer()
    assert preparer.worked_s > 0
    assert preparer.rested_s == pytest.approx(3 * preparer.worked_s)
    # The rests were taken, not only counted: the thread's CPU time is at most a quarter of its time.
    assert took >= preparer.worked_s + preparer.rested_s - 0.01, (took, preparer.worked_s, preparer.rested_s)


# A save whose tensor changes under its held copy fails torn. The FlushError's traceback keeps the
# snapshot, and with it tensors over the pool's memory; its frames' locals are formatted after the
# Checkpointer closed, as pytest or an error reporter formats them. Run in a child process: a pool
# unmapped under those tensors crashes whoever reads them.
TORN_AFTER_CLOSE = """
import sys, traceback, torch
from tierckpt import Checkpointer, FlushError
from tierckpt.testing.copies import HeldCopies
config = {"host": {"capacity": "1MiB", "snapshots": 1}, "tiers": [{"name": "nvme", "type": "filesystem", "path": sys.argv[1]}]}
state = {"w": torch.arange(4096, dtype=torch.float32)}
ckpt = Checkpointer(config)
held = HeldCopies(ckpt, deadline_s=60)
handle = ckpt.save_sync(1, state)
state["w"].add_(1)  # changed while its copy waits: the capture is torn
held.release()
try:
    ckpt.close_sync()
    raise SystemExit("close() did not raise the torn capture")
except FlushError as exc:
    error = exc
formatted = "".join(traceback.TracebackException.from_exception(error, capture_locals=True).format())
print("snapshot" in formatted, "modified in place" in formatted)
"""


def test_tensors_over_the_pool_outlive_the_checkpointer_that_closed_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", TORN_AFTER_CLOSE, str(tmp_path / "nvme")], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split() == ["True", "True"], child.stdout  # the locals formatted include the snapshot's
