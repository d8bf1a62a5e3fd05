"""What is committed across node-local directories, from what each node's keeper reports (pure).

Each node's keeper reports a :class:`Holding` per version its directory holds; :func:`complete_versions`
says which steps are committed across the nodes and where each rank's part is. Used by
:class:`~tierckpt.tiers.nodelocal.tier.NodeLocalTier` at construction, on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tierckpt.format import CommitMarker
from tierckpt.format.lineage import Lineage, decoded, lineage_of

__all__ = ["Holding", "complete_versions"]


@dataclass(frozen=True)
class Holding:
    """One version in one node's directory, as its keeper reports it at construction."""

    step: int
    world: int  # the world size that saved it
    parts: tuple[int, ...]  # every rank's manifest checksum, from the marker: the version's identity
    holds: tuple[int, ...]  # the ranks whose parts this directory holds
    created: float
    nbytes: int
    aside: str | None = None  # a copy moved aside by a replacement that was cut short: its name
    base: int | None = None  # a differential version's base step, as the marker names it
    chain: int = 0
    lineage: Lineage | None = None  # which save it is (tierckpt.format.lineage), as the marker records it

    def pack(self) -> list[Any]:
        lineage = None if self.lineage is None else self.lineage.encode()
        return [self.step, self.world, list(self.parts), list(self.holds), self.created, self.nbytes, self.aside, self.base, self.chain, lineage]

    @classmethod
    def unpack(cls, raw: Sequence[Any]) -> Holding:
        step, world, parts, holds, created, nbytes, aside, base, chain, lineage = raw
        return cls(
            int(step), int(world), tuple(parts), tuple(holds), float(created), int(nbytes), aside, None if base is None else int(base), int(chain),
            decoded(lineage),
        )

    @classmethod
    def of(cls, marker: CommitMarker, aside: str | None = None) -> Holding:
        """What a node's commit marker says (one naming the ranks its directory ``holds``)."""
        assert marker.holds is not None
        parts = tuple(p[1] for p in marker.ranks)
        lineage = lineage_of(marker.metadata)
        return cls(marker.step, marker.world_size, parts, marker.holds, marker.created, marker.stored_bytes, aside, marker.base, marker.chain, lineage)


def complete_versions(reports: dict[int, list[Holding]], world: int) -> dict[int, tuple[dict[int, int], Holding]]:
    """The steps committed across the nodes: ``{step: ({rank: node holding its part}, holding)}``.

    ``reports``: what each node's directory holds (by node index). A step counts when the nodes
    holding one version of it (their markers name the same parts), saved by ``world`` ranks, together
    hold every rank's part; ``holding`` is then this version's holding on the first of them. A node
    may hold two versions of a step (one in place, one moved aside by a replacement cut short): the
    one in place on the most nodes is taken first.

    Example:
        >>> a = Holding(5, 2, (11, 22), (0,), 1.0, 8)
        >>> b = Holding(5, 2, (11, 22), (1,), 1.0, 8)
        >>> complete_versions({0: [a], 1: [b]}, 2)[5][0]
        {0: 0, 1: 1}
        >>> complete_versions({0: [a]}, 2)
        {}
    """
    by_step: dict[int, list[tuple[int, Holding]]] = {}
    for node, held in sorted(reports.items()):
        for h in held:
            by_step.setdefault(h.step, []).append((node, h))
    complete = {}
    for step, found in sorted(by_step.items()):
        versions = sorted({h.parts for _, h in found if h.world == world}, key=lambda p: -sum(h.parts == p and h.aside is None for _, h in found))
        for parts in versions:
            nodes = [(node, h) for node, h in found if h.parts == parts and h.world == world]
            where = {r: node for node, h in nodes for r in h.holds}
            if sorted(where) == list(range(world)):
                complete[step] = (dict(sorted(where.items())), nodes[0][1])
                break
    return complete
