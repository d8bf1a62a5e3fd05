"""Which versions make up the direction being trained: each save's lineage, kept in its commit record,
and the one rule that reads it (:func:`head`, :func:`is_live`, :func:`newest_first`).

Training goes back: a job restores an earlier step (after a loss spike, a bad data shard, a change of
learning rate) and trains on in another direction. Its new saves must then be "the latest", although
the abandoned direction holds higher steps; picking the highest step, as DCP users, torchtitan, NVRx
and the HF Trainer do, resumes the direction that was given up.

**The serial.** Every ``save()`` call gets a serial, one more than any serial the job has seen
(every tier, every rank, across restarts: :class:`~tierckpt.pipeline.direction.Direction`). It orders
the saves by their *call*, not by their commit: a flush of the abandoned direction that commits after
the first new save still has the lower serial.

**The cuts.** A save's lineage is its serial and the *cuts* it inherits from the save it descends
from. A cut ``(step, after, before)`` says: a save numbered strictly between ``after`` and ``before``
whose step is at least ``step`` is not an ancestor. A save adds one when it leaves a direction:

- the first save after a restore of a version numbered ``r``, when saves were numbered after ``r``:
  ``(0, r, serial)``, every save made after the restored one (the direction given up, and what a
  flush of it still commits);
- a save of a step not above the step it descends from (a restored version's, the same process's
  previous save's), or a process's first save without a restore while versions exist: ``(step, -1,
  serial)``, every earlier save at this step or above (saving a step again replaces it).

The cuts of a lineage are inherited whole (at most :data:`MAX_CUTS`, the newest), so a version still
knows which versions it does not descend from after every version between them was deleted.

**The rule.** The *head* is the version with the highest serial (then the highest step) whose record
verified, on any tier and any rank. A version is *live* when it is the head's save or an earlier save
that no cut of the head excludes; otherwise it is *abandoned*. ``restore_latest()`` tries the live
versions, newest serial first; ``restore(step)`` a live copy of the step first; retention counts the
live versions (:func:`tierckpt.policy.retain`) and keeps ``keep.abandoned`` of the others.

Versions saved before lineages were recorded have none: they count as serial 0 with no cuts (among
themselves the highest step is the newest, as before).

The lineage is stored in the version's metadata map under :data:`KEY` (so every tier's record keeps
it: a manifest, a commit marker, a host-memory snapshot), and taken out again before the metadata
reaches the user (:func:`user_metadata`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence, TypeVar

__all__ = ["KEY", "MAX_CUTS", "Cut", "Lineage", "Ordered", "decoded", "head", "is_live", "lineage_of", "marked", "newest", "newest_first", "user_metadata"]

KEY = "tierckpt.lineage"  # the metadata key the lineage is stored under
MAX_CUTS = 256  # a lineage keeps its newest cuts: one per rollback, so far more than a job makes
_MAX_INT = 1 << 62


@dataclass(frozen=True, order=True)
class Cut:
    """Saves numbered strictly between ``after`` and ``before`` with a step of at least ``step`` are
    not ancestors (see the module docstring)."""

    step: int
    after: int
    before: int

    def excludes(self, step: int, serial: int) -> bool:
        return step >= self.step and self.after < serial < self.before


@dataclass(frozen=True)
class Lineage:
    """A save's serial and the cuts it inherits (see the module docstring)."""

    serial: int
    cuts: tuple[Cut, ...] = ()

    def descends(self, step: int, serial: int) -> bool:
        """Whether the save numbered ``serial`` of ``step`` is this save or one of its ancestors."""
        if serial == self.serial:
            return True
        return serial < self.serial and not any(c.excludes(step, serial) for c in self.cuts)

    def then(self, serial: int, *cuts: Cut) -> Lineage:
        """The lineage of a save numbered ``serial`` that descends from this one, adding ``cuts``."""
        kept = (self.cuts + cuts)[-MAX_CUTS:]
        return Lineage(serial, kept)

    def encode(self) -> list[Any]:
        return [self.serial, [[c.step, c.after, c.before] for c in self.cuts]]

    @classmethod
    def decode(cls, value: Any) -> Lineage:
        """From :meth:`encode`'s form (untrusted bytes: every field checked).

        Raises:
            ValueError: it is not a lineage.
        """
        if type(value) is not list or len(value) != 2 or type(value[1]) is not list or len(value[1]) > MAX_CUTS:
            raise ValueError(f"a lineage is [serial, [[step, after, before], ...]] with at most {MAX_CUTS} cuts")
        serial = _int(value[0])
        cuts = []
        for c in value[1]:
            if type(c) is not list or len(c) != 3:
                raise ValueError("a cut is [step, after, before]")
            cuts.append(Cut(_int(c[0]), _int(c[1], low=-1), _int(c[2])))
        return cls(serial, tuple(cuts))


def _int(value: Any, low: int = 0) -> int:
    if type(value) is not int or not low <= value < _MAX_INT:
        raise ValueError(f"{value!r} is not an int in {low}..2**62")
    return value


def lineage_of(metadata: Mapping[str, Any]) -> Lineage | None:
    """The lineage a version's metadata holds; None when it has none (saved before lineages were
    recorded) or holds something else there (counted as such a version, never trusted)."""
    return decoded(metadata.get(KEY))


def decoded(raw: Any) -> Lineage | None:
    """:meth:`Lineage.decode` of ``raw`` (as ranks exchange it, or a record holds it); None for
    None or for anything that is not a lineage."""
    if raw is None:
        return None
    try:
        return Lineage.decode(raw)
    except ValueError:
        return None


def user_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata as ``save(metadata=...)`` gave it: without the lineage."""
    return {k: v for k, v in metadata.items() if k != KEY}


class Ordered(Protocol):
    """A version as the rule sees it (a :class:`~tierckpt.tiers.base.VersionInfo`)."""

    @property
    def step(self) -> int: ...

    @property
    def lineage(self) -> Lineage | None: ...

    @property
    def created(self) -> float: ...


V = TypeVar("V", bound=Ordered)


def serial(v: Ordered) -> int:
    return 0 if v.lineage is None else v.lineage.serial


def order_key(v: Ordered) -> tuple[int, int, float]:
    """Larger is newer: the serial, then (versions without a lineage) the step, then the save time."""
    return serial(v), v.step, v.created


def newest(versions: Iterable[V]) -> V | None:
    """The newest save among ``versions`` (:func:`order_key`), or None when there is none."""
    return max(versions, key=order_key, default=None)


def head(versions: Iterable[Ordered]) -> Lineage | None:
    """The lineage of the newest save among ``versions`` (those whose records verified); None when
    none has one (every version's is then live)."""
    best = newest(versions)
    return None if best is None else best.lineage


def is_live(v: Ordered, top: Lineage | None) -> bool:
    """Whether ``v`` belongs to the direction of the save ``top`` (see the module docstring)."""
    return top is None or top.descends(v.step, serial(v))


def newest_first(versions: Sequence[V], top: Lineage | None) -> list[V]:
    """``versions`` in the order a restore tries them: the live ones, newest save first, then the
    abandoned ones, newest save first (stable among equals: a copy of one save on several tiers keeps
    the tiers' order)."""
    return sorted(versions, key=lambda v: (not is_live(v, top), tuple(-x for x in order_key(v))))


def marked(versions: Sequence[V]) -> list[V]:
    """``versions`` (every tier's: :class:`~tierckpt.tiers.base.VersionInfo`) with ``abandoned`` set
    on those the newest save among them does not descend from."""
    top = head(v for v in versions if getattr(v, "valid", True))
    return [v if is_live(v, top) else dataclasses.replace(v, abandoned=True) for v in versions]  # type: ignore[type-var]
