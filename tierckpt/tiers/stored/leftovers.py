"""What a stored tier has yet to remove from its store: containers a failed removal left, and the
earlier copies of steps saved again, kept while they are still read.

A removal can fail (a full disk, EIO, an object store that does not answer): the container is retried
before the tier's next write (a full disk is often freed between two writes) and swept at its next
open. An earlier copy of a step saved again (on a file system ``.replaced-step-…``, on an object store
the older write's objects and its commit object copied aside) stays while a restore or a flush still
reads the step, or while differential versions written against it depend on it; :meth:`Leftovers.drop`
removes those no longer needed.
"""

from __future__ import annotations

import logging
from typing import Callable

from tierckpt.storage.store import ByteStore

log = logging.getLogger("tierckpt")

__all__ = ["Leftovers"]


class Leftovers:
    """The containers tier ``tier`` has yet to remove from ``store`` (see the module docstring)."""

    def __init__(self, store: ByteStore, tier: str) -> None:
        self.store, self.tier = store, tier
        self.failed: set[str] = set()  # retried before each write
        self.earlier: dict[int, set[str]] = {}  # of a step saved again: its earlier copies, kept for now

    def keep(self, step: int, name: str) -> None:
        """Keep ``name``, an earlier copy of ``step``, until :meth:`drop` finds it no longer needed."""
        self.earlier.setdefault(step, set()).add(name)

    async def discard(self, name: str) -> OSError | None:
        """Remove container ``name``; what will not go is retried later.

        Never raises: returns the first error when part of ``name`` is left.
        """
        error = await self.store.remove(name)
        if error is None:
            self.failed.discard(name)
            return None
        self.failed.add(name)
        log.warning(
            "tier %r: could not remove all of %s (%s); retried before the next write, and swept when the tier next opens",
            self.tier, self.store.where(name), error,
        )
        return error

    async def retry(self) -> None:
        """Retry removing what earlier failures left.

        The store's root is synced first: a ``.trash-`` rename that never became durable must not have
        its files removed under a name a crash could bring back.
        """
        if not self.failed:
            return
        try:
            await self.store.sync()
        except OSError as exc:
            log.warning("tier %r: leftovers not swept: %s", self.tier, exc)
            return
        for name in sorted(self.failed):
            if await self.store.remove(name) is None:
                self.failed.discard(name)
                log.info("tier %r: swept %s, left by an earlier failure", self.tier, self.store.where(name))

    async def drop(self, needed: Callable[[int], bool]) -> None:
        """Remove the earlier copies of each step that is not ``needed`` any more."""
        for step in [s for s in self.earlier if not needed(s)]:
            for name in sorted(self.earlier.pop(step)):
                await self.discard(name)
