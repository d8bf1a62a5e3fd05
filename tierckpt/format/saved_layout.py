"""A saved version as the job that wrote it laid it out: every key's global tensor and its stored pieces.

A rank of a job with another layout (another number of ranks, other placements, or one process
consolidating) restores from the saved *layout*, not from one rank's part: for each key it needs the
global shape and dtype and the pieces that cover it. A DTensor's pieces are the local shards the
saving ranks stored, each with its region (global shape, offset); replicas of one piece were stored
once and are listed once. A value that is not a DTensor was saved by each rank for itself: a
restoring rank takes the one its *home* rank saved (the rank of the same number, or rank 0 where the
saved job had fewer ranks), along with that rank's skeleton, the structure of the state it returns.

Reading every rank's manifest costs one small read per saved rank per restoring rank; the data files
are opened only for the pieces a rank needs (:meth:`SavedLayout.open`).

This module is the model: what a stored version holds, in any layout. It sits in the format, below
the tiers that build one (a filesystem tier from its manifests:
:func:`tierckpt.tiers.stored.layout.filesystem_layout`; any tier from one whole source: :func:`source_layout`)
and the restore that plans a load from it (:func:`tierckpt.restore.plan.plan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.layout import where
from tierckpt.format.manifest import Manifest
from tierckpt.format.records import TensorRecord
from tierckpt.format.source import VersionSource

__all__ = ["Box", "NotHere", "Piece", "SavedLayout", "global_shape", "home_rank", "source_layout"]

# A box of a tensor, in some tensor's coordinates: (start, size), one int per dimension. Its
# arithmetic (and the copies between boxes) is the restore's: tierckpt.restore.boxes.
Box = tuple[tuple[int, ...], tuple[int, ...]]


class NotHere(Exception):
    """This tier holds only part of a version (one rank's host memory), not the pieces a layout needs."""


@dataclass(frozen=True)
class Piece:
    """One stored piece of a key's global tensor: its box in global coordinates and its record."""

    box: Box
    record: TensorRecord


def home_rank(rank: int, saved_world: int) -> int:
    """The saved rank whose skeleton and own (non-DTensor) values rank ``rank`` restores."""
    return rank if rank < saved_world else 0


def global_shape(record: TensorRecord) -> tuple[int, ...]:
    return record.region.global_shape if record.region is not None else record.shape


def _box(record: TensorRecord) -> Box:
    if record.region is not None:
        return record.region.offset, record.shape
    return (0,) * len(record.shape), record.shape


class SavedLayout:
    """The keys, global shapes and stored pieces of one saved version, for one restoring rank.

    Attributes:
        tier, step, created, metadata: of the version.
        world: how many ranks saved it.
        home: the saved rank whose skeleton and own values this rank restores (:func:`home_rank`).
        skeleton, records: the home rank's: the structure of the state a restore returns, one record
            per leaf.
        complete: whether every rank's part is here (host memory holds only this process's part).
    """

    def __init__(
        self,
        *,
        tier: str | None,
        step: int,
        created: float,
        metadata: dict[str, Any],
        world: int,
        parts: Mapping[int, Manifest],
        home: int,
        complete: bool,
        open: Callable[[Sequence[TensorRecord], bool], VersionSource],
    ) -> None:
        self.tier, self.step, self.created, self.metadata = tier, step, created, metadata
        self.world, self.home, self.complete = world, home, complete
        self.skeleton = parts[home].skeleton
        self.records = parts[home].records
        self._open = open
        # key -> pieces of a DTensor, each stored piece once (its replicas stored it between them).
        self._pieces: dict[str, dict[tuple[int, ...], TensorRecord]] = {}
        for q in sorted(parts):
            for r in parts[q].records:
                if r.region is None:
                    continue
                seen = self._pieces.setdefault(r.key, {})
                first = next(iter(seen.values()), None)
                if first is not None and (first.kind, first.dtype, global_shape(first)) != (r.kind, r.dtype, global_shape(r)):
                    raise self._corrupt(
                        f"{r.key} is {first.dtype}{list(global_shape(first))} in one rank's part and "
                        f"{r.dtype}{list(global_shape(r))} in rank {q}'s",
                        r.key,
                    )
                seen.setdefault(r.region.offset, r)
        if complete:
            for key, found in self._pieces.items():
                whole = math.prod(global_shape(next(iter(found.values()))))
                stored = sum(math.prod(r.shape) for r in found.values())
                if stored != whole:
                    raise self._corrupt(f"{key}: its stored pieces hold {stored} of its {whole} elements", key)

    def _corrupt(self, why: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where(self.tier, self.step)}: {why}", tier=self.tier, step=self.step, key=key)

    def pieces(self, record: TensorRecord) -> list[Piece]:
        """The stored pieces covering the global tensor of ``record`` (one of :attr:`records`)."""
        if record.region is None:
            return [Piece(_box(record), record)]
        found = self._pieces.get(record.key, {})
        return [Piece(_box(r), r) for r in found.values()]

    def open(self, records: Sequence[TensorRecord], *, shared: bool = False) -> VersionSource:
        """A source that reads (and verifies) the chunks of these pieces' records (blocking).

        ``shared``: other ranks read the same chunks too; read them through the page cache.
        """
        return self._open(records, shared)


def source_layout(source: VersionSource, *, complete: bool) -> SavedLayout:
    """The layout of a version one source holds whole (host memory, one process's snapshot).

    ``complete``: the source holds every saving rank's part (it was saved by one process).
    """
    part = Manifest(source.step, source.created, source.skeleton, tuple(source.records), dict(source.metadata))
    return SavedLayout(
        tier=source.tier,
        step=source.step,
        created=source.created,
        metadata=dict(source.metadata),
        world=1,
        parts={0: part},
        home=0,
        complete=complete,
        open=lambda records, shared: source,
    )
