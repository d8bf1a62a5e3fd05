"""The pipeline: backpressure, PCheck newest-only flushing, flush policies, retention, leases, failures.

Slow flushes are made deterministic with a gated tier (a :class:`tierckpt.testing.SlowTier` whose
writes wait for the test to open a gate) instead of timed sleeps; clocks are injected.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierckpt import Checkpointer, FlushError
from tierckpt.config import KeepPolicy
from tierckpt.errors import SpaceNeeded
from tierckpt.pipeline.space import _keep_words, _kept
from tierckpt.testing import Gates, ManualClock, SlowTier, faulty, slow
from tierckpt.testing.copies import HeldCopies
from tierckpt.testing.inspect import captured_done, committed_done, is_closed, noticed_copy_checks, run_on_engine

from helpers import Opened, assert_bitwise, fs_tier, held, memory_tier

DEADLINE_S = 30.0  # a deadlock guard only: every wait below ends on an event long before it


CLOSE_TOLERATES = (FlushError,)  # for the opened fixture: a test that failed already says why itself


def config(*tiers: dict[str, Any], capacity: str = "4MiB", snapshots: int = 2, on_full: str = "block", copy_threads: int = 2) -> dict[str, Any]:
    return {"host": {"capacity": capacity, "snapshots": snapshots, "on_full": on_full, "copy_threads": copy_threads}, "tiers": list(tiers)}


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 16, generator=g), "i": torch.arange(step, step + 10), "n": np.full(3, step, dtype=np.int32), "step": step}


def step_dirs(path: Path) -> list[str]:
    """Everything in a tier directory (leftover temporary or trash entries included)."""
    return sorted(os.listdir(path))


def names(*steps: int) -> list[str]:
    return [f"step-{s:012d}" for s in steps]


_isolated = itertools.count()


def restore_version_dir(version_dir: Path, scratch: Path) -> Any:
    """Restore one version directory on its own: copied alone into a fresh tier directory."""
    root = scratch / f"isolated-{next(_isolated)}"
    shutil.copytree(version_dir, root / version_dir.name)
    with Checkpointer(config(fs_tier("only", root), capacity="1MiB", snapshots=1)) as ckpt:
        restored = ckpt.restore_latest_sync()
    assert restored is not None
    return restored


# -- backpressure -------------------------------------------------------------------------------------


def test_on_full_block_returns_only_once_the_flush_freed_the_slot(tmp_path: Path, opened: Opened) -> None:
    made: list[Any] = []
    make_slow = slow({"nvme": 0.3})
    ckpt = Checkpointer(
        config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme"), snapshots=1, on_full="block"),
        tier_factory=lambda cfg: made.append(make_slow(cfg)) or made[-1],
    )
    opened.append(ckpt)
    slow_nvme = next(t for t in made if isinstance(t, SlowTier))
    first = ckpt.save_sync(1, state_for(1))
    # Until its flush starts, step 1 is only pending and a newer save may replace it (newest only);
    # once nvme reads it, the only slot is leased until the 0.3 s write is done.
    deadline = time.monotonic() + DEADLINE_S
    while slow_nvme.writes_started == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert slow_nvme.writes_started == 1
    second = ckpt.save_sync(2, state_for(2))
    assert committed_done(first, "nvme"), "save() returned while the only slot was still being flushed"
    assert first.committed_sync("nvme", 0) is True
    assert not second.skipped
    assert second.committed_sync("nvme", DEADLINE_S) is True
    assert step_dirs(tmp_path / "nvme") == names(1, 2)


def test_saves_do_not_wait_for_disk_while_a_slot_can_be_had(tmp_path: Path, opened: Opened) -> None:
    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme"), snapshots=2), tier_factory=gates)
    opened.append(ckpt)
    h1 = ckpt.save_sync(1, state_for(1))
    assert gates["nvme"].started.wait(DEADLINE_S)  # step 1's flush holds its slot

    def more_saves() -> list[Any]:
        # Step 2 takes the free slot; step 3 replaces step 2, which is only waiting to be flushed.
        handles = [ckpt.save_sync(step, state_for(step)) for step in (2, 3)]
        for handle in handles:
            handle.captured_sync(DEADLINE_S)
        return handles

    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.extend(more_saves()))
    worker.start()
    worker.join(DEADLINE_S)
    assert not worker.is_alive(), "save() waited for the disk"
    h2, h3 = result
    assert not committed_done(h1, "nvme")  # the gate is still closed
    assert h2.committed_sync("nvme", DEADLINE_S) is False  # superseded by step 3
    gates.open_all()
    assert h1.committed_sync("nvme", DEADLINE_S) is True
    assert h3.committed_sync("nvme", DEADLINE_S) is True


async def test_on_full_skip_drops_the_save_while_the_slow_flush_holds_the_slot(tmp_path: Path, opened: Opened) -> None:
    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme"), snapshots=1, on_full="skip"), tier_factory=gates)
    opened.append(ckpt)
    first = await ckpt.save(1, state_for(1))
    assert await first.captured() is True
    assert await asyncio.to_thread(gates["nvme"].started.wait, DEADLINE_S)

    skipped = await ckpt.save(2, state_for(2))
    assert skipped.skipped is True and skipped.step == 2
    assert await skipped.captured() is False
    assert await skipped.committed("ram") is False
    assert await skipped.committed("nvme") is False
    assert ckpt.counters.skipped_saves == 1
    assert not committed_done(first, "nvme")

    gates.open_all()
    assert await first.committed("nvme") is True
    await ckpt.wait()
    # With the slot free again, the next save happens.
    third = await ckpt.save(3, state_for(3))
    assert third.skipped is False
    assert await third.committed("nvme") is True
    counters = ckpt.counters
    assert (counters.saves, counters.skipped_saves) == (3, 1)
    assert held(ckpt, "nvme") == [1, 3]
    restored = await ckpt.restore_latest()
    assert restored is not None and restored.step == 3
    assert_bitwise(restored.state, state_for(3))


# -- PCheck: the flusher takes the newest --------------------------------------------------------------


def test_a_busy_flusher_takes_the_newest_and_the_superseded_resolve_false(tmp_path: Path, opened: Opened) -> None:
    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme"), snapshots=3), tier_factory=gates)
    opened.append(ckpt)
    handles = {1: ckpt.save_sync(1, state_for(1))}
    assert gates["nvme"].started.wait(DEADLINE_S)  # step 1 is being flushed
    for step in range(2, 6):
        handles[step] = ckpt.save_sync(step, state_for(step))
    for step in range(2, 6):
        assert handles[step].captured_sync(DEADLINE_S) is True
    for step in (2, 3, 4):
        assert handles[step].committed_sync("nvme", DEADLINE_S) is False, step
    assert not committed_done(handles[5], "nvme")  # pending behind the closed gate
    assert not committed_done(handles[1], "nvme")

    gates.open_all()
    assert handles[1].committed_sync("nvme", DEADLINE_S) is True
    assert handles[5].committed_sync("nvme", DEADLINE_S) is True
    ckpt.wait_sync()
    assert gates["nvme"].steps == [1, 5]
    assert step_dirs(tmp_path / "nvme") == names(1, 5)
    assert ckpt.counters.passed_over["nvme"] == 3
    assert ckpt.counters.flushed["nvme"] == 2


def test_captures_finishing_out_of_order_still_flush_the_newest(tmp_path: Path, opened: Opened) -> None:
    """Two copy threads: a big save 1 and a tiny save 2 start together, so save 2 is usually captured
    first. Whatever the order, the newest save must end up flushed (it used to be the older one)."""
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme"), capacity="20MiB", snapshots=2, copy_threads=2))
    opened.append(ckpt)
    occupied = HeldCopies(ckpt, 2, deadline_s=DEADLINE_S)
    try:
        h1 = ckpt.save_sync(1, {"big": torch.ones(2 << 20)})  # 8 MiB: one long copy
        h2 = ckpt.save_sync(2, {"small": torch.arange(16)})
    finally:
        occupied.release()  # raises if a held thread had given up waiting
    ckpt.wait_sync()
    assert h2.committed_sync("nvme", 0) is True
    assert h1.committed_sync("nvme", 0) is False
    assert held(ckpt, "nvme") == [2]


# -- flush policies ------------------------------------------------------------------------------------


def test_flush_every_n_and_every_steps_select_on_the_stream_of_saves(tmp_path: Path, opened: Opened) -> None:
    """Each tier's rules apply to the saves, not to what the tier above took: pfs's every_steps 3 picks
    105 and 111 too, which nvme's every 2 passed over."""
    ckpt = Checkpointer(
        config(
            memory_tier("ram", keep={"last": 1}),
            fs_tier("nvme", tmp_path / "nvme", flush={"every": 2}),
            fs_tier("pfs", tmp_path / "pfs", flush={"every_steps": 3}),
        )
    )
    opened.append(ckpt)
    steps = list(range(101, 113))  # saves 1..12; steps chosen so that a save's number != its step
    results = {}
    for step in steps:
        handle = ckpt.save_sync(step, state_for(step))
        ckpt.wait_sync()  # one at a time: nothing is superseded, only the policies decide
        results[step] = (handle.committed_sync("nvme", 0), handle.committed_sync("pfs", 0))
    nvme_steps = [s for s in steps if (s - 100) % 2 == 0]  # every 2nd save
    pfs_steps = [s for s in steps if s % 3 == 0]  # steps divisible by 3, whatever nvme took
    assert nvme_steps == [102, 104, 106, 108, 110, 112] and pfs_steps == [102, 105, 108, 111]
    assert results == {s: (s in nvme_steps, s in pfs_steps) for s in steps}
    assert step_dirs(tmp_path / "nvme") == names(*nvme_steps)
    assert step_dirs(tmp_path / "pfs") == names(*pfs_steps)
    assert ckpt.counters.passed_over == {"nvme": 6, "pfs": 8}
    for step in (105, 111):  # taken from host memory, never from nvme: each holds its own step
        assert_bitwise(restore_version_dir(tmp_path / "pfs" / names(step)[0], tmp_path).state, state_for(step))


def test_flush_every_steps_directly_below_memory(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme", flush={"every_steps": 3})))
    opened.append(ckpt)
    committed = {}
    for step in range(1, 8):
        handle = ckpt.save_sync(step, state_for(step))
        ckpt.wait_sync()
        committed[step] = handle.committed_sync("nvme", 0)
    assert committed == {1: False, 2: False, 3: True, 4: False, 5: False, 6: True, 7: False}
    assert step_dirs(tmp_path / "nvme") == names(3, 6)


def test_min_interval_holds_versions_back_with_an_injected_clock(tmp_path: Path, opened: Opened) -> None:
    clock = ManualClock()
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme", flush={"min_interval": "100s"}), snapshots=3), clock=clock)
    opened.append(ckpt)
    h1 = ckpt.save_sync(1, state_for(1))
    assert h1.committed_sync("nvme", DEADLINE_S) is True  # the first flush is not held back

    clock.now = 10.0  # within 100 s of the first flush's start (0.0)
    h2 = ckpt.save_sync(2, state_for(2))
    assert h2.captured_sync(DEADLINE_S) is True
    h3 = ckpt.save_sync(3, state_for(3))
    assert h2.committed_sync("nvme", DEADLINE_S) is False  # superseded by 3 while held back
    assert h3.captured_sync(DEADLINE_S) is True
    assert not committed_done(h3, "nvme")  # pending: held back by min_interval
    assert held(ckpt, "nvme") == [1]

    clock.now = 150.0  # the interval has passed: the next arrival goes down at once
    h4 = ckpt.save_sync(4, state_for(4))
    assert h4.committed_sync("nvme", DEADLINE_S) is True
    assert h3.committed_sync("nvme", 0) is False

    h5 = ckpt.save_sync(5, state_for(5))  # within 100 s of step 4's flush (150.0)
    assert h5.captured_sync(DEADLINE_S) is True
    assert not committed_done(h5, "nvme")
    ckpt.wait_sync()  # drain waives min_interval
    assert h5.committed_sync("nvme", 0) is True
    assert step_dirs(tmp_path / "nvme") == names(1, 4, 5)


# -- retention -----------------------------------------------------------------------------------------


def test_keep_last_n_keeps_exactly_the_newest_n_directories(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(config(memory_tier("ram", keep={"last": 1}), fs_tier("nvme", tmp_path / "nvme", keep={"last": 2})))
    opened.append(ckpt)
    for step in range(1, 7):
        ckpt.save_sync(step * 10, state_for(step * 10))
        ckpt.wait_sync()
        kept = [s * 10 for s in range(max(1, step - 1), step + 1)]
        assert step_dirs(tmp_path / "nvme") == names(*kept), step
        assert held(ckpt, "nvme") == kept
    restored = restore_version_dir(tmp_path / "nvme" / names(50)[0], tmp_path)
    assert restored.step == 50
    assert_bitwise(restored.state, state_for(50))


def test_keep_every_steps_keeps_those_forever(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(config(memory_tier("ram", keep={"last": 1}), fs_tier("nvme", tmp_path / "nvme", keep={"last": 1, "every_steps": 3})))
    opened.append(ckpt)
    for step in range(1, 11):
        ckpt.save_sync(step, state_for(step))
        ckpt.wait_sync()
    assert step_dirs(tmp_path / "nvme") == names(3, 6, 9, 10)
    assert held(ckpt, "nvme") == [3, 6, 9, 10]


def test_retention_keeps_the_version_a_downstream_flusher_is_reading(tmp_path: Path, opened: Opened) -> None:
    gates = Gates("pfs", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = Checkpointer(
        config(
            memory_tier("ram", keep={"last": 1}),
            fs_tier("nvme", tmp_path / "nvme", keep={"last": 1}),
            fs_tier("pfs", tmp_path / "pfs"),
        ),
        tier_factory=gates,
    )
    opened.append(ckpt)
    h1 = ckpt.save_sync(1, state_for(1))
    assert gates["pfs"].started.wait(DEADLINE_S)  # pfs is writing step 1 (read from host memory)
    h2 = ckpt.save_sync(2, state_for(2))
    assert h2.committed_sync("nvme", DEADLINE_S) is True
    assert held(ckpt, "nvme") == [1, 2]  # keep last 1, but pfs is writing step 1
    h3 = ckpt.save_sync(3, state_for(3))
    assert h3.committed_sync("nvme", DEADLINE_S) is True
    assert held(ckpt, "nvme") == [1, 3]  # 2 was nobody's: pruned; pfs is still writing 1
    assert (tmp_path / "nvme" / names(1)[0] / "manifest.msgpack").exists()
    assert h2.committed_sync("pfs", DEADLINE_S) is False  # superseded by 3 while pfs was busy

    gates.open_all()
    assert h1.committed_sync("pfs", DEADLINE_S) is True
    assert h3.committed_sync("pfs", DEADLINE_S) is True
    ckpt.wait_sync()
    assert step_dirs(tmp_path / "pfs") == names(1, 3)
    # pfs is done with it: nvme lets step 1 go without waiting for a commit of its own.
    assert step_dirs(tmp_path / "nvme") == names(3) and held(ckpt, "nvme") == [3]
    ckpt.save_sync(4, state_for(4))
    ckpt.wait_sync()
    assert step_dirs(tmp_path / "nvme") == names(4)
    assert step_dirs(tmp_path / "pfs") == names(1, 3, 4)
    # pfs's copy of step 1, written while nvme's retention wanted it gone, is whole.
    restored = restore_version_dir(tmp_path / "pfs" / names(1)[0], tmp_path)
    assert restored.step == 1
    assert_bitwise(restored.state, state_for(1))


def test_retention_keeps_the_version_a_downstream_flusher_is_waiting_to_take(tmp_path: Path, opened: Opened) -> None:
    """pfs is busy with step 2 when step 4 (eligible for pfs) and step 5 (not eligible) are saved; nvme
    keeps the last 1. Step 5 needs step 4's host slot (2 slots, step 2's being read): nvme holds step 4,
    so host memory lets it go and pfs reads it from nvme, which must keep it until pfs has taken it."""
    gates = Gates("pfs", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = Checkpointer(
        config(
            memory_tier("ram", keep={"last": 1}),
            fs_tier("nvme", tmp_path / "nvme", keep={"last": 1}),
            fs_tier("pfs", tmp_path / "pfs", flush={"every_steps": 2}),
        ),
        tier_factory=gates,
    )
    opened.append(ckpt)
    h2 = ckpt.save_sync(2, state_for(2))
    assert gates["pfs"].started.wait(DEADLINE_S)
    h4 = ckpt.save_sync(4, state_for(4))
    assert h4.committed_sync("nvme", DEADLINE_S) is True
    h5 = ckpt.save_sync(5, state_for(5))
    assert h5.committed_sync("nvme", DEADLINE_S) is True
    assert h5.committed_sync("pfs", DEADLINE_S) is False  # not eligible for pfs
    assert held(ckpt, "nvme") == [2, 4, 5]

    gates.open_all()
    assert h2.committed_sync("pfs", DEADLINE_S) is True
    assert h4.committed_sync("pfs", DEADLINE_S) is True
    ckpt.wait_sync()  # raises if a flush failed
    assert step_dirs(tmp_path / "pfs") == names(2, 4)
    assert held(ckpt, "nvme") == [5]  # what nvme spared for pfs is gone once pfs took it
    assert gates["pfs"].sources == ["ram", "nvme"]
    restored = restore_version_dir(tmp_path / "pfs" / names(4)[0], tmp_path)
    assert_bitwise(restored.state, state_for(4))


def test_memory_keep_last(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(config(memory_tier("ram", keep={"last": 2}), fs_tier("nvme", tmp_path / "nvme"), snapshots=4))
    opened.append(ckpt)
    for step in range(1, 6):
        ckpt.save_sync(step, state_for(step))
        ckpt.wait_sync()
        assert held(ckpt, "ram") == list(range(max(1, step - 1), step + 1))
    assert held(ckpt, "nvme") == [1, 2, 3, 4, 5]
    restored = ckpt.restore_latest_sync()
    assert restored is not None and (restored.step, restored.tier) == (5, "ram")
    assert_bitwise(restored.state, state_for(5))


def test_memory_only_config_keeps_last(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(config(memory_tier("ram", keep={"last": 1}), snapshots=2))
    opened.append(ckpt)
    for step in range(1, 5):
        handle = ckpt.save_sync(step, state_for(step))
        assert handle.committed_sync("ram", DEADLINE_S) is True
        ckpt.wait_sync()
    assert held(ckpt, "ram") == [4]
    restored = ckpt.restore_latest_sync()
    assert restored is not None and restored.step == 4
    assert_bitwise(restored.state, state_for(4))


def test_versions_reports_what_each_tier_holds(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(
        config(
            memory_tier("ram", keep={"last": 1}),
            fs_tier("nvme", tmp_path / "nvme", keep={"last": 2}),
            fs_tier("pfs", tmp_path / "pfs", flush={"every_steps": 2}, compression={"codec": "zstd"}),
        )
    )
    opened.append(ckpt)
    assert ckpt.versions() == []
    before = time.time()
    for step in (1, 2, 3):
        ckpt.save_sync(step, state_for(step))
        ckpt.wait_sync()
    after = time.time()
    infos = ckpt.versions()
    assert [(v.tier, v.step) for v in infos] == [("ram", 3), ("nvme", 2), ("nvme", 3), ("pfs", 2)]
    for info in infos:
        assert info.nbytes > 0
        assert before - 1 <= info.created <= after + 1
        if info.tier == "ram":
            assert info.path is None
        else:
            assert info.path == str((tmp_path / info.tier / names(info.step)[0]).absolute())
    created = {(v.tier, v.step): v.created for v in infos}
    assert created[("nvme", 2)] == created[("pfs", 2)]  # the save's time travels with the version
    assert ckpt.tiers == ("ram", "nvme", "pfs")


# -- failures ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keep", "said"),
    [
        (KeepPolicy(last=3), "keep {last: 3} needs 8.0 MiB for 3 versions and the one being written"),
        (
            KeepPolicy(last=2, every_steps=100),
            "keep {last: 2, every_steps: 100} needs at least 6.0 MiB for 2 versions and the one being written, plus what its other rules keep",
        ),
        (KeepPolicy(max_bytes=5 << 20), "keep {max_bytes: 5MiB} needs 6.0 MiB for 2 versions and the one being written"),
        (KeepPolicy(within_s=7200), "keep {within: 7200s} needs at least 4.0 MiB for 1 version and the one being written, plus what its other rules keep"),
        (KeepPolicy(), "no keep rule: the tier holds every version"),
    ],
)
def test_a_full_disk_says_what_keep_needs(keep: KeepPolicy, said: str) -> None:
    """Retention deletes only after a commit: a tier needs room for what keep holds and the version being written."""
    kept, open_ended = _kept(keep, 2 << 20)
    space = SpaceNeeded("/ckpt/nvme", 1 << 20, 2 << 20, False, _keep_words(keep), kept, open_ended)
    assert str(space) == f"a version needs 2.0 MiB; {said}; 1.0 MiB free in /ckpt/nvme"


def test_a_failing_tier_fails_that_handle_and_training_goes_on(tmp_path: Path, opened: Opened) -> None:
    nvme = tmp_path / "nvme"
    ckpt = Checkpointer(config(memory_tier("ram", keep={"last": 1}), fs_tier("nvme", nvme)), tier_factory=faulty({"nvme": {2}}))
    opened.append(ckpt)
    h1 = ckpt.save_sync(1, state_for(1))
    assert h1.committed_sync("nvme", DEADLINE_S) is True
    h2 = ckpt.save_sync(2, state_for(2))
    with pytest.raises(FlushError) as info:
        h2.committed_sync("nvme", DEADLINE_S)
    error = info.value
    assert (error.tier, error.step, error.errno) == ("nvme", 2, errno.ENOSPC)
    assert isinstance(error, OSError)
    assert "'nvme'" in str(error) and "step 2" in str(error) and "ENOSPC" in str(error)
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOSPC
    assert h2.committed_sync("ram", 0) is True  # the host copy itself was fine
    assert ckpt.counters.last_error["nvme"] is error

    h3 = ckpt.save_sync(3, state_for(3))  # an earlier failed flush never fails a later save
    assert h3.skipped is False
    assert h3.committed_sync("nvme", DEADLINE_S) is True  # and the tier tries again
    ckpt.wait_sync()  # the tier has committed since: nothing to raise
    counters = ckpt.counters
    assert (counters.flush_errors, counters.failed, counters.flushed["nvme"]) == (1, {"nvme": 1}, 2)
    assert held(ckpt, "nvme") == [1, 3]
    assert step_dirs(nvme) == names(1, 3)  # no temporary directory left behind
    ckpt.close_sync()

    with Checkpointer(config(fs_tier("nvme", nvme), capacity="1MiB", snapshots=1)) as fresh:
        restored = fresh.restore_latest_sync()
    assert restored is not None and (restored.step, restored.tier) == (3, "nvme")
    assert_bitwise(restored.state, state_for(3))
    first = restore_version_dir(nvme / names(1)[0], tmp_path)
    assert first.step == 1
    assert_bitwise(first.state, state_for(1))


def test_a_flush_failure_is_raised_by_wait_while_the_tier_has_committed_nothing_since(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme")), tier_factory=faulty({"nvme": {1, 2}}))
    opened.append(ckpt)
    with pytest.raises(FlushError):
        ckpt.save_sync(1, state_for(1)).committed_sync("nvme", DEADLINE_S)
    ckpt.save_sync(2, state_for(2))  # does not raise
    with pytest.raises(FlushError) as info:
        ckpt.wait_sync()
    assert (info.value.tier, info.value.step) == ("nvme", 2)  # the tier's latest failure
    ckpt.wait_sync()  # reported once
    ckpt.save_sync(3, state_for(3))
    ckpt.wait_sync()  # step 3 went down: the tier works again
    assert held(ckpt, "nvme") == [3]
    assert ckpt.counters.failed == {"nvme": 2}
    ckpt.close_sync()


def test_close_raises_when_the_last_flush_failed(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme")), tier_factory=faulty({"nvme": {2}}))
    opened.append(ckpt)
    assert ckpt.save_sync(1, state_for(1)).committed_sync("nvme", DEADLINE_S) is True
    ckpt.save_sync(2, state_for(2))
    with pytest.raises(FlushError) as info:
        ckpt.close_sync()
    assert (info.value.tier, info.value.step, info.value.errno) == ("nvme", 2, errno.ENOSPC)
    assert is_closed(ckpt)
    assert step_dirs(tmp_path / "nvme") == names(1)


def test_a_failed_capture_is_reported_and_frees_its_slot(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme"), snapshots=1, on_full="skip", copy_threads=1))
    opened.append(ckpt)
    array = np.zeros(1000, dtype=np.float32)
    occupied = HeldCopies(ckpt, deadline_s=DEADLINE_S)
    try:
        handle = ckpt.save_sync(1, {"a": array})
        # Before its copy runs, the array changes shape under the save: the copy must fail cleanly.
        array.resize(2000, refcheck=False)
    finally:
        occupied.release()  # raises if the held thread had given up waiting
    with pytest.raises(FlushError) as info:
        handle.captured_sync(DEADLINE_S)
    error = info.value
    assert (error.tier, error.step) == ("ram", 1)
    assert isinstance(error.__cause__, ValueError)
    with pytest.raises(FlushError):
        handle.committed_sync("nvme", DEADLINE_S)
    assert ckpt.counters.captures_failed == 1
    with pytest.raises(FlushError):  # the next save reports it, once
        ckpt.save_sync(2, state_for(2))
    later = ckpt.save_sync(3, state_for(3))
    assert later.skipped is False  # the failed capture gave its only slot back
    assert later.committed_sync("nvme", DEADLINE_S) is True
    ckpt.wait_sync()
    assert [(v.tier, v.step) for v in ckpt.versions()] == [("ram", 3), ("nvme", 3)]


# -- on_full: evict, newest_only: false, max_staleness, keep.within, keep.max_bytes ------------------


def test_on_full_evict_drops_the_waiting_snapshot_and_counts_it(tmp_path: Path, opened: Opened) -> None:
    """nvme is busy with step 2 and waits for step 4 (eligible); step 5 is not eligible, so it does
    not replace 4. With both slots taken, block would wait and skip would drop step 5: evict drops 4."""
    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = Checkpointer(
        config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme", flush={"every_steps": 2}), snapshots=2, on_full="evict"),
        tier_factory=gates,
    )
    opened.append(ckpt)
    h2 = ckpt.save_sync(2, state_for(2))
    assert gates["nvme"].started.wait(DEADLINE_S)  # step 2's slot is leased until the gate opens
    h4 = ckpt.save_sync(4, state_for(4))
    assert h4.captured_sync(DEADLINE_S) is True
    h5 = ckpt.save_sync(5, state_for(5))  # returns at once: the gate is still closed
    assert not h5.skipped
    assert h4.committed_sync("nvme", DEADLINE_S) is False  # evicted before nvme could take it
    assert h5.captured_sync(DEADLINE_S) is True
    assert h5.committed_sync("nvme", DEADLINE_S) is False  # not eligible
    counters = ckpt.counters
    assert (counters.saves, counters.skipped_saves, counters.evicted_saves) == (3, 0, 1)
    assert not committed_done(h2, "nvme")

    gates.open_all()
    assert h2.committed_sync("nvme", DEADLINE_S) is True
    ckpt.wait_sync()
    assert step_dirs(tmp_path / "nvme") == names(2)
    assert held(ckpt, "ram") == [2, 5]  # ram has no keep rule: it keeps both until a slot is needed
    restored = ckpt.restore_latest_sync()
    assert restored is not None and (restored.step, restored.tier) == (5, "ram")
    assert_bitwise(restored.state, state_for(5))


def test_on_full_evict_skips_when_only_reads_hold_the_slots(tmp_path: Path, opened: Opened) -> None:
    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme"), snapshots=1, on_full="evict"), tier_factory=gates)
    opened.append(ckpt)
    h1 = ckpt.save_sync(1, state_for(1))
    assert gates["nvme"].started.wait(DEADLINE_S)
    h2 = ckpt.save_sync(2, state_for(2))  # the only slot is being read: never wait for the disk
    assert h2.skipped
    assert (ckpt.counters.skipped_saves, ckpt.counters.evicted_saves) == (1, 0)
    gates.open_all()
    assert h1.committed_sync("nvme", DEADLINE_S) is True


def test_newest_only_false_flushes_every_eligible_version_in_order(tmp_path: Path, opened: Opened) -> None:
    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = Checkpointer(
        config(memory_tier("ram", keep={"last": 1}), fs_tier("nvme", tmp_path / "nvme", flush={"newest_only": False}), snapshots=3),
        tier_factory=gates,
    )
    opened.append(ckpt)
    handles = {1: ckpt.save_sync(1, state_for(1))}
    assert gates["nvme"].started.wait(DEADLINE_S)
    for step in (2, 3):
        handles[step] = ckpt.save_sync(step, state_for(step))
        assert handles[step].captured_sync(DEADLINE_S) is True
    # Every slot is taken (1 read, 2 and 3 queued for nvme): under block the next save waits.
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(ckpt.save_sync(4, state_for(4))))
    worker.start()
    worker.join(0.2)
    assert worker.is_alive(), "save() took a slot holding a version nvme still had to write"
    assert not any(committed_done(handles[s], "nvme") for s in (1, 2, 3))
    gates.open_all()
    worker.join(DEADLINE_S)
    assert not worker.is_alive()
    handles[4] = result[0]
    ckpt.wait_sync()
    assert all(handles[s].committed_sync("nvme", 0) is True for s in (1, 2, 3, 4))
    assert gates["nvme"].steps == [1, 2, 3, 4]
    assert ckpt.counters.passed_over.get("nvme", 0) == 0


def test_newest_only_false_under_evict_loses_the_oldest_queued_version(tmp_path: Path, opened: Opened) -> None:
    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = Checkpointer(
        config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme", flush={"newest_only": False}), snapshots=3, on_full="evict"),
        tier_factory=gates,
    )
    opened.append(ckpt)
    handles = {1: ckpt.save_sync(1, state_for(1))}
    assert gates["nvme"].started.wait(DEADLINE_S)
    for step in range(2, 7):
        handles[step] = ckpt.save_sync(step, state_for(step))
        assert handles[step].captured_sync(DEADLINE_S) is True  # as attach() would between steps
    assert ckpt.counters.evicted_saves == 3  # 2, 3 and 4 gave way to 4, 5 and 6
    gates.open_all()
    ckpt.wait_sync()
    assert {s: handles[s].committed_sync("nvme", 0) for s in handles} == {1: True, 2: False, 3: False, 4: False, 5: True, 6: True}
    assert gates["nvme"].steps == [1, 5, 6]


def test_max_staleness_sends_the_newest_version_down_when_the_tier_is_overdue(tmp_path: Path, opened: Opened) -> None:
    clock = ManualClock()
    ckpt = Checkpointer(
        config(
            memory_tier("ram", keep={"last": 1}),
            fs_tier("nvme", tmp_path / "nvme", keep={"last": 1}),
            fs_tier("pfs", tmp_path / "pfs", flush={"every_steps": 1000, "max_staleness": "10m"}),
        ),
        clock=clock,
    )
    opened.append(ckpt)
    handles = {}
    for step in (1, 2, 3):
        handles[step] = ckpt.save_sync(step, state_for(step))
        assert handles[step].committed_sync("nvme", DEADLINE_S) is True
    assert handles[2].committed_sync("pfs", DEADLINE_S) is False  # replaced as pfs's fallback by 3
    assert not committed_done(handles[3], "pfs")  # held, in case pfs falls overdue
    ckpt.wait_sync()  # not overdue yet: a drain does not force it
    assert held(ckpt, "pfs") == []
    assert held(ckpt, "nvme") == [3]  # keep last 1, and step 3 is pfs's fallback anyway

    clock.advance(601)  # ten minutes since pfs's flusher started, and nothing went down
    handles[4] = ckpt.save_sync(4, state_for(4))
    assert handles[4].committed_sync("pfs", DEADLINE_S) is True
    assert handles[3].committed_sync("pfs", 0) is False
    assert ckpt.counters.forced == {"pfs": 1}

    handles[5] = ckpt.save_sync(5, state_for(5))  # the clock restarted when step 4's flush started
    assert handles[5].committed_sync("nvme", DEADLINE_S) is True
    ckpt.wait_sync()
    assert not committed_done(handles[5], "pfs")
    clock.advance(600)
    ckpt.wait_sync()  # overdue now: wait() sends it down
    assert handles[5].committed_sync("pfs", 0) is True
    handles[6] = ckpt.save_sync(6, state_for(6))
    assert handles[6].committed_sync("nvme", DEADLINE_S) is True
    ckpt.close_sync()
    assert handles[6].committed_sync("pfs", 0) is False  # closing passes the fallback over
    assert step_dirs(tmp_path / "pfs") == names(4, 5)


@pytest.mark.parametrize("staleness", [None, "1m"])
def test_max_staleness_starts_a_flush_beside_a_running_host_copy(
    tmp_path: Path, opened: Opened, staleness: str | None
) -> None:
    """Step 2 waits for nvme while step 3 is being copied. A flush from host memory waits for the copy,
    unless nvme is overdue."""
    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    clock = ManualClock()
    flush = {} if staleness is None else {"max_staleness": staleness}
    ckpt = Checkpointer(
        config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme", flush=flush), snapshots=3, copy_threads=1),
        tier_factory=gates,
        clock=clock,
    )
    opened.append(ckpt)
    h1 = ckpt.save_sync(1, state_for(1))
    assert gates["nvme"].started.wait(DEADLINE_S)  # the flush of step 1 started at 0 s
    h2 = ckpt.save_sync(2, state_for(2))
    assert h2.captured_sync(DEADLINE_S) is True
    occupied = HeldCopies(ckpt, deadline_s=DEADLINE_S)  # step 3's copy cannot finish
    try:
        h3 = ckpt.save_sync(3, state_for(3))
        clock.advance(61)
        # The flusher's next look, once step 1 is in, sees step 3's copy running (held on the copier):
        # nvme's flusher asks at each decision, on the engine loop, and decides in that same step.
        with noticed_copy_checks(ckpt, "nvme") as looked:
            gates.open_all()
            assert h1.committed_sync("nvme", DEADLINE_S) is True
            if staleness is None:
                assert looked.wait(DEADLINE_S)
                run_on_engine(ckpt, asyncio.sleep(0))  # after the decision: it must keep waiting
                assert not committed_done(h2, "nvme")
                assert gates["nvme"].steps == [1]  # and step 2's write never started
            else:
                assert h2.committed_sync("nvme", DEADLINE_S) is True  # overdue: it did not wait for the copy
                assert not captured_done(h3)
                assert ckpt.counters.forced == {}  # step 2 was eligible: nothing was forced
    finally:
        occupied.release()  # raises if the held thread had given up waiting
    assert h3.committed_sync("nvme", DEADLINE_S) is True
    assert h2.committed_sync("nvme", DEADLINE_S) is (staleness is not None)  # else replaced by step 3
    if staleness is None:
        assert gates["nvme"].steps == [1, 3]  # it waited for step 3's copy rather than write step 2


def test_keep_within_drops_versions_older_than_the_window_on_the_injected_clock(tmp_path: Path, opened: Opened) -> None:
    clock = ManualClock()
    ckpt = Checkpointer(
        config(memory_tier("ram", keep={"within": "1h"}), fs_tier("nvme", tmp_path / "nvme", keep={"within": "1h"}), snapshots=4),
        clock=clock,
    )
    opened.append(ckpt)
    for step, at in ((1, 0.0), (2, 1000.0), (3, 4000.0), (4, 7201.0)):
        clock.now = at
        ckpt.save_sync(step, state_for(step))
        ckpt.wait_sync()
    # At 7201 s: step 2 (saved at 1000 s) is 6201 s old, step 3 (4000 s) is 3201 s old.
    assert step_dirs(tmp_path / "nvme") == names(3, 4)
    assert held(ckpt, "ram") == [3, 4]
    created = {v.step: v.created for v in ckpt.versions() if v.tier == "nvme"}
    assert created[4] - created[3] == pytest.approx(3201.0)  # creation times run on the injected clock


def test_keep_max_bytes_keeps_the_newest_versions_that_fit(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(config(memory_tier("ram", keep={"last": 1}), fs_tier("nvme", tmp_path / "nvme", keep={"max_bytes": 5000, "every_steps": 10})))
    opened.append(ckpt)
    for step in (10, 11, 12, 13):
        ckpt.save_sync(step, state_for(step))
        ckpt.wait_sync()
    sizes = {v.step: v.nbytes for v in ckpt.versions() if v.tier == "nvme"}
    assert all(2000 < n <= 2500 for n in sizes.values())  # two versions fit in 5000 bytes, three do not
    assert step_dirs(tmp_path / "nvme") == names(10, 12, 13)  # 10 by every_steps, 12 and 13 by max_bytes


def test_counters_are_a_copy(tmp_path: Path, opened: Opened) -> None:
    ckpt = Checkpointer(config(memory_tier("ram"), fs_tier("nvme", tmp_path / "nvme")))
    opened.append(ckpt)
    ckpt.save_sync(1, state_for(1))
    ckpt.wait_sync()
    counters = ckpt.counters
    counters.flushed["nvme"] = 99
    counters.forced["nvme"] = 99
    assert ckpt.counters.flushed == {"nvme": 1}
    assert ckpt.counters.forced == {}


def test_a_dropped_snapshot_is_freed_at_once_not_left_to_the_collector(opened: Opened) -> None:
    """Every save's snapshot (with its skeleton: a list a tensor) goes when host memory drops it, by
    reference counting: nothing of a save is left in a reference cycle for Python's collector, whose
    runs, on the training thread, cost more than save() itself when each save left one."""
    import gc

    ckpt = opened(config(memory_tier(keep={"last": 1}), snapshots=2))
    state = {f"w{i}": torch.full((4,), float(i)) for i in range(50)}
    ckpt.save_sync(0, state).captured_sync(30)
    ckpt.wait_sync()
    was_enabled, flags = gc.isenabled(), gc.get_debug()
    gc.collect()
    gc.disable()
    try:
        for step in range(1, 8):
            ckpt.save_sync(step, state).captured_sync(30)
        ckpt.wait_sync()  # the older snapshots are dropped by now
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
    assert "Snapshot" not in left and left.count("list") < 50, sorted(set(left))
