"""Many ranks, one checkpoint: the group the ranks coordinate in, and how a version is committed by all."""

from tierckpt.ranks.group import CoordinationLost, RankGroup

__all__ = ["CoordinationLost", "RankGroup"]
