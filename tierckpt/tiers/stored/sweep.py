"""What a filesystem tier finds at its root when it opens: versions to index, leftovers to sweep.

The names are the tier's, not the store's: ``step-<12 digits>`` a committed version (once it holds a
manifest), ``.tmp-`` a version being written, ``.trash-`` one being deleted, ``.replaced-step-…-<random>``
a committed version moved aside while a newer write of its step is committed, ``.member-<run>`` the
leader's sign that the followers see its directory, ``.direct-probe-`` the store's O_DIRECT probe.
:func:`classify` is pure; :func:`sweep` goes through a :class:`~tierckpt.storage.store.ByteStore`, so
a tier over another store sweeps the same way.

Only the leader sweeps (a follower only indexes): the other ranks' staging directories are not
leftovers while the job runs. A ``step-`` directory without a manifest was never committed and is
swept; one whose manifest is damaged is kept and indexed as not valid (never delete what may be
someone's only copy). A ``.replaced-`` copy is put back when its step has no committed version: the
crash came between the two renames of a replacement.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from tierckpt.format import MANIFEST_FILE, parse_version_dirname, version_dirname
from tierckpt.storage.posix import DIRECT_PROBE_PREFIX
from tierckpt.storage.store import ByteStore, RootEntry
from tierckpt.tiers.base import VersionInfo

log = logging.getLogger("tierckpt")

REPLACED = ".replaced-"  # + the step directory's name + "-<random>": a committed version being replaced
MEMBER = ".member-"  # + run id: the leader's sign that a follower sees the directory the leader sees
_LEFTOVERS = (".tmp-", ".trash-")

Describe = Callable[[int, str], Awaitable[VersionInfo]]
# Whether to keep a copy moved aside whose step has a version in place (else it is removed).
KeepAside = Callable[[int, str], Awaitable[bool]]


def classify(entry: RootEntry) -> str:
    """What a name at the root is: ``version``, ``replaced``, ``stale`` (an object to remove),
    ``leftover`` (a container to remove) or ``other`` (left alone)."""
    if entry.name.startswith(REPLACED):
        return "replaced"
    if entry.name.startswith((MEMBER, DIRECT_PROBE_PREFIX)) and not entry.container:
        return "stale"  # left by an earlier run's leader, or a probe file from a crash mid-probe
    if entry.name.startswith(_LEFTOVERS):
        return "leftover"
    if entry.container and parse_version_dirname(entry.name) is not None:
        return "version"
    return "other"


async def sweep(store: ByteStore, tier: str, *, leader: bool, describe: Describe, keep_aside: KeepAside | None = None) -> dict[int, VersionInfo]:
    """Index the committed versions at the store's root; the ``leader`` also sweeps what is no version.

    ``keep_aside``: asked of each copy moved aside whose step has a version in place (a node-local
    tier's, where the copy in place may be a save the other nodes never committed); None: removed."""
    index: dict[int, VersionInfo] = {}
    replaced = []
    for entry in await store.list():
        kind = classify(entry)
        if kind == "version":
            step = parse_version_dirname(entry.name)
            assert step is not None  # classify saw to it
            if await store.exists(f"{entry.name}/{MANIFEST_FILE}"):
                index[step] = await describe(step, entry.name)
            elif leader:
                log.warning("tier %r: sweeping %s: no manifest, so it was never committed", tier, entry.name)
                await store.remove(entry.name)
        elif not leader:
            continue
        elif kind == "replaced":
            replaced.append(entry.name)
        elif kind == "stale":
            await store.remove_object(entry.name)
        elif kind == "leftover":
            log.info("tier %r: sweeping %s left by an interrupted write or delete", tier, entry.name)
            await store.remove(entry.name)
    for name in replaced:
        await _recover_replaced(store, tier, name, index, describe, keep_aside)
    return index


async def _recover_replaced(
    store: ByteStore, tier: str, name: str, index: dict[int, VersionInfo], describe: Describe, keep_aside: KeepAside | None
) -> None:
    """A committed version moved aside by an interrupted replacement: put it back if it is the only copy."""
    step = parse_version_dirname(name[len(REPLACED) :].rsplit("-", 1)[0])
    if step is not None and step not in index:
        final = version_dirname(step)
        if not await store.exists(final) and await store.exists(f"{name}/{MANIFEST_FILE}"):
            log.warning("tier %r: restoring %s: its replacement was interrupted before it was committed", tier, final)
            await store.publish(name, final)
            await store.sync()
            index[step] = await describe(step, final)
            return
    if step is not None and step in index and keep_aside is not None and await keep_aside(step, name):
        return
    log.info("tier %r: sweeping %s left by an interrupted replacement", tier, name)
    await store.remove(name)
