"""A rank's part of a node-local version fetched from the node whose disk holds it, in a restore.

When a job restarts with its ranks on other nodes (torchrun's re-rendezvous, a requeue), a rank's
part of a committed version may lie on another live node's local disk. A rank of that node opens it
there (its manifest checked against the node's commit marker, every shared chunk resolved), and sends
it over the bulk gloo group as the peer tier's recovery does (:mod:`tierckpt.tiers.peer.recovery`): a
header (manifest length, data length; -1 when it cannot serve), the manifest of the copy, then every
chunk in record order, each verified against its checksum as it is read. The fetching rank receives
them into a one-process version under ``.tmp-fetch-…`` in its own node's directory (swept at the next
open if a crash leaves it) and reads that like any version, every chunk verified again on the way in
(:class:`FetchedPart`); it is removed once the restore is over. Every rank knows the plan (who fetches
from whom: :meth:`NodeLocalTier.fetch_plan <tierckpt.tiers.nodelocal.tier.NodeLocalTier.fetch_plan>`) from
the same exchange, so each transfer has exactly one sender and one receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import mmap
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol, Sequence


from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import MANIFEST_FILE, CommitMarker, Manifest, version_dirname
from tierckpt.format.lineage import lineage_of
from tierckpt.tiers.base import Recovery, Tier, VersionInfo, VersionSource
from tierckpt.tiers.stored.read import open_source, read_head, read_rank_manifest, resolve_shared
from tierckpt.tiers.stored.standalone import standalone
from tierckpt.tiers import wire
from tierckpt.tiers import transfer
from tierckpt.tiers.transfer import Ranked, announce, receive_announced, refuse

log = logging.getLogger("tierckpt")

TAG_NODE = 3  # a node-local part from the node holding it, in a restore


class NodeDirectories(Ranked, Protocol):
    """What fetching a part from another node uses of a node-local tier
    (:class:`~tierckpt.tiers.nodelocal.tier.NodeLocalTier`, which makes its :class:`NodeRecovery` here)."""

    @property
    def root(self) -> Path: ...
    @property
    def direct(self) -> bool: ...
    @property
    def node_names(self) -> tuple[str, ...]: ...
    def node_of(self, rank: int) -> int: ...
    def versions(self) -> list[VersionInfo]: ...
    def fetchable(self, step: int) -> bool: ...
    def fetch_plan(self, step: int, wanting: Sequence[int]) -> dict[int, int]: ...


class NodeRecovery(Recovery):
    """A node-local tier's part in a restore: every rank reports the steps whose part lies on another
    node's directory; at each step tried, the ranks still wanting theirs fetch it from a rank of that
    node, if every rank lists the step (a rank that does not would serve nothing it is asked for)."""

    def __init__(self, tier: NodeDirectories) -> None:
        self._tier = tier

    def report(self) -> list[int]:
        return [info.step for info in self._tier.versions() if self._tier.fetchable(info.step)]

    def reachable(self, reports: Sequence[Any]) -> list[set[int]]:
        return [set(steps) for steps in reports]

    async def fetch(self, step: int, wants: bool, held_open: contextlib.ExitStack) -> FetchedPart | None:
        tier = self._tier
        listed = any(info.step == step for info in tier.versions())
        said = await asyncio.to_thread(tier.group.all_gather, [wants, listed])
        # Decided from what every rank said, so that every rank plans the same transfers.
        if not all(s[1] for s in said):
            return None
        fetchers = tier.fetch_plan(step, [r for r, s in enumerate(said) if s[0]])
        if not fetchers:
            return None
        return await exchange(tier, step, fetchers, held_open)


class FetchedPart(Tier):
    """This rank's part of one version, fetched from another node into its own node's directory."""

    def __init__(self, tier: NodeDirectories, step: int, path: Path, manifest: Manifest, nbytes: int, node: str) -> None:
        super().__init__(tier.config)
        self.executor = tier.executor
        self.path = path
        self.manifest = manifest
        self.node = node  # the name of the node it came from
        self._info = VersionInfo(tier.name, step, nbytes, manifest.created, str(path), lineage=lineage_of(manifest.metadata))

    @property
    def place(self) -> str:
        return f"the copy fetched from node {self.node} into {self.path}"

    def versions(self) -> list[VersionInfo]:
        return [self._info]

    async def read(self, step: int) -> VersionSource:
        return await asyncio.to_thread(open_source, self.name, self.path, self.manifest)

    async def delete(self, step: int) -> None:
        await asyncio.to_thread(shutil.rmtree, self.path, True)


async def exchange(tier: NodeDirectories, step: int, fetchers: dict[int, int], held_open: contextlib.ExitStack) -> FetchedPart | None:
    """Serve the parts of ``step`` this rank sends (``fetchers``: rank -> the rank it fetches from),
    and fetch this rank's own if it is one of them.

    Returns this rank's fetched part (removed when ``held_open`` closes), or None when it fetches
    nothing. Raises CorruptCheckpointError when its fetch failed; what it serves is served all the same.
    """
    def node_of(server: int) -> str:
        return f"node {tier.node_names[tier.node_of(server)]} (rank {server})"

    fetched = await transfer.exchange(
        tier, step, fetchers, lambda owner, dst: _serve(tier, step, owner, dst), lambda src: _fetch(tier, step, src),
        what="part", source=node_of,
    )
    if fetched is None:
        return None
    path, manifest, nbytes = fetched
    source_node = tier.node_names[tier.node_of(fetchers[tier.group.rank])]
    held_open.callback(shutil.rmtree, path, True)
    log.info("tier %r: rank %d's part of step %d came from node %s (%d bytes)", tier.name, tier.group.rank, step, source_node, nbytes)
    return FetchedPart(tier, step, path, manifest, nbytes, source_node)


def _serve(tier: NodeDirectories, step: int, owner: int, dst: int) -> None:
    bulk = tier.group.bulk_group()
    path = tier.root / version_dirname(step)
    try:
        head = read_head(path, tier=tier.name, step=step)
        if not isinstance(head, CommitMarker) or head.holds is None or owner not in head.holds:
            raise CorruptCheckpointError(f"{path} holds no part of rank {owner}", tier=tier.name, step=step)
        resolved = resolve_shared(path, head, read_rank_manifest(path, head, owner, tier=tier.name), tier=tier.name)
        # A differential part goes out standing alone: the fetching node has no base beside it.
        source = standalone(open_source(tier.name, path, resolved, direct=tier.direct))
    except (OSError, CorruptCheckpointError) as exc:
        refuse(dst, bulk, TAG_NODE)
        raise CorruptCheckpointError(f"tier {tier.name!r}: rank {owner}'s part of step {step} cannot be served: {exc}") from exc
    try:
        records, size = wire.relocate(source.records)
        sums = [source.checksum_of(r, i) for r in source.records for i in range(len(r.chunks))]
        manifest = Manifest(
            step=step,
            created=resolved.created,
            skeleton=resolved.skeleton,
            records=wire.with_checksums(records, [0 if s is None else s for s in sums]),
            metadata=resolved.metadata,
        ).encode()
        announce(manifest, size, dst, bulk, TAG_NODE)
        # Every chunk is verified as it is read here; one that is not goes out as zeros, which the
        # fetching rank's check refuses (send_copy raises at the end, logged above).
        # Then every chunk's checksum: those the manifest left at 0 (chunks decoded here) are known only
        # once hashed as they were sent. After a failure, zeros: the fetching rank waits for them.
        try:
            sent = wire.send_copy(source, [dst], bulk, TAG_NODE, wire.Throttle(None))
        except wire.CopyFailed:
            wire.send_sums([0] * len(sums), dst, bulk, TAG_NODE)
            raise
        wire.send_sums(sent, dst, bulk, TAG_NODE)
    finally:
        source.close()


def _fetch(tier: NodeDirectories, step: int, src: int) -> tuple[Path, Manifest, int]:
    bulk = tier.group.bulk_group()
    encoded, manifest, size = receive_announced(src, bulk, TAG_NODE, tier=tier.name, step=step, holder="node", what="part")
    chunks = [c for r in manifest.records for c in r.all_chunks()]
    path = tier.root / f".tmp-fetch-{version_dirname(step)}-r{tier.group.rank:05d}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        fd = os.open(path / wire.COPY_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if size:
                os.posix_fallocate(fd, 0, size)  # a full disk fails here, not as SIGBUS in a write to the mapping
            data = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
    except OSError:
        # The sender sends every chunk all the same: take them off the wire, or they would wait out the timeout.
        wire.drain([c.stored for c in chunks], src, bulk, TAG_NODE)
        wire.receive_sums(len(chunks), src, bulk, TAG_NODE)
        shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        view = memoryview(data) if data is not None else memoryview(b"")
        try:
            wire.receive_copy(view, manifest.records, src, bulk, TAG_NODE)
        finally:
            view.release()
            if data is not None:
                try:
                    data.close()
                except BufferError:  # a failed receive's traceback still holds a view: the mapping goes with it
                    pass
        # A checksum the manifest gave is kept: every chunk is verified against it when the part is read.
        sent = wire.receive_sums(len(chunks), src, bulk, TAG_NODE)
        if any(c.checksum == 0 for c in chunks):
            sums = [late if c.checksum == 0 else c.checksum for c, late in zip(chunks, sent)]
            manifest = dataclasses.replace(manifest, records=wire.with_checksums(manifest.records, sums))
            encoded = manifest.encode()
        (path / MANIFEST_FILE).write_bytes(encoded)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, manifest, size
