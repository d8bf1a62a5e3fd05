"""Serving held copies back to their owners in a restore (:func:`tierckpt.restore.fallback.restore_versions`).

When a rank restarts without its host memory (its node was replaced, or its RAM directory wiped), the
copy of its part of a version that a peer holds is sent back to it over the bulk gloo group: the
holder sends a header (manifest length, data length; -1 when it cannot serve), the manifest, then the
chunks in record order; the owner receives them into its own replica directory and reads the copy from
there like a one-process version, every chunk verified against its checksum on the way
(:class:`FetchedCopy`). Every rank knows the plan (who fetches from whom) from the same exchange, so
each transfer has exactly one sender and one receiver posted, and nothing waits on a collective.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
from typing import Any, Protocol, Sequence

from tierckpt._buffers import prefaulting
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import MANIFEST_FILE, Manifest
from tierckpt.format.lineage import lineage_of
from tierckpt.tiers.base import Recovery, Tier, VersionInfo, VersionSource
from tierckpt.tiers.stored.check import check_records
from tierckpt.tiers.stored.read import open_source, read_manifest
from tierckpt.tiers import wire
from tierckpt.tiers.peer.replicas import ReplicaId, ReplicaStore
from tierckpt.tiers import transfer
from tierckpt.tiers.transfer import Ranked, announce, data_end, receive_announced, refuse

log = logging.getLogger("tierckpt")


class CopyHolder(Ranked, Protocol):
    """What serving and fetching copies use of a peer tier (:class:`~tierckpt.tiers.peer.tier.PeerTier`)."""

    @property
    def replicas(self) -> ReplicaStore: ...


class PeerRecovery(Recovery):
    """A peer tier's part in a restore: every rank reports the copies it holds for others; a rank
    wanting its part of a step fetches it from one of the ranks holding a copy."""

    def __init__(self, peer: CopyHolder) -> None:
        self._peer = peer
        self._holders: dict[tuple[int, int], list[int]] = {}  # (owner, step) -> the ranks holding a copy

    def report(self) -> list[list[int]]:
        """[owner, step] of every copy this rank holds for a job of the current world size."""
        peer = self._peer
        return [[h.owner, h.step] for h in peer.replicas.held() if h.world == peer.group.world]

    def reachable(self, reports: Sequence[Any]) -> list[set[int]]:
        self._holders = holders_of(list(reports))
        owned: list[set[int]] = [set() for _ in reports]
        for owner, step in self._holders:
            if 0 <= owner < len(owned):
                owned[owner].add(step)
        return owned

    async def fetch(self, step: int, wants: bool, held_open: contextlib.ExitStack) -> FetchedCopy | None:
        wanting = await asyncio.to_thread(self._peer.group.all_gather, wants)
        fetchers = fetch_plan(step, [r for r, w in enumerate(wanting) if w], self._holders)
        if not fetchers:
            return None
        return await exchange(self._peer, step, fetchers, held_open)


class FetchedCopy(Tier):
    """This rank's part of one version, fetched from a peer into its own replica directory for a restore."""

    def __init__(self, peer: CopyHolder, held: ReplicaId, manifest: Manifest, nbytes: int) -> None:
        super().__init__(peer.config)
        self.executor = peer.executor
        self._peer = peer
        self._held = held
        path = str(peer.replicas.path(held))
        self._info = VersionInfo(peer.name, held.step, nbytes, manifest.created, path, lineage=lineage_of(manifest.metadata))

    def versions(self) -> list[VersionInfo]:
        return [self._info]

    async def read(self, step: int) -> VersionSource:
        path = self._peer.replicas.path(self._held)

        def open_copy() -> VersionSource:
            return open_source(self.name, path, read_manifest(path, tier=self.name, step=step))

        return await asyncio.to_thread(open_copy)

    async def delete(self, step: int) -> None:
        await asyncio.to_thread(self._peer.replicas.delete, self._held)


async def exchange(peer: CopyHolder, step: int, fetchers: dict[int, int], held_open: contextlib.ExitStack) -> FetchedCopy | None:
    """Serve the copies of ``step`` this rank holds to the ranks fetching them (``fetchers``: rank ->
    the rank it fetches from), and fetch this rank's own part if it is one of them.

    Returns this rank's copy (removed when ``held_open`` closes), or None when it fetches nothing.
    Raises CorruptCheckpointError when its fetch failed (the holder could not serve it, or it did not
    arrive whole); the copies it serves meanwhile are served all the same.
    """
    world = peer.group.world
    fetched = await transfer.exchange(
        peer, step, fetchers, lambda owner, dst: _serve(peer, ReplicaId(world, owner, step), dst), lambda src: _fetch(peer, step, src),
        what="copy", source=lambda server: f"rank {server}",
    )
    if fetched is None:
        return None
    held, manifest, nbytes = fetched
    held_open.callback(peer.replicas.delete, held)
    return FetchedCopy(peer, held, manifest, nbytes)


def _serve(peer: CopyHolder, held: ReplicaId, dst: int) -> None:
    bulk = peer.group.bulk_group()
    path = peer.replicas.path(held)
    try:
        # Checked here as the receiver will check it: a copy it would refuse half-way is refused in the
        # header instead, so that it never waits for chunks, nor this rank to send chunks, in vain.
        encoded = (path / MANIFEST_FILE).read_bytes()
        manifest = Manifest.decode(encoded, tier=peer.name, step=held.step)
        fd = os.open(path / wire.COPY_FILE, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            end = data_end(manifest)
            if size != end:
                raise CorruptCheckpointError(f"{wire.COPY_FILE} holds {size} bytes, its manifest {end}")
            check_records(manifest.records, {wire.COPY_FILE: size}, tier=peer.name, step=held.step)
            data = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
    except (OSError, CorruptCheckpointError) as exc:
        refuse(dst, bulk, wire.TAG_FETCH)
        raise CorruptCheckpointError(f"tier {peer.name!r}: the copy of rank {held.owner}'s step {held.step} cannot be served: {exc}") from exc
    try:
        view = memoryview(data) if data is not None else memoryview(b"")
        announce(encoded, size, dst, bulk, wire.TAG_FETCH)
        for r in manifest.records:
            for c in r.chunks:
                assert c is not None
                wire.send(view[c.offset : c.offset + c.stored], dst, bulk, wire.TAG_FETCH)
    finally:
        del view
        if data is not None:
            try:
                data.close()
            except BufferError:  # a failed send's traceback still holds a view: the mapping goes with it
                pass


def _fetch(peer: CopyHolder, step: int, src: int) -> tuple[ReplicaId, Manifest, int]:
    bulk = peer.group.bulk_group()
    encoded, manifest, size = receive_announced(src, bulk, wire.TAG_FETCH, tier=peer.name, step=step, holder="rank", what="copy")
    held = ReplicaId(peer.group.world, peer.group.rank, step)
    incoming = peer.replicas.stage(held, size)
    try:
        with prefaulting(incoming.data):
            wire.receive_copy(incoming.data, manifest.records, src, bulk, wire.TAG_FETCH)
        peer.replicas.commit(incoming, encoded, manifest.created, lineage_of(manifest.metadata))
    except BaseException:
        peer.replicas.discard(incoming)
        raise
    return held, manifest, size


def fetch_plan(step: int, wanting: list[int], holders: dict[tuple[int, int], list[int]]) -> dict[int, int]:
    """Which of the ``wanting`` ranks (those without a verified part of ``step`` yet) fetch it from a peer,
    and from which: each from one of the ranks holding its copy (spread over them by the fetching rank)."""
    plan = {}
    for rank in wanting:
        found = sorted(holders.get((rank, step), ()))
        if found:
            plan[rank] = found[rank % len(found)]
    return plan


def holders_of(copies: list[list[list[int]]]) -> dict[tuple[int, int], list[int]]:
    """(owner, step) -> the ranks holding a copy, from every rank's :meth:`PeerRecovery.report`."""
    found: dict[tuple[int, int], list[int]] = {}
    for holder, held in enumerate(copies):
        for owner, step in held:
            found.setdefault((owner, step), []).append(holder)
    return found


