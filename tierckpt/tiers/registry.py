"""Which class makes a tier below host memory, by its config's ``type``: the one place that knows them.

Each type has a maker (:data:`MAKERS`) that takes the tier's config and where it runs
(:class:`Placement`); a new kind of tier is one more entry, and nothing that assembles a
Checkpointer names a tier class. The object tier's module is imported only by a config that has one
(it brings obstore).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tierckpt.config import TierConfig
from tierckpt.ranks.group import RankGroup
from tierckpt.tiers.base import Tier
from tierckpt.tiers.filesystem import FilesystemTier
from tierckpt.tiers.nodelocal.tier import NodeLocalTier
from tierckpt.tiers.peer import PeerTier

__all__ = ["MAKERS", "Placement", "make_tier"]


@dataclass(frozen=True)
class Placement:
    """Where a tier runs: the ranks saving together (None: one process), this node's name (for a
    node-local tier), and the host-memory tier's config (a peer tier keeps its copies beside its pool)."""

    group: RankGroup | None
    node_name: Callable[[], str]
    memory: TierConfig


def _filesystem(cfg: TierConfig, where: Placement) -> Tier:
    group = where.group
    if cfg.scope == "node" and group is not None and group.nodes is not None and len(group.nodes) > 1:
        return NodeLocalTier(cfg, group, group.nodes, where.node_name())
    return FilesystemTier(cfg, group)  # of one node, its ranks share its directory as they do a shared one


def _object(cfg: TierConfig, where: Placement) -> Tier:
    from tierckpt.tiers.object.tier import ObjectTier  # obstore is imported only by a config that has one

    return ObjectTier(cfg, where.group)


def _peer(cfg: TierConfig, where: Placement) -> Tier:
    group = where.group
    assert group is not None and group.nodes is not None  # check_peer made sure
    # Copies live beside the memory tier's pool, so that they too outlive the process.
    memory = where.memory.path
    root = None if memory is None else Path(memory).expanduser().absolute() / f"{cfg.name}-rank-{group.rank:05d}"
    return PeerTier(cfg, group, root)


MAKERS: dict[str, Callable[[TierConfig, Placement], Tier]] = {"filesystem": _filesystem, "object": _object, "peer": _peer}


def make_tier(cfg: TierConfig, where: Placement) -> Tier:
    """The tier ``cfg`` names, below host memory (config validation allows a memory tier only first)."""
    return MAKERS[cfg.type](cfg, where)
