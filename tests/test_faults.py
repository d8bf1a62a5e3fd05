"""Failing I/O on a filesystem tier: every write, fsync, rename and removal, with ENOSPC, EDQUOT, EIO, EACCES.

A real disk cannot be made to return EIO or EDQUOT at one chosen call, so these tests use
:class:`tierckpt.testing.IOFaults`, which makes the tier's own system calls fail (a real full disk is
in tests/test_filesystem_tier.py). What must hold after each failure: the save's handle raises a
FlushError naming the tier, the step, the errno and the path; later saves do not raise and commit;
the versions committed before are whole (restored bit for bit); nothing is left under ``.tmp-``;
retention never deletes the last good version; a failed delete leaves the version whole or under
``.trash-``, swept later.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import aiofiles.os
import pytest
import torch

from tierckpt import Checkpointer, FlushError
from tierckpt.format import version_dirname
from tierckpt.testing import IOFaults, fallocate_hook

from helpers import Opened, assert_bitwise, fs_tier, held, leftovers, memory_tier, tier_config


DEADLINE_S = 60.0
ERRNOS = [errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EACCES]
ERRNO_IDS = [errno.errorcode[e] for e in ERRNOS]

CLOSE_TOLERATES = (FlushError,)  # for the opened fixture: closing raises again what a test provoked


def _config(root: Path, **nvme: Any) -> dict[str, Any]:
    return tier_config(fs_tier("nvme", root, keep={"last": 1}, **nvme), ram=memory_tier(keep={"last": 1}))


def _state(step: int, seed: int | None = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step if seed is None else seed)
    return {"w": torch.randn(30_000, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16), "step": step}


def _steps(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def _restore_copy(version: Path, scratch: Path) -> Any:
    """Restore one version directory on its own, copied into a fresh tier (the tier itself is still open)."""
    root = scratch / f"copy-{version.name}-{len(list(scratch.glob('copy-*')))}"
    shutil.copytree(version, root / version.name)
    with Checkpointer(_config(root)) as ckpt:
        restored = ckpt.restore_latest_sync()
    assert restored is not None
    return restored


def _open(opened: Opened, root: Path, **nvme: Any) -> Checkpointer:
    return opened(_config(root, **nvme))


def _check_failure(failure: FlushError, *, step: int, code: int, pattern: str) -> None:
    assert (failure.tier, failure.step, failure.errno) == ("nvme", step, code)
    assert failure.filename is not None and fnmatch.fnmatchcase(failure.filename, pattern), (failure.filename, pattern)
    message = str(failure)
    for part in ("'nvme'", f"step {step}", errno.errorcode[code], f"[Errno {code}]", failure.filename):
        assert part in message, (part, message)
    assert isinstance(failure, OSError) and isinstance(failure.__cause__, OSError)
    assert failure.__cause__.errno == code


# -- a failing write or commit ----------------------------------------------------------------------------

# Each call a flush makes, as (kind of call, glob of its path): "{root}" is the tier's directory.
WRITE_SITES = {
    "mkdir-tmp": ("mkdir", "*/.tmp-step-*"),
    "open-data": ("open", "*/.tmp-*/data-r00000.bin"),
    "fallocate-data": ("allocate", "*/.tmp-*/data-r00000.bin"),
    "pwritev-data": ("write", "*/.tmp-*/data-r00000.bin"),
    "fsync-data": ("fsync", "*/.tmp-*/data-r00000.bin"),
    "open-manifest": ("open", "*/.tmp-*/manifest.msgpack"),
    "write-manifest": ("write", "*/.tmp-*/manifest.msgpack"),
    "fsync-manifest": ("fsync", "*/.tmp-*/manifest.msgpack"),
    "fsync-tmp-dir": ("fsync", "*/.tmp-step-000000000002-????????????"),
    "rename-commit": ("rename", "*/.tmp-step-*"),
    "fsync-tier-dir": ("fsync", "{root}"),
}


@pytest.mark.parametrize("code", ERRNOS, ids=ERRNO_IDS)
@pytest.mark.parametrize("site", list(WRITE_SITES))
def test_a_failing_call_fails_that_save_only(
    opened: Opened, tmp_path: Path, site: str, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "nvme"
    ckpt = _open(opened, root)
    assert ckpt.save_sync(1, _state(1)).committed_sync("nvme", DEADLINE_S) is True
    op, pattern = WRITE_SITES[site]
    pattern = pattern.format(root=root)

    with IOFaults(code, op, under=root, path=pattern) as faults:
        handle = ckpt.save_sync(2, _state(2))
        with pytest.raises(FlushError) as info:
            handle.committed_sync("nvme", DEADLINE_S)
    assert len(faults.failed) == 1, faults.failed  # the call was made, and failed once
    _check_failure(info.value, step=2, code=code, pattern=pattern)
    assert handle.committed_sync("ram", 0) is True

    # Nothing committed was touched, and the failed attempt left nothing behind.
    assert held(ckpt, "nvme") == [1]
    assert _steps(root) == [version_dirname(1)]
    assert leftovers(root) == []
    counters = ckpt.counters
    assert (counters.flush_errors, counters.failed) == (1, {"nvme": 1})
    assert counters.last_error["nvme"] is info.value
    logged = [r.getMessage() for r in caplog.records if r.name == "tierckpt" and r.levelno == logging.ERROR]
    assert any(str(info.value) in m and "holds steps [1]" in m for m in logged), logged
    first = _restore_copy(root / version_dirname(1), tmp_path)
    assert first.step == 1
    assert_bitwise(first.state, _state(1))

    # Training goes on: the next save does not raise, and commits.
    later = ckpt.save_sync(3, _state(3))
    assert later.committed_sync("nvme", DEADLINE_S) is True
    ckpt.wait_sync()  # the tier committed since its failure: nothing to raise
    assert held(ckpt, "nvme") == [3]  # retention ran only now, after a commit
    assert _steps(root) == [version_dirname(3)]
    assert leftovers(root) == []
    ckpt.close_sync()
    restored = _open(opened, root).restore_latest_sync()
    assert restored is not None and restored.step == 3
    assert_bitwise(restored.state, _state(3))


@pytest.mark.parametrize("code", ERRNOS, ids=ERRNO_IDS)
@pytest.mark.parametrize("site", ["rename-aside", "rename-into-place", "fsync-tier-dir"])
def test_a_failed_replacement_keeps_the_committed_version_of_that_step(
    opened: Opened, tmp_path: Path, site: str, code: int
) -> None:
    """Saving a committed step again moves the old version aside, renames the new one in and syncs the
    directory: whichever of the three fails, the step keeps its old content."""
    root = tmp_path / "nvme"
    ckpt = _open(opened, root)
    assert ckpt.save_sync(1, _state(1)).committed_sync("nvme", DEADLINE_S) is True
    op, pattern = {
        "rename-aside": ("rename", f"{root}/step-000000000001"),
        "rename-into-place": ("rename", f"{root}/.tmp-step-000000000001-*"),
        "fsync-tier-dir": ("fsync", str(root)),
    }[site]

    with IOFaults(code, op, under=root, path=pattern) as faults:
        handle = ckpt.save_sync(1, _state(1, seed=100))
        with pytest.raises(FlushError) as info:
            handle.committed_sync("nvme", DEADLINE_S)
    assert len(faults.failed) == 1
    _check_failure(info.value, step=1, code=code, pattern=pattern)
    assert held(ckpt, "nvme") == [1]
    assert _steps(root) == [version_dirname(1)]
    assert leftovers(root) == []
    old = _restore_copy(root / version_dirname(1), tmp_path)
    assert_bitwise(old.state, _state(1))  # the old content, not seed 100

    assert ckpt.save_sync(1, _state(1, seed=200)).committed_sync("nvme", DEADLINE_S) is True
    ckpt.wait_sync()
    assert leftovers(root) == []
    assert_bitwise(_restore_copy(root / version_dirname(1), tmp_path).state, _state(1, seed=200))


def test_an_undo_that_fails_too_leaves_the_new_version_whole_in_place(opened: Opened, tmp_path: Path) -> None:
    """The directory fsync after the commit rename fails, and so does renaming the version back: it stays."""
    root = tmp_path / "nvme"
    ckpt = _open(opened, root)
    assert ckpt.save_sync(1, _state(1)).committed_sync("nvme", DEADLINE_S) is True
    with (
        IOFaults(errno.EIO, "fsync", under=root, path=str(root)),
        # The first rename naming step-2 is the commit's (into place); the second, taking it back, fails.
        IOFaults(errno.EIO, "rename", under=root, path=f"{root}/step-000000000002", nth=2) as undo,
    ):
        handle = ckpt.save_sync(2, _state(2))
        with pytest.raises(FlushError) as info:
            handle.committed_sync("nvme", DEADLINE_S)
    assert (info.value.step, info.value.errno, info.value.filename) == (2, errno.EIO, str(root))
    assert [Path(p).name for _, p in undo.failed] == [version_dirname(2)]
    assert held(ckpt, "nvme") == [1, 2]  # what the directory shows: retention did not run
    assert _steps(root) == [version_dirname(1), version_dirname(2)]
    assert_bitwise(_restore_copy(root / version_dirname(1), tmp_path).state, _state(1))
    assert_bitwise(_restore_copy(root / version_dirname(2), tmp_path).state, _state(2))
    assert ckpt.save_sync(3, _state(3)).committed_sync("nvme", DEADLINE_S) is True
    ckpt.wait_sync()
    assert held(ckpt, "nvme") == [3] and leftovers(root) == []


def test_an_old_version_that_cannot_be_put_back_returns_at_the_next_open(
    opened: Opened, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "nvme"
    ckpt = _open(opened, root)
    assert ckpt.save_sync(1, _state(1)).committed_sync("nvme", DEADLINE_S) is True
    faults = (
        IOFaults(errno.EIO, "rename", under=root, path=f"{root}/.tmp-step-*"),
        # The first rename naming .replaced- moves step 1 aside; the second, putting it back, fails.
        IOFaults(errno.EIO, "rename", under=root, path=f"{root}/.replaced-step-*", nth=2),
    )
    with faults[0], faults[1]:
        with pytest.raises(FlushError):
            ckpt.save_sync(1, _state(1, seed=100)).committed_sync("nvme", DEADLINE_S)
    assert held(ckpt, "nvme") == []  # the tier no longer shows it...
    assert [n[: len(".replaced-step-000000000001")] for n in leftovers(root)] == [".replaced-step-000000000001"]
    assert any("could not be put back" in r.getMessage() for r in caplog.records)
    with pytest.raises(FlushError):  # the tier has committed nothing since
        ckpt.close_sync()

    again = _open(opened, root)  # ...and puts it back when it opens
    assert held(again, "nvme") == [1] and leftovers(root) == []
    restored = again.restore_latest_sync()
    assert restored is not None and restored.step == 1
    assert_bitwise(restored.state, _state(1))


# -- a failing delete ----------------------------------------------------------------------------------------

DELETE_SITES = {
    # the version stays whole, in place, and retention tries again after the next commit
    "rename-to-trash": ("rename", "{root}/step-000000000001", 1),
    # the version is gone from the tier, its bytes under .trash- until the directory syncs again
    "fsync-tier-dir": ("fsync", "{root}", 2),  # the first is step 2's commit
    # part of the version's files will not go: what is left waits under .trash-
    "unlink-data": ("remove", "{root}/.trash-step-000000000001-*/data-r00000.bin", 1),
}


@pytest.mark.parametrize("code", ERRNOS, ids=ERRNO_IDS)
@pytest.mark.parametrize("site", list(DELETE_SITES))
def test_a_failing_delete_keeps_the_version_or_trashes_it_whole(
    opened: Opened, tmp_path: Path, site: str, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "nvme"
    ckpt = _open(opened, root)
    assert ckpt.save_sync(1, _state(1)).committed_sync("nvme", DEADLINE_S) is True
    before = tmp_path / "before" / version_dirname(1)
    shutil.copytree(root / version_dirname(1), before)
    op, pattern, nth = DELETE_SITES[site]
    pattern = pattern.format(root=root)

    with IOFaults(code, op, under=root, path=pattern, nth=nth) as faults:
        assert ckpt.save_sync(2, _state(2)).committed_sync("nvme", DEADLINE_S) is True  # the commit itself worked
        ckpt.wait_sync()  # retention ran, and a failed delete is not raised
    assert len(faults.failed) == 1
    counters = ckpt.counters
    assert (counters.flush_errors, counters.failed) == (1, {"nvme": 1})
    failure = counters.last_error["nvme"]
    _check_failure(failure, step=1, code=code, pattern=pattern)
    assert "deleting step 1" in str(failure)
    logged = [r.getMessage() for r in caplog.records if r.name == "tierckpt" and r.levelno == logging.ERROR]
    assert any(str(failure) in m for m in logged), logged

    if site == "rename-to-trash":
        assert held(ckpt, "nvme") == [1, 2]
        assert _steps(root) == [version_dirname(1), version_dirname(2)] and leftovers(root) == []
        assert_bitwise(_restore_copy(root / version_dirname(1), tmp_path).state, _state(1))
    else:
        assert held(ckpt, "nvme") == [2]
        assert _steps(root) == [version_dirname(2)]
        assert [n[: len(".trash-step-000000000001")] for n in leftovers(root)] == [".trash-step-000000000001"]
    assert_bitwise(_restore_copy(before, tmp_path).state, _state(1))  # what was deleted was whole up to then

    # The next save commits; retention deletes what it could not, and the leftovers are swept.
    assert ckpt.save_sync(3, _state(3)).committed_sync("nvme", DEADLINE_S) is True
    ckpt.wait_sync()
    assert held(ckpt, "nvme") == [3]
    assert _steps(root) == [version_dirname(3)] and leftovers(root) == []
    assert ckpt.counters.flush_errors == 1


# -- what a failed removal leaves is swept -------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES], ids=["EIO", "EACCES"])
def test_a_temporary_directory_that_will_not_go_is_swept_before_the_next_write(
    opened: Opened, tmp_path: Path, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "nvme"
    ckpt = _open(opened, root)
    assert ckpt.save_sync(1, _state(1)).committed_sync("nvme", DEADLINE_S) is True
    with (
        IOFaults(errno.ENOSPC, "fsync", under=root, path="*/.tmp-*/manifest.msgpack"),
        IOFaults(code, "remove", under=root, path="*/.tmp-step-000000000002-*/data-r00000.bin", times=None) as stuck,
    ):
        with pytest.raises(FlushError) as info:
            ckpt.save_sync(2, _state(2)).committed_sync("nvme", DEADLINE_S)
        # The save's own failure is what is raised; the failed cleanup is logged.
        assert info.value.errno == errno.ENOSPC and info.value.filename.endswith("manifest.msgpack")
        left = leftovers(root)
        assert [n[: len(".tmp-step-000000000002")] for n in left] == [".tmp-step-000000000002"]
        assert os.listdir(root / left[0]) == ["data-r00000.bin"]  # the rest of it was removed anyway
        assert any("could not remove all of" in r.getMessage() and left[0] in r.getMessage() for r in caplog.records)
        # Still stuck: the next save commits all the same, and the retry fails quietly.
        assert ckpt.save_sync(3, _state(3)).committed_sync("nvme", DEADLINE_S) is True
        ckpt.wait_sync()
        assert len(stuck.failed) >= 2 and leftovers(root) == left
    # Unstuck: retried before the next write.
    assert ckpt.save_sync(4, _state(4)).committed_sync("nvme", DEADLINE_S) is True
    ckpt.wait_sync()
    assert leftovers(root) == [] and held(ckpt, "nvme") == [4]


def test_leftovers_a_failed_removal_left_are_swept_when_the_tier_next_opens(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    ckpt = _open(opened, root)
    assert ckpt.save_sync(1, _state(1)).committed_sync("nvme", DEADLINE_S) is True
    with (
        IOFaults(errno.EIO, "write", under=root, path="*/.tmp-*/data-r00000.bin"),
        IOFaults(errno.EIO, "remove", under=root, path="*/.tmp-*", times=None),
    ):
        with pytest.raises(FlushError):
            ckpt.save_sync(2, _state(2)).committed_sync("nvme", DEADLINE_S)
        assert len(leftovers(root)) == 1
        with pytest.raises(FlushError):  # close() promises durability: the tier committed nothing since
            ckpt.close_sync()
    assert len(leftovers(root)) == 1
    again = _open(opened, root)
    assert leftovers(root) == [] and held(again, "nvme") == [1]
    restored = again.restore_latest_sync()
    assert restored is not None and restored.step == 1
    assert_bitwise(restored.state, _state(1))


# -- several tiers, a failing tier for a while ------------------------------------------------------------


def test_a_failing_lower_tier_does_not_stop_the_others(opened: Opened, tmp_path: Path) -> None:
    nvme, pfs = tmp_path / "nvme", tmp_path / "pfs"
    ckpt = opened(tier_config(
        fs_tier("nvme", nvme, keep={"last": 1}), fs_tier("pfs", pfs, keep={"last": 1}, compression={"codec": "zstd"})
    ))
    h1 = ckpt.save_sync(1, _state(1))
    assert h1.committed_sync("pfs", DEADLINE_S) is True
    with IOFaults(errno.EDQUOT, "write", under=pfs, path="*/.tmp-*/data-*", times=None):
        handles = [ckpt.save_sync(step, _state(step)) for step in (2, 3)]
        # nvme works on: the newest goes down (step 2 may have been superseded while nvme was busy).
        assert handles[-1].committed_sync("nvme", DEADLINE_S) is True
        assert handles[0].committed_sync("nvme", DEADLINE_S) in (True, False)
        with pytest.raises(FlushError) as info:
            handles[-1].committed_sync("pfs", DEADLINE_S)
        assert (info.value.tier, info.value.step, info.value.errno) == ("pfs", 3, errno.EDQUOT)
        assert str(pfs) in info.value.filename
        with pytest.raises(FlushError) as at_wait:  # wait() promises durability: pfs has not committed since
            ckpt.wait_sync()
        assert at_wait.value.tier == "pfs"
        ckpt.wait_sync()  # reported once
    assert held(ckpt, "pfs") == [1]  # never deleted for a failed newer one
    assert ckpt.counters.failed.get("nvme", 0) == 0

    # A failure on nvme fails nvme alone: pfs selects step 4 itself and takes it from host memory.
    with IOFaults(errno.EIO, "fsync", under=nvme, path="*/.tmp-*/data-*"):
        h4 = ckpt.save_sync(4, _state(4))
        with pytest.raises(FlushError):
            h4.committed_sync("nvme", DEADLINE_S)
        assert h4.committed_sync("pfs", DEADLINE_S) is True
    h5 = ckpt.save_sync(5, _state(5))
    assert h5.committed_sync("pfs", DEADLINE_S) is True
    ckpt.wait_sync()
    assert [(v.tier, v.step) for v in ckpt.versions() if v.tier != "ram"] == [("nvme", 5), ("pfs", 5)]
    assert leftovers(nvme) == [] and leftovers(pfs) == []


async def test_the_async_save_after_a_failed_flush_does_not_raise(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    ckpt = _open(opened, root)
    with IOFaults(errno.EIO, "fsync", under=root, path="*/.tmp-*/data-*"):
        first = await ckpt.save(1, _state(1))
        with pytest.raises(FlushError):
            await first.committed("nvme")
    second = await ckpt.save(2, _state(2))
    assert await second.committed("nvme") is True
    await ckpt.close()


# -- the fault injector itself -------------------------------------------------------------------------------


def test_io_faults_fail_only_the_chosen_calls_and_put_everything_back(tmp_path: Path) -> None:
    originals = {name: getattr(os, name) for name in ("open", "fsync", "rename", "unlink", "mkdir", "pwritev")}
    aio_rename, fallocate = aiofiles.os.rename, getattr(*fallocate_hook())
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir()
    outside.mkdir()
    with IOFaults(errno.EIO, "fsync", under=inside, path="*.bin", nth=2, times=2) as faults:
        results = []
        for directory in (outside, inside):
            for i in range(5):
                fd = os.open(directory / f"{i}.bin", os.O_WRONLY | os.O_CREAT)
                try:
                    os.fsync(fd)
                    results.append((directory.name, i, None))
                except OSError as exc:
                    assert exc.filename is None  # as the kernel's: a call on a descriptor names no file
                    results.append((directory.name, i, exc.errno))
                finally:
                    os.close(fd)
    assert [r for r in results if r[2] is not None] == [("in", 1, errno.EIO), ("in", 2, errno.EIO)]
    assert faults.calls == 5
    assert [Path(p).name for _, p in faults.failed] == ["1.bin", "2.bin"]
    with IOFaults(errno.EACCES, "rename", under=inside, times=None):
        with pytest.raises(PermissionError) as info:
            os.rename(inside / "0.bin", inside / "x.bin")
        assert (info.value.filename, info.value.filename2) == (str(inside / "0.bin"), str(inside / "x.bin"))
        os.rename(outside / "0.bin", outside / "x.bin")
    with pytest.raises(ValueError):
        IOFaults(errno.EIO, "chmod", under=inside)
    assert {name: getattr(os, name) for name in originals} == originals
    assert (aiofiles.os.rename, getattr(*fallocate_hook())) == (aio_rename, fallocate)


def test_a_kept_failure_holds_no_view_of_host_memory(opened: Opened, tmp_path: Path) -> None:
    """``counters.last_error`` lives as long as the Checkpointer: its tracebacks must not keep the
    writer thread's locals (views of a host slot) alive."""
    root = tmp_path / "nvme"
    ckpt = _open(opened, root)
    with IOFaults(errno.EIO, "write", under=root, path="*/.tmp-*/data-*"):
        with pytest.raises(FlushError):
            ckpt.save_sync(1, _state(1)).committed_sync("nvme", DEADLINE_S)
    error: BaseException | None = ckpt.counters.last_error["nvme"]
    frames = 0
    while error is not None:
        tb = error.__traceback__
        while tb is not None:
            frames += 1
            assert not any(isinstance(v, memoryview) for v in tb.tb_frame.f_locals.values()), tb.tb_frame.f_code.co_name
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    assert frames > 0
