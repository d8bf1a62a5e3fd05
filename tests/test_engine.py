"""The engine thread: flushing progresses on the library's own loop, whatever the caller's thread does.

The public API is reached from a pytest-asyncio loop, from other loops, and from plain threads.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tierckpt import Checkpointer, TierckptError
from tierckpt.errors import ClosedError
from tierckpt.testing import slow
from tierckpt.testing.copies import HeldCopies
from tierckpt.testing.inspect import committed_done, engine_loop, engine_thread, save_number, settled

from helpers import assert_bitwise, fs_tier, held, small_state, tier_config

DEADLINE_S = 30.0  # a deadlock guard only: every wait below ends on an event long before it


def make_config(tmp_path: Path, **host: Any) -> dict[str, Any]:
    return tier_config(fs_tier("nvme", tmp_path / "nvme"), **host)


def manifest_of(tmp_path: Path, step: int, tier: str = "nvme") -> Path:
    return tmp_path / tier / f"step-{step:012d}" / "manifest.msgpack"




def run_in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a new plain thread; return its result or re-raise its exception here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(DEADLINE_S * 2)
    assert not thread.is_alive(), "the worker thread deadlocked"
    if "error" in box:
        raise box["error"]
    return box["result"]


# -- flushing while the caller never yields --------------------------------------------------------


@pytest.mark.parametrize("compute", ["torch", "python"])
def test_flush_completes_while_the_caller_spins_in_a_compute_loop(tmp_path: Path, compute: str) -> None:
    ckpt = Checkpointer(make_config(tmp_path))
    try:
        handle = ckpt.save_sync(1, small_state(1))
        manifest = manifest_of(tmp_path, 1)
        x = torch.randn(48, 48)
        acc = 0
        deadline = time.monotonic() + DEADLINE_S
        # Plain synchronous compute: no wait(), no await, no event loop on this thread. Only a poll of
        # the file system, which the engine thread must fill on its own.
        while not os.path.exists(manifest) and time.monotonic() < deadline:
            if compute == "torch":
                x = torch.tanh(x @ x.T) + 0.5
            else:
                acc = (acc * 31 + 7) % 1_000_003
        assert os.path.exists(manifest), "the flush did not progress while the caller computed"
        assert handle.committed_sync("nvme", DEADLINE_S) is True
    finally:
        ckpt.close_sync()


# -- the async API from pytest-asyncio's loop --------------------------------------------------------


async def test_async_api_from_the_test_loop(tmp_path: Path) -> None:
    state = small_state(3)
    async with Checkpointer(make_config(tmp_path)) as ckpt:
        assert asyncio.get_running_loop() is not engine_loop(ckpt)
        handle = await ckpt.save(3, state, metadata={"epoch": 2})
        assert handle.step == 3 and not handle.skipped
        assert await handle.captured() is True
        assert await handle.committed("ram") is True
        assert await handle.committed("nvme") is True
        await ckpt.wait()
        restored = await ckpt.restore_latest()
        assert restored is not None
        assert (restored.step, restored.tier, restored.metadata) == (3, "ram", {"epoch": 2})
        assert_bitwise(restored.state, state)
        with pytest.raises(KeyError, match="no tier named 'tape'"):
            await handle.committed("tape")
    assert manifest_of(tmp_path, 3).exists()
    assert not engine_thread(ckpt).is_alive()
    with pytest.raises(ClosedError):
        await ckpt.save(4, state)


async def test_awaiting_a_slow_flush_leaves_the_callers_loop_free(tmp_path: Path) -> None:
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    ckpt = Checkpointer(make_config(tmp_path), tier_factory=slow({"nvme": 0.2}))
    try:
        handle = await ckpt.save(1, small_state(1))
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        assert await asyncio.wait_for(handle.committed("nvme"), DEADLINE_S) is True
        # The 0.2 s flush was awaited, not blocked on: the loop kept running the ticker meanwhile.
        assert ticks > before + 1
        stop.set()
        await task
    finally:
        await ckpt.close()


async def test_close_drains_then_everything_raises_closed(tmp_path: Path) -> None:
    ckpt = Checkpointer(make_config(tmp_path), tier_factory=slow({"nvme": 0.2}))
    handle = await ckpt.save(1, small_state(1))
    await ckpt.close()
    assert committed_done(handle, "nvme")
    assert await handle.committed("nvme") is True
    assert manifest_of(tmp_path, 1).exists()
    await ckpt.close()  # a second close does nothing
    ckpt.close_sync()
    for call in (lambda: ckpt.save(2, {}), ckpt.wait, ckpt.restore_latest):
        with pytest.raises(ClosedError):
            await call()
    for sync_call in (lambda: ckpt.save_sync(2, {}), ckpt.wait_sync, ckpt.restore_latest_sync, ckpt.versions):
        with pytest.raises(ClosedError) as info:
            sync_call()
        assert isinstance(info.value, TierckptError) and isinstance(info.value, RuntimeError)


async def test_async_api_from_a_second_loop_on_another_thread(tmp_path: Path) -> None:
    state = small_state(5)
    async with Checkpointer(make_config(tmp_path)) as ckpt:

        async def elsewhere() -> tuple[bool, int]:
            handle = await ckpt.save(5, state)
            committed = await handle.committed("nvme")
            await ckpt.wait()
            restored = await ckpt.restore_latest()
            assert restored is not None
            assert_bitwise(restored.state, state)
            return committed, restored.step

        # asyncio.run on a plain thread: a loop that is neither the engine's nor this test's.
        assert await asyncio.to_thread(run_in_thread, lambda: asyncio.run(elsewhere())) == (True, 5)
        # ... and this loop still works with the same Checkpointer afterwards.
        handle = await ckpt.save(6, small_state(6))
        assert await handle.committed("nvme") is True


async def test_a_timed_out_await_does_not_cancel_the_save(tmp_path: Path) -> None:
    # wait_for cancels what it awaits on timeout; that must not cancel the save's capture or flush.
    async with Checkpointer(make_config(tmp_path, copy_threads=1)) as ckpt:
        occupied = HeldCopies(ckpt, deadline_s=DEADLINE_S)  # the copy cannot start yet
        try:
            handle = await ckpt.save(1, small_state(1))
            for waiter in (handle.captured(), handle.committed("nvme"), ckpt.wait()):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(waiter, 0.05)
        finally:
            occupied.release()  # raises if the held thread had given up waiting
        assert await asyncio.wait_for(handle.captured(), DEADLINE_S) is True
        assert await asyncio.wait_for(handle.committed("nvme"), DEADLINE_S) is True
        await asyncio.wait_for(ckpt.wait(), DEADLINE_S)
        assert [(v.tier, v.step) for v in ckpt.versions()] == [("ram", 1), ("nvme", 1)]
        # The slot came back: the next saves go through too.
        for step in (2, 3):
            later = await ckpt.save(step, small_state(step))
            assert await asyncio.wait_for(later.committed("nvme"), DEADLINE_S) is True


# -- the sync twins from plain threads ---------------------------------------------------------------


def test_sync_twins_from_a_plain_thread(tmp_path: Path) -> None:
    state = small_state(7)

    def work() -> Any:
        with Checkpointer(make_config(tmp_path)) as ckpt:
            handle = ckpt.save_sync(7, state, metadata={"who": "worker"})
            assert handle.captured_sync(DEADLINE_S) is True
            assert handle.committed_sync("nvme", DEADLINE_S) is True
            ckpt.wait_sync()
            restored = ckpt.restore_latest_sync()
            return restored, [(v.tier, v.step) for v in ckpt.versions()]

    restored, versions = run_in_thread(work)
    assert versions == [("ram", 7), ("nvme", 7)]
    assert (restored.step, restored.tier, restored.metadata) == (7, "ram", {"who": "worker"})
    assert_bitwise(restored.state, state)


def test_calls_from_two_threads_in_turn(tmp_path: Path) -> None:
    ckpt = Checkpointer(make_config(tmp_path))
    first_done = threading.Event()
    try:

        def thread_a() -> Any:
            handle = ckpt.save_sync(1, small_state(1))
            committed = handle.committed_sync("nvme", DEADLINE_S)
            first_done.set()
            return committed

        def thread_b() -> Any:
            assert first_done.wait(DEADLINE_S)
            handle = ckpt.save_sync(2, small_state(2))
            committed = handle.committed_sync("nvme", DEADLINE_S)
            ckpt.wait_sync()
            return committed, ckpt.restore_latest_sync()

        threads: dict[str, Any] = {}
        a = threading.Thread(target=lambda: threads.__setitem__("a", thread_a()))
        a.start()
        threads["b"] = run_in_thread(thread_b)
        a.join(DEADLINE_S)
        assert threads["a"] is True
        committed_b, restored = threads["b"]
        assert committed_b is True
        assert restored.step == 2
        assert_bitwise(restored.state, small_state(2))
        assert sorted(held(ckpt, "nvme")) == [1, 2]
    finally:
        ckpt.close_sync()


def test_saves_from_two_threads_at_once(tmp_path: Path) -> None:
    ckpt = Checkpointer(make_config(tmp_path, snapshots=3))
    barrier = threading.Barrier(2, timeout=DEADLINE_S)
    handles: dict[int, Any] = {}
    errors: list[BaseException] = []

    def saver(step: int) -> None:
        try:
            barrier.wait()
            handles[step] = ckpt.save_sync(step, small_state(step))
            handles[step].captured_sync(DEADLINE_S)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=saver, args=(step,)) for step in (10, 20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        assert not errors and sorted(handles) == [10, 20]
        ckpt.wait_sync()
        for handle in handles.values():
            assert handle.captured_sync(0) is True
            assert settled(handle)  # every tier decided: no save left hanging
        assert sorted(held(ckpt, "ram")) == [10, 20]
        # The save that came last (whichever thread that was) is latest: saves are ordered by their
        # call, and 10 saved after 20 goes back (docs/index.md, "Rolling back"). nvme holds it, intact.
        newest = max(handles.values(), key=save_number)
        restored = ckpt.restore_latest_sync()
        assert restored is not None and restored.step == newest.step
        assert_bitwise(restored.state, small_state(newest.step))
        on_nvme = held(ckpt, "nvme")
        assert len(on_nvme) >= 1 and set(on_nvme) <= {10, 20}
        assert newest.committed_sync("nvme", 0) is True
    finally:
        ckpt.close_sync()


# -- closing -------------------------------------------------------------------------------------------


def test_with_block_closes_and_drains(tmp_path: Path) -> None:
    with Checkpointer(make_config(tmp_path), tier_factory=slow({"nvme": 0.3})) as ckpt:
        handle = ckpt.save_sync(1, small_state(1))
        engine = engine_thread(ckpt)
    # Leaving the block drained the 0.3 s flush before stopping.
    assert committed_done(handle, "nvme")
    assert handle.committed_sync("nvme", 0) is True
    assert manifest_of(tmp_path, 1).exists()
    assert not engine.is_alive()
    with pytest.raises(ClosedError):
        ckpt.save_sync(2, small_state(2))
    with pytest.raises(ClosedError):
        ckpt.versions()
    # What the block flushed is there for the next process.
    with Checkpointer(make_config(tmp_path)) as again:
        restored = again.restore_latest_sync()
    assert restored is not None and (restored.step, restored.tier) == (1, "nvme")
    assert_bitwise(restored.state, small_state(1))


def test_with_block_closes_on_an_exception(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError):
        with Checkpointer(make_config(tmp_path), tier_factory=slow({"nvme": 0.2})) as ckpt:
            handle = ckpt.save_sync(1, small_state(1))
            1 / 0
    assert handle.committed_sync("nvme", 0) is True
    with pytest.raises(ClosedError):
        ckpt.wait_sync()
