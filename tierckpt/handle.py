"""What each save returns: :class:`SaveHandle`, to wait for the host copy or for a tier."""

from __future__ import annotations

import asyncio
import concurrent.futures

from tierckpt.pipeline import SaveTracker


class SaveHandle:
    """What :meth:`Checkpointer.save` returns: lets the caller wait for the copy or for a tier.

    Example::

        handle = await ckpt.save(step, state)
        await handle.committed("nvme")   # True once durable there; False if that tier will not get it
    """

    def __init__(self, tracker: SaveTracker) -> None:
        self._tracker = tracker

    @property
    def step(self) -> int:
        return self._tracker.step

    @property
    def skipped(self) -> bool:
        """True when the save did not happen: every host slot was busy under ``on_full: skip`` (or, under
        ``evict``, every slot was being read)."""
        return self._tracker.token == 0

    async def captured(self) -> bool:
        """Wait for the host copy; True when done, False for a skipped save; raises FlushError if it failed."""
        return await asyncio.wrap_future(self._tracker.captured)

    async def committed(self, tier: str) -> bool:
        """Wait until the version is committed on ``tier`` (True) or will never be (False).

        False means the tier's flush policy passed it over, a newer version it selected (or a newer
        save of the same step) replaced it, it was evicted from host memory before the tier could
        take it (``host.on_full: evict``), or the Checkpointer closed before it was due.

        Raises:
            FlushError: writing it to ``tier`` failed (a full disk, a quota, EIO, EACCES, ...): names
                the tier, the step, and the ``errno`` and path (``filename``) of the failed call. The
                tier keeps its earlier versions, gives back the space of this attempt, and its next
                flush tries again; a later ``save()`` does not raise it. Also raised when the capture
                itself failed.
        """
        return await asyncio.wrap_future(self._future(tier))

    def captured_sync(self, timeout: float | None = None) -> bool:
        return self._tracker.captured.result(timeout)

    def committed_sync(self, tier: str, timeout: float | None = None) -> bool:
        return self._future(tier).result(timeout)

    def _future(self, tier: str) -> concurrent.futures.Future[bool]:
        try:
            return self._tracker.committed[tier]
        except KeyError:
            raise KeyError(f"no tier named {tier!r}; tiers are {sorted(self._tracker.committed)}") from None

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}{', skipped' if self.skipped else ''})"
