"""Storage tiers: host memory and file systems, behind one interface."""

from tierckpt.tiers.base import Lease, Staged, Tier, VersionInfo, VersionSource
from tierckpt.tiers.filesystem import FilesystemTier
from tierckpt.tiers.memory.tier import MemoryTier

__all__ = ["FilesystemTier", "Lease", "MemoryTier", "Staged", "Tier", "VersionInfo", "VersionSource"]
