"""What a filesystem tier finds at its root when it opens: versions to index, leftovers to sweep.

The names are the tier's, not the store's: ``step-<12 digits>`` a committed version (once it holds a
manifest), ``.tmp-`` a version being written, ``.trash-`` one being deleted, ``.replaced-step-…-<random>``
a committed version moved aside while a newer write of its step is committed, ``.member-<run>`` the
leader's sign that the followers see its directory, ``.direct-probe-`` the store's O_DIRECT probe,
``.damaged-step-…`` the mark ``tierckpt verify`` left of a version it found damaged
(:mod:`tierckpt.format.damage`).
:func:`classify` is pure; :func:`sweep` goes through a :class:`~tierckpt.storage.store.ByteStore`, so
a tier over another store sweeps the same way.

Only the leader sweeps (a follower only indexes): the other ranks' staging directories are not
leftovers while the job runs. A ``step-`` directory without a manifest was never committed and is
swept; one whose manifest is damaged is kept and indexed as not valid (never delete what may be
someone's only copy). A ``.replaced-`` copy is put back when its step has no committed version: the
crash came between the two renames of a replacement. A damage mark sets its version's
:attr:`~tierckpt.tiers.base.VersionInfo.damaged`; one of no version indexed (gone, or its step saved
again since), or that does not decode, is removed by the leader.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Awaitable, Callable

from tierckpt.format import damage
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
    """What a name at the root is: ``version``, ``replaced``, ``damage`` (a damage mark), ``stale``
    (an object to remove), ``leftover`` (a container to remove) or ``other`` (left alone)."""
    if not entry.container and damage.step_of(entry.name) is not None:
        return "damage"
    if entry.name.startswith(REPLACED):
        return "replaced"
    if entry.name.startswith((MEMBER, DIRECT_PROBE_PREFIX, damage.MARK_PREFIX)) and not entry.container:
        # Left by an earlier run's leader, a probe file from a crash mid-probe, a mark's temporary
        # file from a verify killed while writing it.
        return "stale"
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
    marks = []
    for entry in await store.list():
        kind = classify(entry)
        if kind == "damage":
            marks.append(entry.name)
        elif kind == "version":
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
    for name in marks:
        await _apply_mark(store, tier, name, index, leader=leader)
    return index


async def _apply_mark(store: ByteStore, tier: str, name: str, index: dict[int, VersionInfo], *, leader: bool) -> None:
    """Set the damage a mark names on its version's index entry; the leader removes a mark of no
    version indexed (a mark of an earlier save of the step, or of a version removed since)."""
    step = damage.step_of(name)
    info = index.get(step) if step is not None else None
    try:
        mark = damage.decode(await asyncio.to_thread(store.read_small, name, damage.MARK_BYTES))
    except OSError as exc:
        log.warning("tier %r: cannot read %s (%s): its version is not known as damaged", tier, store.where(name), exc)
        return
    if info is not None and info.valid and mark is not None and mark.created == info.created:
        index[info.step] = dataclasses.replace(info, damaged=mark.text)
    elif leader:
        log.info("tier %r: removing %s: it names no version held", tier, store.where(name))
        try:
            await store.remove_object(name)
        except OSError as exc:
            log.warning("tier %r: cannot remove %s (%s)", tier, store.where(name), exc)


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
