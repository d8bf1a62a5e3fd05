"""Saves every few milliseconds against tiers much slower than that (PCheck buffering under pressure).

Two kinds of slow storage: a gated tier (its writes wait until the test opens the gate, so "save()
did not wait for the disk" is proven by the saves finishing while the gate is still closed) and real
filesystem tiers with an injected delay (:class:`tierckpt.testing.SlowTier`) on the real clock.
Timeouts are deadlock guards only. ``benchmarks/pressure.py`` measures the same at scale.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.config import TierConfig
from tierckpt.testing import GatedTier, SlowTier
from tierckpt.testing.inspect import host_slots

from helpers import Opened

DEADLINE_S = 60.0


def state_for(step: int) -> dict[str, Any]:
    return {"w": torch.full((64, 1024), float(step)), "step": step}  # 256 KiB


def host(snapshots: int, on_full: str) -> dict[str, Any]:
    return {"capacity": f"{snapshots * 260}KiB", "snapshots": snapshots, "on_full": on_full, "copy_threads": 1}


def slot_accounting(ckpt: Checkpointer) -> tuple[int, int]:
    """(snapshots held, free slots), read on the engine thread."""
    slots = host_slots(ckpt)
    return slots.held, len(slots.free)


def run_saves(ckpt: Checkpointer, steps: range, *, barrier: bool) -> tuple[list[Any], list[float]]:
    """Save ``steps`` back to back on a worker thread; with ``barrier``, wait for each host copy first
    (what ``attach()`` does before the optimizer step). Returns the handles and each save() time."""
    handles: list[Any] = []
    times: list[float] = []
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            for step in steps:
                started = time.perf_counter()
                handle = ckpt.save_sync(step, state_for(step))
                times.append(time.perf_counter() - started)
                handles.append(handle)
                held, free = slot_accounting(ckpt)
                assert held + free == ckpt.config.host.snapshots  # host memory: the pool's slots, no more
                if barrier:
                    handle.captured_sync(DEADLINE_S)
        except BaseException as exc:  # reported on the test thread
            errors.append(exc)

    worker = threading.Thread(target=loop)
    worker.start()
    worker.join(DEADLINE_S)
    assert not worker.is_alive(), "save() waited for the slow tier"
    if errors:
        raise errors[0]
    return handles, times


@pytest.mark.parametrize("on_full", ["skip", "evict"])
def test_saves_never_wait_for_a_gated_tier_and_the_counters_say_what_was_lost(
    tmp_path: Path, opened: Opened, on_full: str
) -> None:
    """nvme takes every eligible version (newest_only: false) and its first write hangs. The 3 slots
    hold the version being written and 2 queued ones; every later save is skipped, or evicts the
    oldest queued version."""
    gated: dict[str, GatedTier] = {}

    def factory(cfg: TierConfig) -> GatedTier | None:
        if cfg.name != "nvme":
            return None
        tier = gated[cfg.name] = GatedTier(cfg, deadline_s=DEADLINE_S)
        opened.append(tier)
        return tier

    config = {
        "host": host(3, on_full),
        "tiers": [{"name": "ram", "type": "memory"}, {"name": "nvme", "type": "filesystem", "path": str(tmp_path / "nvme"), "flush": {"newest_only": False}}],
    }
    ckpt = Checkpointer(config, tier_factory=factory)
    opened.append(ckpt)
    first = ckpt.save_sync(0, state_for(0))
    assert gated["nvme"].started.wait(DEADLINE_S)
    handles, _ = run_saves(ckpt, range(1, 21), barrier=True)  # the gate stays closed throughout
    handles.insert(0, first)

    counters = ckpt.counters
    assert counters.saves == 21
    if on_full == "skip":
        assert (counters.skipped_saves, counters.evicted_saves) == (18, 0)
        assert [h.step for h in handles if not h.skipped] == [0, 1, 2]
    else:
        assert (counters.skipped_saves, counters.evicted_saves) == (0, 18)
    gated["nvme"].gate.set()
    ckpt.wait_sync()
    written = [0, 1, 2] if on_full == "skip" else [0, 19, 20]
    assert gated["nvme"].steps == written
    assert {h.step for h in handles if h.committed_sync("nvme", 0)} == set(written)
    assert ckpt.counters.passed_over.get("nvme", 0) == (0 if on_full == "skip" else 18)


def test_back_to_back_saves_under_evict_wait_at_most_for_a_copy(tmp_path: Path, opened: Opened) -> None:
    """No barrier between saves: a save may find the other slots being copied into, and then waits
    for that copy (never for the gated tier). Every save either happened or was skipped, and every
    one that happened is accounted for once the tier opens."""
    gated: list[GatedTier] = []

    def factory(cfg: TierConfig) -> GatedTier | None:
        if cfg.type != "filesystem":
            return None
        gated.append(GatedTier(cfg, deadline_s=DEADLINE_S))
        opened.append(gated[-1])
        return gated[-1]

    config = {"host": host(2, "evict"), "tiers": [{"name": "ram", "type": "memory"}, {"name": "nvme", "type": "filesystem", "path": str(tmp_path / "nvme")}]}
    ckpt = Checkpointer(config, tier_factory=factory)
    opened.append(ckpt)
    handles, _ = run_saves(ckpt, range(40), barrier=False)
    gated[0].gate.set()
    ckpt.wait_sync()
    counters = ckpt.counters
    assert counters.saves == 40
    done = [h for h in handles if not h.skipped]
    assert len(done) == 40 - counters.skipped_saves
    results = [h.committed_sync("nvme", 0) for h in done]
    assert results[-1] is True  # the newest save reached the tier
    assert sum(results) == counters.flushed["nvme"] == len(gated[0].steps)
    assert gated[0].steps == sorted(gated[0].steps)  # newest only: never backwards
    restored = ckpt.restore_latest_sync()
    assert restored is not None and restored.step == done[-1].step
    assert torch.equal(restored.state["w"], state_for(done[-1].step)["w"])


def test_the_newest_version_reaches_a_slow_real_filesystem_tier_within_max_staleness(tmp_path: Path, opened: Opened) -> None:
    """ram → nvme (each write 30 ms longer) → pfs (each write 400 ms longer, every_steps so large that
    only max_staleness sends anything down). 40 saves 5 ms apart; after the last one nobody calls
    wait(): the last version must still reach pfs, forced by max_staleness."""
    delays = {"nvme": 0.03, "pfs": 0.4}
    max_staleness = 0.3

    def factory(cfg: TierConfig) -> SlowTier | None:
        return SlowTier(cfg, delays[cfg.name]) if cfg.name in delays else None

    config = {
        # Three slots: the two flushes read at most two, so the last save always gets one. With two, a
        # save that comes while both read is skipped under evict (policy.choose_slot), as a loaded CI
        # machine showed: the last save then never reaches pfs.
        "host": host(3, "evict"),
        "tiers": [
            {"name": "ram", "type": "memory", "keep": {"last": 1}},
            {"name": "nvme", "type": "filesystem", "path": str(tmp_path / "nvme"), "keep": {"last": 2}},
            {
                "name": "pfs",
                "type": "filesystem",
                "path": str(tmp_path / "pfs"),
                "flush": {"every_steps": 10**9, "max_staleness": max_staleness},
                "keep": {"last": 2},
            },
        ],
    }
    ckpt = Checkpointer(config, tier_factory=factory)
    opened.append(ckpt)
    times = []
    for step in range(1, 41):
        started = time.perf_counter()
        handle = ckpt.save_sync(step, state_for(step))
        times.append(time.perf_counter() - started)
        time.sleep(0.005)  # pacing, not synchronisation: the training step between saves
    last_saved = time.perf_counter()
    assert handle.committed_sync("pfs", DEADLINE_S) is True
    reached = time.perf_counter() - last_saved
    counters = ckpt.counters
    assert counters.forced["pfs"] >= 1
    assert counters.flushed["pfs"] == counters.forced["pfs"]  # nothing was eligible: all forced
    assert [v.step for v in ckpt.versions() if v.tier == "pfs"][-1] == 40
    # Bounded by max_staleness plus the writes in the way (a pfs write in progress, nvme's, then its
    # own); the slack only absorbs a loaded machine.
    assert reached < max_staleness + delays["nvme"] + 2 * delays["pfs"] + 5.0
    assert max(times) < delays["pfs"]  # no save waited for a pfs write
    held, free = slot_accounting(ckpt)
    assert held + free == 3
