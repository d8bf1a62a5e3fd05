"""Which lineage the next save gets (:mod:`tierckpt.format.lineage` holds the rule and its record).

One :class:`Direction` per Checkpointer, on the engine thread. It knows the highest serial the job
has seen (every tier at construction, every rank's, and each save since) and the version the next save
descends from: the one a restore loaded, this process's previous save, or, for a first save without a
restore, the newest save held when the process began (a job that resumed by other means, or trains on
without resuming, goes on from the latest direction). Of several ranks every rank
makes the same calls in the same order (saves and restores are collective), from the same highest
serial (agreed at construction), so every rank gives a save the same lineage.
"""

from __future__ import annotations

from tierckpt.format.lineage import Cut, Lineage

__all__ = ["Direction"]


class Direction:
    """The serial and cuts of each save of this process (see :mod:`tierckpt.format.lineage`)."""

    def __init__(self) -> None:
        self.known = 0  # the highest serial seen
        # The newest save held when this process began (step, its lineage; None: it has none): a first
        # save without a restore goes on from it, as training that resumed by other means does.
        self._head: tuple[int, Lineage | None] | None = None
        # The version the next save descends from: (step, its lineage; None: it has none); None: no
        # restore and no save yet in this process.
        self._parent: tuple[int, Lineage | None] | None = None
        self._restored = False  # whether the parent is a restored version (not this process's previous save)

    def held(self, step: int, lineage: Lineage | None, highest: int) -> None:
        """What the tiers hold at construction (of several ranks, every rank's): the newest save (its step,
        -1 for none, and lineage) and the highest serial. The next save is numbered above it."""
        if step >= 0 and (self._head is None or (_serial(lineage), step) > (_serial(self._head[1]), self._head[0])):
            self._head = (step, lineage)
        self.known = max(self.known, highest, _serial(lineage))

    def restored(self, step: int, lineage: Lineage | None) -> None:
        """A restore loaded version ``step`` (its lineage, if it has one): the next save descends from it."""
        self._parent = (step, lineage)
        self._restored = True

    def next(self, step: int) -> Lineage:
        """The lineage of a save of ``step`` made now (each call is one save: its serial is taken)."""
        serial = self.known + 1
        cuts: list[Cut] = []
        parent = self._parent if self._parent is not None else self._head
        if parent is None:  # nothing was held: a first save
            made = Lineage(serial)
        else:
            at, lineage = parent
            if self._parent is not None and self._restored:
                if _serial(lineage) < self.known:  # saved after the restored version: another direction
                    cuts.append(Cut(0, _serial(lineage), serial))
                if lineage is None:  # restored from a version without a lineage: those above it are left
                    cuts.append(Cut(at + 1, -1, 1))
            # Going back, or saving a restored or held step again: what was saved at or above it is
            # left. The step this process saved last, saved again with no restore between (Lightning's top-k
            # file, then last.ckpt, at one step), goes on from that save: cut, the earlier save (maybe
            # the only durable one) would be left, and retention would delete it.
            if step < at or (step == at and (self._parent is None or self._restored)):
                cuts.append(Cut(step, -1, serial))
            made = (lineage if lineage is not None else Lineage(0)).then(serial, *cuts)
        self.known = serial
        self._parent = (step, made)
        self._restored = False
        return made


def _serial(lineage: Lineage | None) -> int:
    return 0 if lineage is None else lineage.serial
