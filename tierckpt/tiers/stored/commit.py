"""Publishing a staged version on a byte store, and taking it back: a stored tier's commit.

Replacing a committed version of the same step on a file system takes two renames (a non-empty
directory cannot be renamed over): the old one goes to ``.replaced-step-...`` first. An object store
publishes over the older version in one request, and names where the older write's objects wait.
:func:`place` returns that name for the caller to remove once the new version is final and no longer
read (on a node-local tier, once every node committed). :func:`take_back` undoes a placement as far as the disk allows, and says
what it left (:class:`Left`): never is a committed version removed by it.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from tierckpt.storage.store import ByteStore
from tierckpt.tiers.stored.sweep import REPLACED

log = logging.getLogger("tierckpt")


@dataclass(frozen=True)
class Left:
    """What a take-back could not undo (both false/None: the directory is as before the placement)."""

    new_in_place: bool = False  # the new version is still in place (whole, fsynced; only its rename unconfirmed)
    old_aside: str | None = None  # the old version still waits under this name (the next open puts it back)


class PlaceFailed(Exception):
    """:func:`place` failed and was taken back; ``left`` says what stayed, ``__cause__`` why it failed."""

    def __init__(self, left: Left) -> None:
        super().__init__("placing a version failed")
        self.left = left


async def place(store: ByteStore, staging: str, final: str, *, tier: str) -> str | None:
    """Publish ``staging`` as ``final`` and sync; returns where an older ``final`` was moved aside.

    Raises:
        OSError: from the first rename (nothing moved then).
        PlaceFailed: a later step failed, and :func:`take_back` ran (``__cause__``: the failure).
    """
    old = None
    if not store.replaces_in_place and await store.exists(final):
        old = f"{REPLACED}{final}-{uuid.uuid4().hex[:12]}"
        await store.withdraw(final, old)  # if this fails, nothing moved
    moved = False
    try:
        old = await store.publish(staging, final) or old  # an object store's older write waits under its own name
        moved = True
        await store.sync()
    except BaseException as exc:
        left = await take_back(store, staging, final, old, moved=moved, tier=tier)
        raise PlaceFailed(left) from exc
    return old


async def take_back(store: ByteStore, staging: str, final: str, old: str | None, *, moved: bool, tier: str) -> Left:
    """Put the store back as it was before :func:`place`: ``final`` back to ``staging`` (when
    ``moved``), ``old`` back to ``final``, synced. What the disk refuses stays, logged."""
    try:
        if moved:
            await store.withdraw(final, staging)
            moved = False
        if old is not None:
            await store.publish(old, final)
            old = None
        await store.sync()
    except OSError as exc:
        if moved:
            log.error("tier %r: %s could not be taken back after its commit failed (%s); it stays in place", tier, final, exc)
            return Left(new_in_place=True, old_aside=old)
        if old is not None:
            log.error(
                "tier %r: the committed %s could not be put back from %s (%s); the tier puts it back when it next opens",
                tier, final, old, exc,
            )
            return Left(old_aside=old)
        log.warning("tier %r: a sync failed after %s was taken back: %s", tier, final, exc)
    return Left()
