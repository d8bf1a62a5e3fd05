"""How large the host pool is: ``host.capacity`` when set; sized to the state at the first save when not,
and mapped again, larger, for a save that does not fit (tierckpt.capture.pool).

The sizes are read from the pool (``capacity_bytes``, its slots), not from the process's RSS: what the
pool maps is what the pool says, and RSS depends on everything else the process does.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt.capture.pool
import tierckpt.runtime
from tierckpt import CapacityError
from tierckpt.capture import HostPool
from tierckpt.capture.pool import sized_slot
from tierckpt.testing import Gates
from tierckpt.testing.inspect import host_pool

from helpers import Opened, assert_bitwise, fs_tier, memory_tier, tier_config

DEADLINE_S = 60
KiB, MiB = 1 << 10, 1 << 20


def unset(tmp_path: Path, **ram: Any) -> dict[str, Any]:
    """A config without a host section: host memory above a filesystem tier "nvme"."""
    return {"tiers": [memory_tier(**ram), fs_tier("nvme", tmp_path / "nvme")]}


def floats(nbytes: int, value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((nbytes // 4,), value)}


def test_sized_slots_hold_the_state_and_an_eighth_in_64kib_steps_up_to_the_limit() -> None:
    assert sized_slot(40, 2, 1 << 30) == 64 * KiB
    assert sized_slot(0, 2, 1 << 30) == 64 * KiB  # a state of no tensors still gets a slot
    assert sized_slot(100 * MiB, 2, 1 << 30) == 112.5 * MiB
    assert sized_slot(500 * MiB, 2, 1 << 30) == 512 * MiB  # an eighth more would pass the limit: up to it
    assert sized_slot(513 * MiB, 2, 1 << 30) is None


def test_without_host_capacity_nothing_is_mapped_before_the_first_save_and_then_what_the_state_needs(
    tmp_path: Path, opened: Opened, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = opened(unset(tmp_path))
    pool = host_pool(ckpt)
    assert ckpt.config.host.capacity_bytes is None
    assert (pool.capacity_bytes, pool.slots) == (0, ())
    assert ckpt.restore_latest_sync() is None  # a restore before any save needs no pool
    state = {"w": torch.arange(10, dtype=torch.float32)}  # 40 bytes
    with caplog.at_level(logging.INFO, logger="tierckpt"):
        assert ckpt.save_sync(1, state).committed_sync("nvme", DEADLINE_S)
    assert pool.capacity_bytes == 2 * 64 * KiB  # two slots of 64 KiB, not 1 GiB
    assert [s.size for s in pool.slots] == [64 * KiB] * 2
    said = [r.getMessage() for r in caplog.records if "host pool sized" in r.getMessage()]
    assert said == ["host pool sized to step 1's state of 4KiB: 2 slot(s) of 64KiB (128KiB) mapped (host.capacity is not set)"], said
    restored = ckpt.restore_latest_sync()
    assert (restored.step, restored.tier) == (1, "ram")
    assert_bitwise(restored.state, state)
    assert ckpt.save_sync(2, {"w": torch.arange(1000, dtype=torch.float32)}).committed_sync("nvme", DEADLINE_S)
    assert pool.capacity_bytes == 2 * 64 * KiB  # it fits: the same slots


def test_a_larger_save_maps_larger_slots_and_the_old_ones_go_with_their_last_snapshot(tmp_path: Path, opened: Opened) -> None:
    gates = Gates("nvme", deadline_s=DEADLINE_S)
    opened.append(gates)
    ckpt = opened(unset(tmp_path, keep={"last": 1}), tier_factory=gates)
    pool = host_pool(ckpt)
    small, large = floats(40), floats(MiB, 2.0)
    h1 = ckpt.save_sync(1, small)
    assert gates["nvme"].started.wait(DEADLINE_S)  # step 1's flush holds its slot of the first slots
    first = pool.capacity_bytes
    h2 = ckpt.save_sync(2, large)
    assert h2.captured_sync(DEADLINE_S)
    slot = pool.slots[0].size
    assert slot == sized_slot(MiB, 2, pool.limit_bytes) and [s.size for s in pool.slots] == [slot] * 2
    assert pool.capacity_bytes == first + 2 * slot  # the first slots stay while step 1 is held
    assert_bitwise(ckpt.restore_sync(2).state, large)
    gates.open_all()
    assert h1.committed_sync("nvme", DEADLINE_S) and h2.committed_sync("nvme", DEADLINE_S)
    ckpt.wait_sync()
    deadline = time.monotonic() + DEADLINE_S
    while pool.capacity_bytes != 2 * slot and time.monotonic() < deadline:
        time.sleep(0.01)  # step 1 is dropped (keep: last 1) once flushed: its slots are unmapped then
    assert pool.capacity_bytes == 2 * slot
    assert ckpt.save_sync(3, small).committed_sync("nvme", DEADLINE_S)  # smaller again: the same slots
    assert pool.capacity_bytes == 2 * slot
    assert_bitwise(ckpt.restore_sync(1).state, small)  # from nvme
    assert_bitwise(ckpt.restore_sync(2).state, large)
    restored = ckpt.restore_latest_sync()
    assert (restored.step, restored.tier) == (3, "ram")
    assert_bitwise(restored.state, small)


def test_a_save_needing_a_slot_drops_snapshots_of_the_old_slots_first_and_unmaps_them(tmp_path: Path, opened: Opened) -> None:
    ckpt = opened(unset(tmp_path))  # the memory tier keeps what it holds until a save needs its slot
    pool = host_pool(ckpt)
    for step in (1, 2):
        assert ckpt.save_sync(step, floats(40, step)).committed_sync("nvme", DEADLINE_S)
    first = pool.capacity_bytes
    for step in (3, 4):  # larger: the new slots; steps 1 and 2 stay in the old ones
        assert ckpt.save_sync(step, floats(MiB, step)).committed_sync("nvme", DEADLINE_S)
    assert pool.capacity_bytes == first + 2 * pool.slots[0].size
    assert [v.step for v in ckpt.versions() if v.tier == "ram"] == [1, 2, 3, 4]
    # No slot free: the oldest snapshots give way, steps 1 and 2, whose slots are not reused but
    # unmapped, then step 3, whose slot step 5 takes.
    assert ckpt.save_sync(5, floats(MiB, 5)).committed_sync("nvme", DEADLINE_S)
    assert [v.step for v in ckpt.versions() if v.tier == "ram"] == [4, 5]
    assert pool.capacity_bytes == 2 * pool.slots[0].size
    for step in (1, 3, 5):
        assert_bitwise(ckpt.restore_sync(step).state, floats(40 if step < 3 else MiB, step))


def test_a_state_past_the_limit_is_a_capacity_error_naming_host_capacity_and_training_goes_on(
    tmp_path: Path, opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tierckpt.capture.pool, "half_of_memory", lambda: 2 * MiB)
    ckpt = opened(unset(tmp_path))
    pool = host_pool(ckpt)
    assert pool.limit_bytes == 2 * MiB
    with pytest.raises(CapacityError) as caught:
        ckpt.save_sync(1, floats(2 * MiB))
    assert caught.value.key == "host.capacity" and caught.value.step == 1
    assert str(caught.value) == (
        "step 1: the state needs 2MiB of host memory; a host pool sized to it would map 4MiB (host.snapshots 2), "
        "more than the 2MiB a pool maps unless told (half of this host's memory); set host.capacity to what this "
        "process may use, or lower host.snapshots"
    )
    assert pool.capacity_bytes == 0
    assert ckpt.save_sync(2, floats(MiB // 2)).committed_sync("nvme", DEADLINE_S)  # the next save is taken as usual
    assert pool.capacity_bytes == 2 * 576 * KiB  # 512 KiB and an eighth, twice: under the limit
    ckpt.save_sync(3, floats(900 * KiB)).committed_sync("nvme", DEADLINE_S)
    assert [s.size for s in pool.slots] == [MiB] * 2  # an eighth more would pass the limit: up to it


def test_an_explicit_capacity_is_mapped_at_construction_and_never_grows(tmp_path: Path, opened: Opened) -> None:
    ckpt = opened(tier_config(fs_tier("nvme", tmp_path / "nvme"), capacity="8MiB", snapshots=2))
    pool = host_pool(ckpt)
    assert (pool.capacity_bytes, [s.size for s in pool.slots], pool.slot_size) == (8 * MiB, [4 * MiB] * 2, 4 * MiB)
    assert ckpt.save_sync(1, floats(40)).committed_sync("nvme", DEADLINE_S)
    with pytest.raises(CapacityError, match=r"one slot holds 4MiB \(host.capacity 8MiB / host.snapshots 2\); raise host.capacity to at least 12MiB"):
        ckpt.save_sync(2, floats(6 * MiB))
    assert pool.capacity_bytes == 8 * MiB and [s.size for s in pool.slots] == [4 * MiB] * 2


def test_a_memory_tier_with_a_path_keeps_a_fixed_pool_without_host_capacity(
    tmp_path: Path, opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tierckpt.runtime, "FILE_POOL_BYTES", 2 * MiB)  # 1 GiB, as before pools followed the state
    ckpt = opened(unset(tmp_path, path=str(tmp_path / "ram")))
    pool = host_pool(ckpt)
    assert pool.capacity_bytes == 2 * MiB  # mapped at construction: the next process maps the same file
    assert ckpt.save_sync(1, floats(40)).committed_sync("ram", DEADLINE_S)
    with pytest.raises(CapacityError, match=r"host.capacity is not set, and the memory tier's pool file \(tiers\[0\].path\)") as caught:
        ckpt.save_sync(2, floats(2 * MiB))
    assert caught.value.key == "host.capacity" and "set host.capacity to at least 4MiB" in str(caught.value)
    assert pool.capacity_bytes == 2 * MiB


def test_the_pool_unmaps_a_generation_when_its_last_slot_comes_back() -> None:
    pool = HostPool(None, 2, limit_bytes=64 * MiB)
    try:
        assert not pool.configured and pool.fit(5 * MiB, 1) is not None
        first = pool.slots
        assert pool.fit(4 * MiB, 2) is None  # fits
        second = pool.fit(20 * MiB, 3)
        assert second == pool.slots and second[0].size == sized_slot(20 * MiB, 2, 64 * MiB)
        size = 2 * second[0].size
        pool.view(first[0], 0, 4)[:] = b"keep"  # an older slot's bytes stay while it is held
        assert pool.release(first[1]) is False and pool.capacity_bytes == 2 * first[0].size + size
        assert bytes(pool.view(first[0], 0, 4)) == b"keep"
        with pytest.raises(ValueError, match="not a run of adjacent slots"):
            pool.span([first[0], second[1]])
        assert pool.release(first[0]) is False and pool.capacity_bytes == size  # the last of them: unmapped
        assert pool.release(second[0]) is True  # the newest: to be used again
        with pytest.raises(CapacityError, match="set host.capacity"):
            pool.fit(40 * MiB, 4)
    finally:
        pool.close()
