"""What the memory tier asks of the pipeline above it: whether the tiers below still want a snapshot
kept in host memory, and what happened to one they wanted (:mod:`tierckpt.pipeline.sources` answers)."""

from __future__ import annotations

import enum
import time
from typing import Protocol

from tierckpt.format.lineage import Lineage
from tierckpt.snapshot import Snapshot


class Want(enum.Enum):
    """Whether the tiers below still want a captured snapshot from host memory."""

    NO = "no"  # no tier waits for it: retention may drop it
    ELSEWHERE = "elsewhere"  # a tier waits for it, and a stored tier above that one holds it too:
    # kept while its slot is not needed (a read from RAM is fastest), given way to a save that needs one
    ONLY_HERE = "only here"  # a tier waits for it and nothing else holds it: kept (on_full: evict excepted)


class MemoryHooks(Protocol):
    """What the memory tier asks of the pipeline above it (all on the engine thread)."""

    def wanted(self, snapshot: Snapshot, incoming: tuple[int, int] | None) -> Want:
        """How much the tiers below still want ``snapshot``, given a save of (step, seq) that is
        about to take a slot (or None)."""

    def evicted(self, snapshot: Snapshot) -> None:
        """``snapshot`` was dropped under ``on_full: evict`` although a tier below wanted it from here."""

    def save_waits(self) -> None:
        """A save started waiting for a slot (a flusher deferring to a tier above goes now)."""

    def wall_clock(self) -> float:
        """Unix seconds, for ``keep.within``."""

    def held_direction(self) -> Lineage | None:
        """The lineage of the newest save on any tier, host memory's included: retention in host memory
        keeps the versions of its direction first (None: this tier's own newest)."""


class Alone:
    """The hooks of a memory tier with no tier below it (used on its own, as tests and tools do)."""

    def wanted(self, snapshot: Snapshot, incoming: tuple[int, int] | None) -> Want:
        return Want.NO

    def evicted(self, snapshot: Snapshot) -> None:
        pass

    def save_waits(self) -> None:
        pass

    def wall_clock(self) -> float:
        return time.time()

    def held_direction(self) -> Lineage | None:
        return None
