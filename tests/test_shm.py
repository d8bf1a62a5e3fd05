"""A memory tier on a RAM-backed file system: its snapshots outlive a SIGKILL, under the same rules."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from tierckpt import Checkpointer, ConfigError
from tierckpt.format import MANIFEST_FILE, Manifest, version_dirname
from tierckpt.tiers.memory.shm import POOL_FILE, POOL_INFO
from tierckpt.testing import flip_bits

from helpers import fs_tier, logged_warnings, memory_tier, tier_config

_SLOT = 8 << 20


def _config(shm: Path, disk: Path, *, snapshots: int = 2, keep: int | None = 2, capacity: int = 2 * _SLOT) -> dict[str, Any]:
    ram = memory_tier(path=str(shm), **({"keep": {"last": keep}} if keep else {}))
    return tier_config(fs_tier("nvme", disk, flush={"every_steps": 4}), capacity=capacity, snapshots=snapshots, ram=ram)


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(1000, 1001, generator=g),  # ~4 MiB: a chunk and a tail
        "h": torch.randn(333, generator=g).to(torch.bfloat16),
        "i": torch.randint(0, 1 << 40, (77,), generator=g),
        "step": step,
        "note": f"step {step}",
    }


def assert_state(restored: Any, step: int) -> None:
    expected = state(step)
    assert restored["step"] == step and restored["note"] == expected["note"]
    for key in ("w", "h", "i"):
        assert restored[key].dtype == expected[key].dtype
        assert restored[key].view(torch.uint8).equal(expected[key].view(torch.uint8)), key


_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[3])
    from test_shm import _config, state
    from tierckpt import Checkpointer
    from pathlib import Path
    ckpt = Checkpointer(_config(Path(sys.argv[1]), Path(sys.argv[2])))
    for step in range(1, int(sys.argv[4]) + 1):
        handle = ckpt.save_sync(step, state(step))
        if sys.argv[5] == "wait":
            handle.committed_sync("ram", timeout=60)
        print(step, flush=True)
    if sys.argv[5] == "wait":
        os.kill(os.getpid(), signal.SIGKILL)
    print("done", flush=True)
    sys.stdin.read()
    """
)


def _run_child(shm: Path, disk: Path, steps: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(shm), str(disk), str(Path(__file__).parent), str(steps), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_killed_process_restores_from_ram_in_a_new_one(shm: Path, tmp_path: Path) -> None:
    with _run_child(shm, tmp_path / "nvme", 6, "wait") as child:
        out, _ = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL
    assert out.split() == [str(s) for s in range(1, 7)]  # each committed on ram before the next save
    with Checkpointer(_config(shm, tmp_path / "nvme")) as ckpt:
        ram = [(i.step, i.path) for i in ckpt.versions() if i.tier == "ram"]
        # 6 and 5, or 4 if the nvme flush of step 4 was still pending and kept it (two slots).
        assert len(ram) == 2 and ram[1][0] == 6 and ram[0][0] in (4, 5)
        assert all(path == str(shm / version_dirname(step)) for step, path in ram)
        restored = ckpt.restore_latest_sync()
        assert restored is not None and (restored.step, restored.tier) == (6, "ram")
        assert_state(restored.state, 6)
        template = state(0)
        into = ckpt.restore_latest_sync(template=template)
        assert into is not None and into.step == 6 and into.state["w"] is template["w"]
        assert_state(into.state, 6)


def test_capacity_and_retention_hold_across_restarts(shm: Path, tmp_path: Path) -> None:
    with _run_child(shm, tmp_path / "nvme", 5, "wait") as child:
        child.communicate(timeout=120)
    assert sorted(os.listdir(shm)) == [POOL_FILE, POOL_INFO, version_dirname(4), version_dirname(5)]
    size = (shm / POOL_FILE).stat().st_size
    with Checkpointer(_config(shm, tmp_path / "nvme")) as ckpt:
        ckpt.wait_sync()  # step 4 reaches the disk now if the kill came before it did
        assert [i.step for i in ckpt.versions() if i.tier == "nvme"] == [4]
        # Both slots hold a snapshot from before: the next save takes the older one's slot.
        assert ckpt.save_sync(10, state(10)).committed_sync("ram", timeout=60)
        assert sorted(i.step for i in ckpt.versions() if i.tier == "ram") == [5, 10]
        assert ckpt.save_sync(11, state(11)).committed_sync("ram", timeout=60)
        assert sorted(i.step for i in ckpt.versions() if i.tier == "ram") == [10, 11]
    assert sorted(os.listdir(shm)) == [POOL_FILE, POOL_INFO, version_dirname(10), version_dirname(11)]
    assert (shm / POOL_FILE).stat().st_size == size  # the pool never grows
    slots = set()
    for step in (10, 11):
        manifest = Manifest.decode((shm / version_dirname(step) / MANIFEST_FILE).read_bytes(), step=step)
        slots |= {c.offset // _SLOT for r in manifest.records for c in r.chunks}
    assert slots == {0, 1}  # one slot each
    with Checkpointer(_config(shm, tmp_path / "nvme")) as ckpt:
        restored = ckpt.restore_latest_sync()
        assert restored is not None and (restored.step, restored.tier) == (11, "ram")
        assert_state(restored.state, 11)


@pytest.mark.parametrize("saves", [1, 3, 8, 21])
def test_a_kill_at_any_moment_leaves_only_whole_snapshots(shm: Path, tmp_path: Path, saves: int) -> None:
    # Killed right after its n-th save() returned, with captures and version directories in flight:
    # whatever the new process finds in RAM verifies and is exactly what that step saved.
    with _run_child(shm, tmp_path / "nvme", 1000, "nowait") as child:
        assert child.stdout is not None
        for _ in range(saves):
            child.stdout.readline()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    with Checkpointer(_config(shm, tmp_path / "nvme")) as ckpt:
        assert not [n for n in os.listdir(shm) if n.startswith((".tmp-", ".trash-"))]
        ram = [i.step for i in ckpt.versions() if i.tier == "ram"]
        assert len(ram) <= 2  # the child may have run ahead of the lines read: no upper bound on steps
        # Nothing says a snapshot was written by the kill (save() returns before): only that what is
        # there is whole. test_a_killed_process_restores_from_ram_in_a_new_one waits for commits.
        restored = ckpt.restore_latest_sync()
        if restored is not None:
            assert_state(restored.state, restored.step)
            assert restored.tier == "ram" or not ram


def test_a_damaged_snapshot_falls_back_to_the_same_step_on_disk(shm: Path, tmp_path: Path) -> None:
    with Checkpointer(_config(shm, tmp_path / "nvme")) as ckpt:  # a clean close keeps the RAM tier too
        for step in (1, 2, 3, 4):
            ckpt.save_sync(step, state(step))
        ckpt.wait_sync()
        assert [i.step for i in ckpt.versions() if i.tier == "nvme"] == [4]
    manifest = Manifest.decode((shm / version_dirname(4) / MANIFEST_FILE).read_bytes(), step=4)
    chunk = next(r for r in manifest.records if r.key == "['w']").chunks[0]
    flip_bits(shm / POOL_FILE, chunk.offset + 12345, 0x10)
    with Checkpointer(_config(shm, tmp_path / "nvme")) as ckpt:
        with logged_warnings(match=r"step 4 on tier 'ram'.*checksum mismatch in \['w'\] \(chunk 0\)"):
            restored = ckpt.restore_latest_sync()
        assert restored is not None and (restored.step, restored.tier) == (4, "nvme")
        assert_state(restored.state, 4)


def test_a_foreign_or_stale_directory_is_refused(shm: Path, tmp_path: Path) -> None:
    shm.mkdir()
    (shm / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"tier 'ram': .* holds files that are not a tierckpt memory tier \(e.g. 'notes.txt'\)"):
        Checkpointer(_config(shm, tmp_path / "nvme"))
    assert (shm / "notes.txt").read_text() == "mine"
    (shm / "notes.txt").unlink()

    with _run_child(shm, tmp_path / "nvme", 2, "wait") as child:
        child.communicate(timeout=120)
    with pytest.raises(ConfigError, match=r"holds a host pool of 2 slots of 8388608 bytes, and this config asks for 3 of"):
        Checkpointer(_config(shm, tmp_path / "nvme", snapshots=3, capacity=3 * _SLOT))
    info = msgpack.unpackb((shm / POOL_INFO).read_bytes())
    assert info["slots"] == 2  # untouched
    os.truncate(shm / POOL_FILE, _SLOT)
    with pytest.raises(ConfigError, match=rf"has a {POOL_FILE} of {_SLOT} bytes, not {2 * _SLOT}"):
        Checkpointer(_config(shm, tmp_path / "nvme"))
    (shm / POOL_FILE).unlink()
    with pytest.raises(ConfigError, match=rf"has {POOL_INFO} but no {POOL_FILE}"):
        Checkpointer(_config(shm, tmp_path / "nvme"))
    assert (shm / version_dirname(2)).is_dir()  # nothing was removed


def test_a_ram_tier_in_use_by_another_checkpointer_is_refused(shm: Path, tmp_path: Path) -> None:
    with Checkpointer(_config(shm, tmp_path / "a")) as first:
        with pytest.raises(ConfigError, match=rf"'{shm}' is in use by another Checkpointer \(pid {os.getpid()}\)"):
            Checkpointer(_config(shm, tmp_path / "b"))
        assert first.save_sync(1, state(1)).committed_sync("ram", timeout=60)


def test_a_ram_file_system_too_small_for_the_pool_is_a_clear_error(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        with pytest.raises(ConfigError, match=r"has no room for a 16777216-byte host pool .*lower host.capacity"):
            Checkpointer(_config(small / "ram", tmp_path / "nvme"))
        assert [n for n in os.listdir(small / "ram")] == []  # the failed pool file is gone
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_a_path_not_on_a_ram_file_system_works_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        with Checkpointer(_config(tmp_path / "ram", tmp_path / "nvme")) as ckpt:
            assert ckpt.save_sync(1, state(1)).committed_sync("ram", timeout=60)
    if "not on a RAM-backed file system" not in caplog.text:
        pytest.skip("tmp_path is itself on a RAM file system here")
    with Checkpointer(_config(tmp_path / "ram", tmp_path / "nvme")) as ckpt:
        restored = ckpt.restore_latest_sync()
        assert restored is not None and (restored.step, restored.tier) == (1, "ram")


# -- snapshots a killed process left behind go on down ------------------------------------------------


def _every_config(shm: Path, disk: Path, newest_only: bool = False) -> dict[str, Any]:
    return {
        "host": {"capacity": 4 * _SLOT, "snapshots": 4},
        "tiers": [
            {"name": "ram", "type": "memory", "path": str(shm), "keep": {"last": 2}},
            {"name": "nvme", "type": "filesystem", "path": str(disk), "flush": {"newest_only": newest_only}, "keep": {"last": 3}},
        ],
    }


_STALLED_DISK_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[3])
    from test_shm import _every_config, state
    from tierckpt import Checkpointer
    from tierckpt.testing import slow
    from pathlib import Path
    # The disk takes 10 minutes a write: nothing reaches it before the kill.
    ckpt = Checkpointer(_every_config(Path(sys.argv[1]), Path(sys.argv[2])), tier_factory=slow({"nvme": 600}))
    for step in (1, 2, 3):
        ckpt.save_sync(step, state(step)).committed_sync("ram", timeout=60)
        print(step, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _killed_before_the_disk(shm: Path, disk: Path) -> None:
    """Steps 1-3 in the RAM tier at shm, none on the disk, and the process that saved them SIGKILLed."""
    child = subprocess.run(
        [sys.executable, "-c", _STALLED_DISK_CHILD, str(shm), str(disk), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert child.stdout.split() == ["1", "2", "3"]
    assert not disk.exists() or not any(p.name.startswith("step-") for p in disk.iterdir())


def test_snapshots_a_killed_process_left_in_ram_are_flushed_by_the_next_one(shm: Path, tmp_path: Path) -> None:
    disk = tmp_path / "nvme"
    _killed_before_the_disk(shm, disk)
    with Checkpointer(_every_config(shm, disk)) as ckpt:
        ckpt.wait_sync()  # no save in this process: the flushes are of what the killed one left
        # RAM had kept all three for the disk (keep: last 2 yields); every one goes down, oldest first.
        assert [i.step for i in ckpt.versions() if i.tier == "nvme"] == [1, 2, 3]
    shutil.rmtree(disk)
    with Checkpointer(_every_config(shm, disk, newest_only=True)) as ckpt:
        ckpt.wait_sync()
        assert sorted(i.step for i in ckpt.versions() if i.tier == "ram") == [2, 3]
        assert [i.step for i in ckpt.versions() if i.tier == "nvme"] == [3]  # newest_only: the newest
    disk_only = {"tiers": [{"name": "nvme", "type": "filesystem", "path": str(disk)}]}
    with Checkpointer(disk_only) as ckpt:
        restored = ckpt.restore_latest_sync()
    assert restored is not None and (restored.step, restored.tier) == (3, "nvme")
    assert_state(restored.state, 3)


def test_a_damaged_leftover_is_not_flushed_and_fails_nothing(shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tierckpt.errors import FlushError
    from tierckpt.testing import faulty

    disk = tmp_path / "nvme"
    ckpt = Checkpointer(_every_config(shm, disk), tier_factory=faulty({"nvme": lambda step: True}))
    for step in (1, 2):
        ckpt.save_sync(step, state(step))
    with pytest.raises(FlushError):
        ckpt.close_sync()  # the disk failed every write; RAM kept both
    manifest = Manifest.decode((shm / version_dirname(2) / MANIFEST_FILE).read_bytes(), step=2)
    chunk = next(r for r in manifest.records if r.key == "['w']").chunks[0]
    flip_bits(shm / POOL_FILE, chunk.offset + 777, 0x04)
    with caplog.at_level(logging.WARNING, logger="tierckpt"), Checkpointer(_every_config(shm, disk)) as ckpt:
        ckpt.wait_sync()  # does not raise: the damaged leftover is left out, step 1 goes down
        assert [i.step for i in ckpt.versions() if i.tier == "nvme"] == [1]
    assert "step 2 on tier 'ram'" in caplog.text and "not flushed to 'nvme'" in caplog.text


def test_a_leftover_is_checked_once_by_a_restore_and_its_flush(shm: Path, tmp_path: Path) -> None:
    from tierckpt.testing.inspect import watch_memory_checks

    disk = tmp_path / "nvme"
    _killed_before_the_disk(shm, disk)
    import threading

    checked: dict[tuple[int, int], int] = {}
    lock, again = threading.Lock(), threading.Event()

    def counting(snapshot: Any, i: int) -> None:
        with lock:
            checked[snapshot.step, i] = n = checked.get((snapshot.step, i), 0) + 1
        if (snapshot.step, i) == (3, 0):
            if n > 1:
                again.set()
            else:
                # Hold the first check of step 3 open a while: a second check started meanwhile
                # (the restore's and the flush's not shared) would show here.
                again.wait(1.0)

    with watch_memory_checks(counting), Checkpointer(_every_config(shm, disk)) as ckpt:
        restored = ckpt.restore_latest_sync()  # while the flush of the leftovers checks them too
        ckpt.wait_sync()
        assert [i.step for i in ckpt.versions() if i.tier == "nvme"] == [1, 2, 3]
    assert restored is not None and (restored.step, restored.tier) == (3, "ram")
    assert_state(restored.state, 3)
    assert {step for step, _ in checked} == {1, 2, 3}
    assert set(checked.values()) == {1}, checked  # each chunk hashed once

