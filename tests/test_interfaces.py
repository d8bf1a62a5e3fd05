"""The declared interfaces: the tier interface every tier implements (memory, filesystem, node-local,
object, peer), the group protocol of tiers several ranks write, and the hooks through which the memory
tier asks the pipeline (passed to constructors, never patched in afterwards).

Every tier is checked against the interface as a class; those one process can open (memory,
filesystem, a node-scoped filesystem tier of one node, and an object tier on the session's local S3
server) are driven through it too. A node-local tier across nodes and a peer tier need several ranks:
tests/test_node_local.py and tests/test_peer.py run them as real processes.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.capture.pool import HostPool
from tierckpt.config import FlushPolicy, TierConfig
from tierckpt.pipeline.pipeline import Pipeline
from tierckpt.pipeline.ranked import FollowerFlusher, LeaderFlusher
from tierckpt.testing.inspect import memory_hooks, pipeline_of, run_on_engine
from tierckpt.tiers.base import GroupTier, Tier
from tierckpt.tiers.filesystem import FilesystemTier
from tierckpt.tiers.memory.tier import MemoryTier
from tierckpt.tiers.nodelocal.tier import NodeLocalTier
from tierckpt.tiers.object.tier import ObjectTier
from tierckpt.tiers.peer import PeerTier

from helpers import assert_bitwise, fs_tier, memory_tier, ram_fs, small_state, tier_config, tier_of

MiB = 1 << 20

# Every kind of tier a configuration can name, as the class that stores it.
EVERY_TIER = {"memory": MemoryTier, "filesystem": FilesystemTier, "node-local": NodeLocalTier, "object": ObjectTier, "peer": PeerTier}
GROUP_TIERS = {name: kind for name, kind in EVERY_TIER.items() if name != "memory"}
ASYNC_METHODS = ("open", "read", "read_whole", "read_layout", "write", "commit", "abort", "delete", "close")
SYNC_METHODS = ("versions", "lease", "has_part", "leased", "on_release")


@pytest.mark.parametrize("kind", list(EVERY_TIER.values()), ids=list(EVERY_TIER))
def test_every_tier_implements_the_tier_interface(kind: type) -> None:
    assert issubclass(kind, Tier)
    assert not kind.__abstractmethods__
    for name in ASYNC_METHODS:
        assert inspect.iscoroutinefunction(getattr(kind, name)), (kind, name)
    for name in SYNC_METHODS:
        assert callable(getattr(kind, name)) and not inspect.iscoroutinefunction(getattr(kind, name)), (kind, name)
    assert isinstance(inspect.getattr_static(kind, "threads"), property)
    assert isinstance(inspect.getattr_static(kind, "place"), property)


@pytest.mark.parametrize("kind", list(GROUP_TIERS.values()), ids=list(GROUP_TIERS))
def test_every_tier_below_host_memory_speaks_the_group_protocol(kind: type) -> None:
    assert issubclass(kind, GroupTier)
    for step in ("write", "seal", "commit", "abort", "settle", "adopt", "forget"):
        assert inspect.iscoroutinefunction(getattr(kind, step)), (kind, step)


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
    with Checkpointer(ram_fs(tmp_path / "disk", name="disk", capacity="4MiB")) as ckpt:
        pipeline = pipeline_of(ckpt)
        assert isinstance(pipeline, Pipeline)
        assert memory_hooks(pipeline.memory) is pipeline  # constructor injection: no attribute set afterwards
        ckpt.save_sync(1, {"w": torch.arange(10.0)}).committed_sync("disk", timeout=60)


# -- every tier one process can open, driven through the interface --------------------------------------------


def _below(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The tier section ``kind`` names, below host memory, as tier "t"."""
    if kind == "filesystem":
        return fs_tier("t", tmp_path / "t")
    if kind == "node-scoped":  # one process, so one node: its ranks share the node's directory
        return fs_tier("t", tmp_path / "local-{node}" / "t", scope="node")
    s3 = request.getfixturevalue("s3")  # the session's local S3 server (no AWS metadata service)
    return s3.tier("t", prefix=s3.prefix)


@pytest.mark.parametrize("kind", ["memory", "filesystem", "node-scoped", "object"])
def test_each_tier_one_process_opens_answers_through_the_interface(kind: str, tmp_path: Path, opened: Any, request: pytest.FixtureRequest) -> None:
    if kind == "memory":
        config = tier_config(ram=memory_tier("t", keep={"last": 2}), capacity="4MiB", snapshots=3)
    else:
        config = tier_config(_below(kind, tmp_path, request), capacity="4MiB", snapshots=2)
    ckpt = opened(config)
    for step in (3, 7):
        assert ckpt.save_sync(step, small_state(step)).committed_sync("t", timeout=60) is True
    tier = tier_of(ckpt, "t")
    assert isinstance(tier, Tier) and type(tier) is {"memory": MemoryTier, "object": ObjectTier}.get(kind, FilesystemTier)

    async def ask() -> None:  # on the engine thread, where the pipeline calls its tiers
        assert [v.step for v in tier.versions()] == [3, 7]  # committed, oldest first
        assert all(tier.has_part(step) for step in (3, 7))
        with pytest.raises(KeyError):
            tier.lease(5)  # not held: a reader moves on
        with tier.lease(3):
            assert tier.leased(3) and not tier.leased(7)
            source = await tier.read(3)
            try:
                assert (source.tier, source.step) == ("t", 3)
                assert sorted(r.key for r in source.records) == sorted(["['w']", "['b']"])
            finally:
                source.close()
        assert not tier.leased(3)
        assert tier.threads >= 1

    run_on_engine(ckpt, ask())
    assert [(v.tier, v.step) for v in ckpt.versions() if v.tier == "t"] == [("t", 3), ("t", 7)]
    for step in (3, 7):
        restored = ckpt.restore_sync(step, tier="t")
        assert (restored.step, restored.tier) == (step, "t")
        assert_bitwise(restored.state, small_state(step))
