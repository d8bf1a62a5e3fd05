"""Checkpointer.metadata(step): a version's metadata from its manifest, without reading a tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierckpt.errors import ConfigError, CorruptCheckpointError, NoCheckpointError
from tierckpt.format import DATA_FILE, MANIFEST_FILE, Manifest, version_dirname
from tierckpt.testing import flip_bits

from helpers import Opened, ram_fs


def test_the_metadata_of_a_step_comes_from_its_manifest_alone(opened: Opened, tmp_path: Path) -> None:
    config = ram_fs(tmp_path / "nvme", capacity="16MiB")
    ckpt = opened(config)
    for step in (1, 2):
        assert ckpt.save_sync(step, {"w": torch.randn(1 << 16)}, metadata={"step": step, "note": "x"}).committed_sync("nvme", timeout=60)
    assert ckpt.metadata_sync(2) == {"step": 2, "note": "x"}  # from RAM
    ckpt.close_sync()

    ckpt = opened(config)  # a new process: RAM is empty, the disk holds both
    assert ckpt.metadata_sync(1, tier="nvme") == {"step": 1, "note": "x"}
    # A damaged tensor is not read: the metadata still comes back (a restore would refuse the step).
    version = tmp_path / "nvme" / version_dirname(2)
    chunk = Manifest.decode((version / MANIFEST_FILE).read_bytes()).records[0].chunks[0]
    assert chunk is not None
    flip_bits(version / DATA_FILE.format(rank=0), chunk.offset + 10, 1)
    assert ckpt.metadata_sync(2) == {"step": 2, "note": "x"}
    with pytest.raises(CorruptCheckpointError):
        ckpt.restore_sync(2)
    with pytest.raises(NoCheckpointError, match=r"no tier holds step 3 \(ram: none; nvme: 1, 2\)"):
        ckpt.metadata_sync(3)
    with pytest.raises(NoCheckpointError):
        ckpt.metadata_sync(1, tier="ram")
    with pytest.raises(ConfigError, match=r"metadata\(tier='pfs'\): there is no such tier"):
        ckpt.metadata_sync(1, tier="pfs")
    with pytest.raises(ValueError):
        ckpt.metadata_sync(-1)


def test_a_manifest_that_does_not_verify_is_named(opened: Opened, tmp_path: Path) -> None:
    config = ram_fs(tmp_path / "nvme", capacity="16MiB")
    ckpt = opened(config)
    assert ckpt.save_sync(1, {"w": torch.ones(10)}, metadata={"a": 1}).committed_sync("nvme", timeout=60)
    ckpt.close_sync()
    manifest = tmp_path / "nvme" / version_dirname(1) / MANIFEST_FILE
    flip_bits(manifest, manifest.stat().st_size // 2, 1)
    ckpt = opened(config)
    with pytest.raises(CorruptCheckpointError, match=r"step 1: no copy's manifest verifies \(tier 'nvme': "):
        ckpt.metadata_sync(1)
