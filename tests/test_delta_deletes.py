"""Differential versions against deletes: a reader's lease keeps the base of the version it reads, a
deleted step never comes back from a copy kept aside, and a base outlives a dependent that would not go.

Found by the crash campaign (``test_crash.py``, delta): a step saved again while a tier below read it
kept its earlier copy aside; retention then deleted that copy's base, and a SIGKILL right after the
step itself was deleted left the copy aside, which the next open put back: a listed version whose
base was gone.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt.config import CompressionConfig
from tierckpt.format import MANIFEST_FILE, Manifest, version_dirname
from tierckpt.testing.faults import IOFaults
from tierckpt.testing.inspect import call_on_engine, run_on_engine
from tierckpt.tiers.stored import write as fswrite
from tierckpt.tiers.stored.encoding import TierEncoding

import fsrecord
from helpers import Opened, assert_bitwise, fs_tier_of, held, leftovers, ram_fs


def _state(step: int, variant: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 31 + variant)
    return {"w": torch.randn(1 << 18, generator=g), "step": step, "variant": variant}


def _config(root: Path, every: int, **tier: Any) -> dict[str, Any]:
    return ram_fs(root, capacity="8MiB", delta={"full_every": every}, **tier)


def _save(ckpt: Any, step: int, variant: int = 0) -> dict[str, Any]:
    state = _state(step, variant)
    assert ckpt.save_sync(step, state).committed_sync("nvme", timeout=60)
    ckpt.wait_sync()
    return state


def _bases(ckpt: Any) -> list[tuple[int, int | None]]:
    return [(v.step, v.base) for v in ckpt.versions() if v.tier == "nvme"]


def _copy_out(source: Any, out: Path) -> None:
    """Write what ``source`` reads as a whole version in ``out`` (a tier below taking it)."""
    out.mkdir(parents=True)
    raw = TierEncoding(CompressionConfig(), "below").begin()
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        records = fswrite.write_data_file(source, out / "data-r00000.bin", raw, executor)
    (out / MANIFEST_FILE).write_bytes(Manifest(source.step, source.created, source.skeleton, records, source.metadata).encode())


def test_a_reader_of_a_differential_version_keeps_its_base_when_the_step_is_saved_again(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    ckpt = opened(_config(root, every=3, keep={"last": 1}))
    tier = fs_tier_of(ckpt)
    _save(ckpt, 1)
    first = _save(ckpt, 4)
    assert _bases(ckpt) == [(1, None), (4, 1)]
    # A reader (a tier below, a restore) leases step 4 and opens it.
    lease = call_on_engine(ckpt, lambda: tier.lease(4))
    source = run_on_engine(ckpt, tier.read(4))
    try:
        assert call_on_engine(ckpt, lambda: tier.leased(1))  # reading 4 reads its base
        # The job goes back and saves 2, 3 (against 1) and 4 again: 4 is whole now (chain of 3), and
        # retention (keep 1) drops 1, 2 and 3; the reader still reads the earlier 4, and its base.
        _save(ckpt, 2, variant=1)
        _save(ckpt, 3, variant=1)
        again = _save(ckpt, 4, variant=1)
        assert _bases(ckpt) == [(1, None), (4, None)]  # 1 stays while the earlier 4 is read
        _copy_out(source, tmp_path / "below" / version_dirname(4))
    finally:
        source.close()
        call_on_engine(ckpt, lease.release)
    below = opened(ram_fs(tmp_path / "below", name="below"))
    assert_bitwise(below.restore_sync(4).state, first)
    # Once released, the next prune lets 1 and the earlier copy of 4 go.
    _save(ckpt, 5, variant=1)
    assert held(ckpt, "nvme") == [4, 5]
    assert leftovers(root) == []
    assert_bitwise(ckpt.restore_sync(4).state, again)


def test_a_deleted_step_does_not_come_back_from_its_copy_kept_aside(opened: Opened, tmp_path: Path) -> None:
    """The directory as a SIGKILL right after the delete's rename to ``.trash-`` leaves it: the next
    open must not take the earlier copy of the step, kept aside for a reader, for a replacement a crash
    interrupted."""
    root = tmp_path / "nvme"
    config = _config(root, every=4)
    ckpt = opened(config)
    tier = fs_tier_of(ckpt)
    _save(ckpt, 1)
    _save(ckpt, 2)
    lease = call_on_engine(ckpt, lambda: tier.lease(2))
    _save(ckpt, 2, variant=1)  # the earlier 2 stays aside while it is read
    call_on_engine(ckpt, lease.release)
    assert [n.split("-")[1:3] for n in leftovers(root)] == [["step", version_dirname(2).split("-")[1]]]
    killed = tmp_path / "killed"

    def at_trash(name: str, paths: list[str], *_: Any) -> None:
        if name in ("rename", "replace") and os.path.basename(paths[1]).startswith(".trash-") and not killed.exists():
            shutil.copytree(root, killed, copy_function=os.link)  # what the kill would leave

    with fsrecord.Interposer(root, after=at_trash):
        run_on_engine(ckpt, tier.delete(2))
    assert killed.exists()
    assert held(ckpt, "nvme") == [1] and leftovers(root) == []
    restarted = opened(_config(killed, every=4))
    assert held(restarted, "nvme") == [1]
    assert leftovers(killed) == []


def test_a_version_that_would_not_be_deleted_keeps_its_base(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    ckpt = opened(_config(root, every=2, keep={"last": 1}))
    states = {step: _save(ckpt, step) for step in (1, 2)}
    assert _bases(ckpt) == [(1, None), (2, 1)]
    # Step 3 is whole; retention then drops 2 and 1, in that order, but 2 will not go.
    with IOFaults(errno.EACCES, "rename", under=root, path=f"{root}/{version_dirname(2)}", times=None) as faults:
        _save(ckpt, 3)
    assert faults.failed
    assert _bases(ckpt) == [(1, None), (2, 1), (3, None)]
    assert_bitwise(ckpt.restore_sync(2).state, states[2])
    _save(ckpt, 4)  # the disk lets go again: both go at the next prune
    assert _bases(ckpt) == [(3, None), (4, 3)]


def test_a_base_is_not_deleted_before_the_versions_written_against_it(opened: Opened, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    ckpt = opened(_config(root, every=4))
    states = {step: _save(ckpt, step) for step in (1, 2, 3)}
    tier = fs_tier_of(ckpt)
    with pytest.raises(RuntimeError, match=r"step 1 is the base of step\(s\) \[2, 3\], which are kept"):
        run_on_engine(ckpt, tier.delete(1))
    assert _bases(ckpt) == [(1, None), (2, 1), (3, 1)]
    for step in (2, 3):
        assert_bitwise(ckpt.restore_sync(step).state, states[step])
    for step in (3, 2, 1):  # dependents first: then the base goes too
        run_on_engine(ckpt, tier.delete(step))
    assert held(ckpt, "nvme") == [] and leftovers(root) == []
