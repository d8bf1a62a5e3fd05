"""Who starts a save's copies (:class:`tierckpt.pipeline.saves.Handoff`): the saving thread once it
has its handle, or the engine when the caller stopped waiting first. Either way, exactly once."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.capture import Copier
from tierckpt.pipeline.saves import Handoff

from helpers import assert_bitwise, small_state, tier_config, until

DEADLINE_S = 30.0  # a deadlock guard only


def test_the_side_that_comes_second_starts_the_copies_once() -> None:
    runs: list[str] = []
    engine_first = Handoff()
    engine_first.admitted(lambda: runs.append("a"))
    assert runs == []  # the caller has not come yet: it starts them
    engine_first.caller_done()
    assert runs == ["a"]
    engine_first.caller_done()  # a second call finds nothing left to start
    assert runs == ["a"]

    caller_first = Handoff()
    caller_first.caller_done()  # stopped waiting before the save was admitted
    caller_first.admitted(lambda: runs.append("b"))  # the engine starts them itself
    assert runs == ["a", "b"]

    never_admitted = Handoff()  # e.g. cancelled while waiting for a slot: nothing to start
    never_admitted.caller_done()
    assert runs == ["a", "b"]


def test_save_sync_starts_its_copies_on_the_saving_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    started_on: list[threading.Thread] = []
    real_start = Copier.start

    def start(self: Copier, *args: Any) -> None:
        started_on.append(threading.current_thread())
        real_start(self, *args)

    monkeypatch.setattr(Copier, "start", start)
    with Checkpointer(tier_config()) as ckpt:
        state = small_state(1)
        handle = ckpt.save_sync(1, state)
        assert handle.captured_sync(DEADLINE_S) is True
        assert started_on == [threading.current_thread()]
        assert_bitwise(ckpt.restore_latest_sync(small_state(0)).state, state)


def test_an_admitted_save_whose_caller_was_cancelled_is_still_captured_and_committed() -> None:
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 7}

    async def main(ckpt: Checkpointer) -> None:
        task = asyncio.create_task(ckpt.save(7, state))
        await asyncio.sleep(0)  # the task runs up to its wait for the engine
        # Blocks this loop, so the task cannot resume: the engine admits the save meanwhile.
        assert until(lambda: ckpt.counters.saves == 1, DEADLINE_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Its copies were started all the same (by the caller's cancelled await, or by the engine):
        # else this wait for every capture and flush would never end.
        await asyncio.wait_for(ckpt.wait(), DEADLINE_S)

    with Checkpointer(tier_config()) as ckpt:
        asyncio.run(main(ckpt))
        restored = ckpt.restore_latest_sync({"w": torch.zeros(4096), "step": 0})
        assert restored.step == 7
        assert_bitwise(restored.state, state)
