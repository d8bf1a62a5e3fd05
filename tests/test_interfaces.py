"""The declared interfaces: the group protocol of tiers several ranks write, and the hooks through
which the memory tier asks the pipeline (passed to constructors, never patched in afterwards)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.capture.pool import HostPool
from tierckpt.config import FlushPolicy, TierConfig
from tierckpt.pipeline.pipeline import Pipeline
from tierckpt.pipeline.ranked import FollowerFlusher, LeaderFlusher
from tierckpt.tiers.base import GroupTier
from tierckpt.tiers.filesystem import FilesystemTier
from tierckpt.tiers.memory import MemoryTier
from tierckpt.tiers.peer import PeerTier

MiB = 1 << 20


def test_the_group_protocol_is_declared_on_the_interface_and_implemented_by_both_group_tiers() -> None:
    steps = {"write", "seal", "commit", "abort", "adopt", "forget"}
    assert steps <= GroupTier.__abstractmethods__
    for tier in (FilesystemTier, PeerTier):
        assert issubclass(tier, GroupTier)
        assert not tier.__abstractmethods__
        for step in steps:
            assert inspect.iscoroutinefunction(getattr(tier, step)), (tier, step)
    assert not issubclass(MemoryTier, GroupTier)
    # Its docstring states the call order of both roles.
    doc = inspect.getdoc(GroupTier) or ""
    assert "Leader (rank 0):" in doc and "Follower (every other rank):" in doc


@pytest.mark.parametrize("kind", [LeaderFlusher, FollowerFlusher])
def test_a_rank_flusher_refuses_a_tier_that_is_not_a_group_tier(kind: type, tmp_path: Path) -> None:
    memory = MemoryTier(TierConfig(name="ram", type="memory"), HostPool(4 * MiB, 2))
    try:
        with pytest.raises(TypeError, match="cannot be written by several ranks"):
            kind(memory, FlushPolicy(), None, group=None, upstream=None, clock=lambda: 0.0)
    finally:
        memory.executor.shutdown()
        memory.pool.close()


def test_the_pipeline_makes_its_memory_tier_with_itself_as_the_hooks(tmp_path: Path) -> None:
    config = {
        "host": {"capacity": "4MiB", "snapshots": 2},
        "tiers": [{"name": "ram", "type": "memory"}, {"name": "disk", "type": "filesystem", "path": str(tmp_path / "disk")}],
    }
    with Checkpointer(config) as ckpt:
        pipeline = ckpt._pipeline
        assert isinstance(pipeline, Pipeline)
        assert pipeline.memory._hooks is pipeline  # constructor injection: no attribute set afterwards
        ckpt.save_sync(1, {"w": torch.arange(10.0)}).committed_sync("disk", timeout=60)
