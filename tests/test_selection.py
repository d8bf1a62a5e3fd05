"""Selection per tier: every tier gets the versions its own flush policy selects on the stream of saves.

Before, a tier was offered only what the tier above it committed, so a busy (or failing) tier above
decided what every tier below could ever get: with nvme taking the newest save each time it was free,
pfs's ``every_steps: 50`` steps were almost never the newest at that moment and pfs starved. These
tests pin the new rule with gated tiers (writes end when the test says) and, last, on real disks with
the configuration that showed the defect. ``tests/test_selection_chains.py`` is the property test.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, FlushError
from tierckpt.policy import flush_eligible
from tierckpt.testing import Gates, faulty
from tierckpt.testing.inspect import committed_done, committed_saves, save_number

from helpers import Opened, fs_tier, memory_tier, tier_config

DEADLINE_S = 60.0  # a deadlock guard only


def config(*tiers: dict[str, Any], snapshots: int, on_full: str = "block", slot_kib: int = 64) -> dict[str, Any]:
    ram = memory_tier(keep={"last": 1})
    return tier_config(*tiers, capacity=f"{snapshots * slot_kib}KiB", snapshots=snapshots, on_full=on_full, ram=ram)


def state_for(step: int) -> dict[str, Any]:
    return {"w": torch.full((1024,), float(step)), "b": torch.arange(step, step + 64), "step": step}


def assert_holds(root: Path, step: int, scratch: Path, want: dict[str, Any] | None = None) -> None:
    """The version directory of ``step`` under ``root``, restored on its own, holds ``want`` (by default
    ``state_for(step)``) bit for bit."""
    want = state_for(step) if want is None else want
    isolated = scratch / f"only-{root.name}-{step}"
    name = f"step-{step:012d}"
    shutil.copytree(root / name, isolated / name)
    with Checkpointer(config(fs_tier("only", isolated), snapshots=1, slot_kib=4096)) as ckpt:
        restored = ckpt.restore_latest_sync()
    assert restored is not None and restored.step == step
    assert restored.state["step"] == step
    for key in ("w", "b"):
        got = restored.state[key]
        assert got.dtype == want[key].dtype and torch.equal(got, want[key]), (root, step, key)


def outcome(handle: Any, tier: str) -> bool | str:
    """What ``handle.committed(tier)`` resolved to: True, False, or "failed" (it raised a FlushError)."""
    try:
        return handle.committed_sync(tier, 0)
    except FlushError:
        return "failed"


CLOSE_TOLERATES = (FlushError,)  # for the opened fixture: the test failed already, or expects it


def test_a_tier_below_gets_what_it_selects_while_the_tier_above_is_stuck(tmp_path: Path, opened: Opened) -> None:
    """nvme is stuck on its first write for the whole run; pfs (every_steps 5) still receives every
    version it selects, read from host memory. Before, pfs received nothing: nvme committed nothing."""
    g = Gates("nvme", deadline_s=DEADLINE_S)
    cfg = config(fs_tier("nvme", tmp_path / "nvme"), fs_tier("pfs", tmp_path / "pfs", flush={"every_steps": 5}), snapshots=3, on_full="skip")
    ckpt = opened(cfg, tier_factory=g)
    handles = {1: ckpt.save_sync(1, state_for(1))}
    assert g["nvme"].started.wait(DEADLINE_S)
    for step in range(2, 24):
        ckpt.wait_captured()  # the lazy barrier of a training loop: one host copy at a time
        handles[step] = ckpt.save_sync(step, state_for(step))
        if step % 5 == 0:  # pfs writes each version it selects before the next one arrives
            assert handles[step].committed_sync("pfs", DEADLINE_S) is True, step
    assert ckpt.counters.skipped_saves == 0  # 3 slots: nvme's read, nvme's newest, the next save's
    assert g["nvme"].steps == [1]  # still writing step 1
    assert [v.step for v in ckpt.versions() if v.tier == "pfs"] == [5, 10, 15, 20]
    assert [v.step for v in ckpt.versions() if v.tier == "nvme"] == []
    assert handles[22].captured_sync(DEADLINE_S) and handles[23].captured_sync(DEADLINE_S)
    for step in range(2, 23):  # nvme passed over what a newer save replaced while it was stuck
        assert handles[step].committed_sync("nvme", DEADLINE_S) is False, step
    g["nvme"].gate.set()
    ckpt.wait_sync()
    assert handles[1].committed_sync("nvme", 0) is True and handles[23].committed_sync("nvme", 0) is True
    assert ckpt.counters.flushed == {"nvme": 2, "pfs": 4}
    ckpt.close_sync()
    for step in (5, 10, 15, 20):
        assert_holds(tmp_path / "pfs", step, tmp_path)


def test_a_failing_tier_above_fails_only_its_own_handles(tmp_path: Path, opened: Opened) -> None:
    cfg = config(fs_tier("nvme", tmp_path / "nvme"), fs_tier("pfs", tmp_path / "pfs", flush={"every_steps": 2}), snapshots=3)
    ckpt = opened(cfg, tier_factory=faulty({"nvme": lambda step: True}))
    handles = {}
    for step in range(1, 7):
        handles[step] = ckpt.save_sync(step, state_for(step))
        if step % 2 == 0:  # pfs writes each version it selects before the next one arrives
            assert handles[step].committed_sync("pfs", DEADLINE_S) is True, step
    with pytest.raises(FlushError, match="nvme"):
        ckpt.wait_sync()  # nvme committed nothing: wait() reports it once
    for step, handle in handles.items():
        assert outcome(handle, "nvme") in (False, "failed"), step  # failed, or passed over while nvme was busy
        assert outcome(handle, "pfs") is (step % 2 == 0), step
    assert "failed" in [outcome(h, "nvme") for h in handles.values()]
    assert [v.step for v in ckpt.versions() if v.tier == "pfs"] == [2, 4, 6]
    ckpt.close_sync()
    for step in (2, 4, 6):
        assert_holds(tmp_path / "pfs", step, tmp_path)


def test_a_selected_version_only_host_memory_holds_is_kept_for_its_tier(tmp_path: Path, opened: Opened) -> None:
    """pfs (every_steps 2) is busy writing step 2 when step 4 arrives; nvme (every_steps 3) never takes
    4, so only host memory holds it. With 2 slots (step 2's being read, step 4's) the next save is
    skipped rather than lose step 4 for pfs; pfs then writes it, with its own bytes."""
    g = Gates("pfs", deadline_s=DEADLINE_S)
    cfg = config(
        fs_tier("nvme", tmp_path / "nvme", flush={"every_steps": 3}),
        fs_tier("pfs", tmp_path / "pfs", flush={"every_steps": 2}),
        snapshots=2,
        on_full="skip",
    )
    ckpt = opened(cfg, tier_factory=g)
    h2 = ckpt.save_sync(2, state_for(2))
    assert g["pfs"].started.wait(DEADLINE_S)
    h4 = ckpt.save_sync(4, state_for(4))
    assert h4.captured_sync(DEADLINE_S) is True
    h5 = ckpt.save_sync(5, state_for(5))
    assert h5.skipped
    assert not committed_done(h4, "pfs")  # still pfs's: waiting in host memory
    g["pfs"].gate.set()
    assert h2.committed_sync("pfs", DEADLINE_S) is True
    assert h4.committed_sync("pfs", DEADLINE_S) is True
    assert g["pfs"].sources == ["ram", "ram"]
    h6 = ckpt.save_sync(6, state_for(6))  # slots free again: nvme and pfs both select 6
    assert h6.committed_sync("nvme", DEADLINE_S) is True and h6.committed_sync("pfs", DEADLINE_S) is True
    ckpt.close_sync()
    for step in (2, 4, 6):
        assert_holds(tmp_path / "pfs", step, tmp_path)


def test_a_version_a_tier_above_holds_gives_its_slot_to_a_new_save(tmp_path: Path, opened: Opened) -> None:
    """Like the test above, but nvme (every 1) committed step 4: host memory lets step 4 go for the next
    save instead of skipping it, and pfs reads step 4 from nvme, whose retention (keep last 1) spares
    it until pfs has it."""
    g = Gates("pfs", deadline_s=DEADLINE_S)
    cfg = config(
        fs_tier("nvme", tmp_path / "nvme", keep={"last": 1}),
        fs_tier("pfs", tmp_path / "pfs", flush={"every_steps": 2}),
        snapshots=2,
        on_full="skip",
    )
    ckpt = opened(cfg, tier_factory=g)
    ckpt.save_sync(2, state_for(2))
    assert g["pfs"].started.wait(DEADLINE_S)
    h4 = ckpt.save_sync(4, state_for(4))
    assert h4.committed_sync("nvme", DEADLINE_S) is True
    h5 = ckpt.save_sync(5, state_for(5))
    assert not h5.skipped
    assert h5.committed_sync("nvme", DEADLINE_S) is True
    assert [v.step for v in ckpt.versions() if v.tier == "nvme"] == [2, 4, 5]  # keep last 1; pfs writes 2, waits for 4
    g["pfs"].gate.set()
    assert h4.committed_sync("pfs", DEADLINE_S) is True
    ckpt.wait_sync()
    assert g["pfs"].sources == ["ram", "nvme"]
    ckpt.save_sync(7, state_for(7))
    ckpt.wait_sync()
    assert [v.step for v in ckpt.versions() if v.tier == "nvme"] == [7]  # pfs has 4: nothing spares it
    ckpt.close_sync()
    assert_holds(tmp_path / "pfs", 4, tmp_path)


def test_every_selected_version_reaches_pfs_on_real_disks_while_nvme_is_busy(tmp_path: Path) -> None:
    """The configuration that showed the defect: ram → nvme (every 1, keep 3) → pfs (every_steps 50,
    keep 100), 4 host slots, 400 saves of a changing state as fast as the loop goes, real filesystem
    tiers. nvme cannot write every save and takes the newest each time it is free. The loop saves the
    next pfs step only once pfs is done with the previous one (pfs can write each version it selects
    before the next arrives): then pfs must hold every one, each with the bytes of its own step.
    Before, pfs resolved most of them False (nvme had taken a newer step) and held one or two."""
    cfg = {
        "host": {"capacity": "8MiB", "snapshots": 4, "on_full": "block"},
        "tiers": [
            {"name": "ram", "type": "memory", "keep": {"last": 1}},
            fs_tier("nvme", tmp_path / "nvme", flush={"every": 1}, keep={"last": 3}),
            fs_tier("pfs", tmp_path / "pfs", flush={"every_steps": 50}, keep={"last": 100}),
        ],
    }
    state = {"w": torch.zeros(256 * 1024), "b": torch.zeros(64, dtype=torch.int64), "step": 0}  # 1 MiB
    pending = None
    results = {}
    with Checkpointer(cfg) as ckpt:
        policy = next(t.flush for t in ckpt.config.tiers if t.name == "pfs")
        for step in range(1, 401):
            ckpt.wait_captured()  # the lazy barrier before the in-place update
            state["w"].fill_(float(step))
            state["b"].copy_(torch.arange(step, step + 64))
            state["step"] = step
            if step % 50 == 0 and pending is not None:
                results[pending.step] = pending.committed_sync("pfs", DEADLINE_S)
            handle = ckpt.save_sync(step, state)
            assert flush_eligible(policy, step, save_number(handle)) is (step % 50 == 0)
            if step % 50 == 0:
                pending = handle
        assert pending is not None
        results[pending.step] = pending.committed_sync("pfs", DEADLINE_S)
        # Which save nvme holds under each step is remembered only for what it still holds (keep last 3,
        # plus what pfs waits for or reads, plus the version just committed): not one entry per save.
        assert len(committed_saves(ckpt, "nvme")) <= 6
    assert results == {s: True for s in range(50, 401, 50)}
    assert sorted(p.name for p in (tmp_path / "pfs").iterdir()) == [f"step-{s:012d}" for s in range(50, 401, 50)]
    for step in range(50, 401, 50):
        want = {"w": torch.full((256 * 1024,), float(step)), "b": torch.arange(step, step + 64)}
        assert_holds(tmp_path / "pfs", step, tmp_path, want)


ZSTD = {"codec": "zstd", "level": 1}


def test_a_tier_waiting_for_a_same_encoding_tier_above_copies_its_chunks_once_it_commits(tmp_path: Path, opened: Opened) -> None:
    """pfs compresses as nvme does: while nvme writes a save, pfs waits and then copies nvme's stored
    chunks (no second compression). nvme's retention (keep last 1) deletes after each commit; pfs must
    not miss the wake-up while nvme prunes."""
    g = Gates("nvme", deadline_s=DEADLINE_S)
    cfg = config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 1}, compression=ZSTD), fs_tier("pfs", tmp_path / "pfs", compression=ZSTD), snapshots=3)
    ckpt = opened(cfg, tier_factory=g)
    for step in (1, 2, 3):
        handle = ckpt.save_sync(step, state_for(step))
        assert handle.captured_sync(DEADLINE_S)
        g["nvme"].allow(1)
        assert handle.committed_sync("nvme", DEADLINE_S) is True
        assert handle.committed_sync("pfs", DEADLINE_S) is True, step
    assert ckpt.counters.compression["pfs"].compress_bytes_per_s == 0.0  # pfs never compressed
    ckpt.close_sync()
    for step in (1, 2, 3):
        assert_holds(tmp_path / "pfs", step, tmp_path)


@pytest.mark.parametrize("newest_only", [True, False])
def test_a_stuck_same_encoding_tier_above_holds_a_tier_below_up_only_briefly(tmp_path: Path, opened: Opened, newest_only: bool) -> None:
    """nvme (zstd) is stuck writing save 1. pfs (zstd alike) waits for it a bounded time
    (DEFER_FLOOR_S: it has no write of its own to measure yet), then compresses save 1 from host
    memory itself; saves 2-4, which nvme is not writing, it takes at once. Before the bound, pfs waited
    as long as nvme was stuck, and every queued save held a host slot meanwhile."""
    g = Gates("nvme", deadline_s=DEADLINE_S)
    pfs = fs_tier("pfs", tmp_path / "pfs", compression=ZSTD, flush={"newest_only": newest_only})
    ckpt = opened(config(fs_tier("nvme", tmp_path / "nvme", compression=ZSTD), pfs, snapshots=4, on_full="skip"), tier_factory=g)
    handles = {1: ckpt.save_sync(1, state_for(1))}
    assert g["nvme"].started.wait(DEADLINE_S)
    assert handles[1].committed_sync("pfs", DEADLINE_S) is True  # after at most the bound, nvme still stuck
    for step in (2, 3, 4):
        ckpt.wait_captured()
        handles[step] = ckpt.save_sync(step, state_for(step))
        assert handles[step].committed_sync("pfs", DEADLINE_S) is True, step
    assert g["nvme"].steps == [1] and ckpt.counters.skipped_saves == 0
    assert [v.step for v in ckpt.versions() if v.tier == "pfs"] == [1, 2, 3, 4]


def test_a_newer_save_of_a_step_replaces_the_older_one_a_tier_waits_for(tmp_path: Path, opened: Opened) -> None:
    """Saving a step again replaces it. pfs (every 2nd save, queued) is busy when save 4 of step 4 (its
    pick) and then save 5, step 4 again (not its pick), arrive; nvme commits both in turn. pfs takes the
    newer save of step 4 in the older one's place, with its own bytes, rather than lose step 4 when
    nvme's copy of the older save is replaced."""
    g = Gates("pfs", deadline_s=DEADLINE_S)
    cfg = config(fs_tier("nvme", tmp_path / "nvme", keep={"last": 1}), fs_tier("pfs", tmp_path / "pfs", flush={"every": 2, "newest_only": False}), snapshots=2)
    ckpt = opened(cfg, tier_factory=g)
    ckpt.save_sync(1, state_for(1))
    ckpt.wait_captured()
    h2 = ckpt.save_sync(2, state_for(2))
    assert g["pfs"].started.wait(DEADLINE_S)
    assert ckpt.save_sync(3, state_for(3)).committed_sync("nvme", DEADLINE_S) is True
    first = ckpt.save_sync(4, state_for(4))
    assert first.committed_sync("nvme", DEADLINE_S) is True
    again = ckpt.save_sync(4, state_for(40) | {"step": 4})
    assert again.committed_sync("nvme", DEADLINE_S) is True
    assert first.committed_sync("pfs", DEADLINE_S) is False  # replaced by the newer save of step 4
    g["pfs"].gate.set()
    assert h2.committed_sync("pfs", DEADLINE_S) is True
    assert again.committed_sync("pfs", DEADLINE_S) is True
    ckpt.close_sync()
    assert sorted(p.name for p in (tmp_path / "pfs").iterdir()) == ["step-000000000002", "step-000000000004"]
    assert_holds(tmp_path / "pfs", 4, tmp_path, state_for(40))
