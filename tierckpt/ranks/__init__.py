"""Many ranks, one checkpoint: the group the ranks coordinate in (its store and bulk transfers), and
which ranks share a node. Leader-decided flushes are in :mod:`tierckpt.pipeline.ranked`, the restore
all ranks agree on in :mod:`tierckpt.restore`."""

from tierckpt.ranks.group import CoordinationLost, RankGroup

__all__ = ["CoordinationLost", "RankGroup"]
