"""Serving held copies back to their owners in a restore (:func:`tierckpt.restore.agree.restore_agreed`).

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
from typing import cast
import torch

from tierckpt._buffers import prefaulting
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import MANIFEST_FILE, Manifest
from tierckpt.format.manifest import MAX_MANIFEST_BYTES
from tierckpt.tiers.base import Tier, VersionInfo, VersionSource
from tierckpt.tiers.fsread import check_records, open_source, read_manifest
from tierckpt.tiers.peer import wire
from tierckpt.tiers.peer.replicas import Held
from tierckpt.tiers.peer.tier import PeerTier

log = logging.getLogger("tierckpt")


class FetchedCopy(Tier):
    """This rank's part of one version, fetched from a peer into its own replica directory for a restore."""

    def __init__(self, peer: PeerTier, held: Held, created: float, nbytes: int) -> None:
        super().__init__(peer.config)
        self.executor = peer.executor
        self._peer = peer
        self._held = held
        self._info = VersionInfo(peer.name, held.step, nbytes, created, str(peer.replicas.path(held)))

    def versions(self) -> list[VersionInfo]:
        return [self._info]

    async def read(self, step: int) -> VersionSource:
        path = self._peer.replicas.path(self._held)

        def open_copy() -> VersionSource:
            return open_source(self.name, path, read_manifest(path, tier=self.name, step=step))

        return await asyncio.to_thread(open_copy)

    async def delete(self, step: int) -> None:
        await asyncio.to_thread(self._peer.replicas.delete, self._held)


async def exchange(peer: PeerTier, step: int, fetchers: dict[int, int], held_open: contextlib.ExitStack) -> FetchedCopy | None:
    """Serve the copies of ``step`` this rank holds to the ranks fetching them (``fetchers``: rank ->
    the rank it fetches from), and fetch this rank's own part if it is one of them.

    Returns this rank's copy (removed when ``held_open`` closes), or None when it fetches nothing.
    Raises CorruptCheckpointError when its fetch failed (the holder could not serve it, or it did not
    arrive whole); the copies it serves meanwhile are served all the same.
    """
    group = peer.group
    me = group.rank
    serving = [
        asyncio.to_thread(_serve, peer, Held(group.world, owner, step), group.ranks[owner])
        for owner, holder in sorted(fetchers.items())
        if holder == me
    ]
    fetching = asyncio.to_thread(_fetch, peer, step, group.ranks[fetchers[me]]) if me in fetchers else None
    fetched, failed = await wire.transfers(fetching, serving)
    for exc in failed:
        log.warning("tier %r: serving a copy of step %d failed: %s", peer.name, step, exc)
    if fetching is None:
        return None
    if isinstance(fetched, BaseException):
        if isinstance(fetched, CorruptCheckpointError):
            raise fetched
        raise CorruptCheckpointError(f"tier {peer.name!r}: fetching this rank's step {step} from rank {fetchers[me]} failed: {fetched}", tier=peer.name, step=step) from fetched
    held, manifest, nbytes = cast("tuple[Held, Manifest, int]", fetched)  # gather() loses the type
    held_open.callback(peer.replicas.delete, held)
    return FetchedCopy(peer, held, manifest.created, nbytes)


def _serve(peer: PeerTier, held: Held, dst: int) -> None:
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
            end = max((c.offset + c.stored for r in manifest.records for c in r.chunks if c is not None), default=0)
            if size != end:
                raise CorruptCheckpointError(f"{wire.COPY_FILE} holds {size} bytes, its manifest {end}")
            check_records(manifest.records, {wire.COPY_FILE: size}, tier=peer.name, step=held.step)
            data = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
    except (OSError, CorruptCheckpointError) as exc:
        wire.send(torch.tensor([-1, 0], dtype=torch.int64).numpy().data, dst, bulk, wire.TAG_FETCH)
        raise CorruptCheckpointError(f"tier {peer.name!r}: the copy of rank {held.owner}'s step {held.step} cannot be served: {exc}") from exc
    try:
        view = memoryview(data) if data is not None else memoryview(b"")
        wire.send(torch.tensor([len(encoded), size], dtype=torch.int64).numpy().data, dst, bulk, wire.TAG_FETCH)
        wire.send(memoryview(bytearray(encoded)), dst, bulk, wire.TAG_FETCH)
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


def _fetch(peer: PeerTier, step: int, src: int) -> tuple[Held, Manifest, int]:
    bulk = peer.group.bulk_group()
    header = torch.zeros(2, dtype=torch.int64)
    wire.receive(header.numpy().data, src, bulk, wire.TAG_FETCH)
    length, size = (int(v) for v in header.tolist())
    if length < 0:
        raise CorruptCheckpointError(f"tier {peer.name!r}: the rank holding this rank's copy of step {step} could not serve it (see its log)", tier=peer.name, step=step)
    if not 0 < length <= MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"tier {peer.name!r}: a copy of step {step} came with a manifest of {length} bytes", tier=peer.name, step=step)
    encoded = bytearray(length)
    wire.receive(memoryview(encoded), src, bulk, wire.TAG_FETCH)
    manifest = Manifest.decode(bytes(encoded), tier=peer.name, step=step)
    end = max((c.offset + c.stored for r in manifest.records for c in r.chunks if c is not None), default=0)
    if manifest.step != step or size != end:
        raise CorruptCheckpointError(f"tier {peer.name!r}: the copy sent for step {step} is not one (step {manifest.step}, {size} bytes for {end})", tier=peer.name, step=step)
    check_records(manifest.records, {wire.COPY_FILE: size}, tier=peer.name, step=step)
    held = Held(peer.group.world, peer.group.rank, step)
    incoming = peer.replicas.stage(held, size)
    try:
        with prefaulting(incoming.data):
            wire.receive_copy(incoming.data, manifest.records, src, bulk, wire.TAG_FETCH)
        peer.replicas.commit(incoming, bytes(encoded), manifest.created)
    except BaseException:
        peer.replicas.discard(incoming)
        raise
    return held, manifest, size


def copies_held(peer: PeerTier | None) -> list[list[int]]:
    """[owner, step] of every copy this rank holds for a job of the current world size."""
    if peer is None:
        return []
    return [[h.owner, h.step] for h in peer.replicas.held() if h.world == peer.group.world]


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
    """(owner, step) -> the ranks holding a copy, from every rank's :func:`copies_held`."""
    found: dict[tuple[int, int], list[int]] = {}
    for holder, held in enumerate(copies):
        for owner, step in held:
            found.setdefault((owner, step), []).append(holder)
    return found


