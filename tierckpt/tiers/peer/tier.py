"""The peer tier: each rank's snapshot copied into the RAM of ``copies`` ranks on other nodes.

Flushing a version to this tier (the leader decides, as for every tier of several ranks:
:mod:`tierckpt.pipeline.ranked`) means: every rank sends its own part to its peers
(:func:`~tierckpt.ranks.nodes.placement`: never on its own node, each copy on another node) and
waits until each peer says it holds the copy verified; the version is committed once every rank's
copies are. So a committed version that the owners' RAM tiers still hold survives the loss of any
``copies`` nodes from memory alone. Like every tier it selects on the stream of saves and copies
from host memory; no tier reads from it, so a disk flush never waits for the network.

Each transfer is announced in the group's store (what the copy looks like), its bytes go over the
group's bulk gloo group (:mod:`tierckpt.tiers.wire`) at most at ``bandwidth``, and the manifest
with every chunk's checksum follows in the store; the peer receives into its replica directory
(:mod:`tierckpt.tiers.peer.replicas`), verifies, renames the copy into place and acknowledges. A peer
that is dead, full or slower than ``distributed.timeout`` fails that rank's part, and with it the
version on every rank.

Each rank is both an owner (its copies are out there: :meth:`versions` lists the versions committed)
and a holder of other ranks' copies. Holders follow the same decisions: a version retention deletes,
or one older than the newest commit that never committed, is deleted from every holder.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from pathlib import Path
from typing import Any, Coroutine, Sequence

from tierckpt._buffers import prefaulting
from tierckpt.config import TierConfig
from tierckpt.ranks.group import CoordinationLost, RankGroup
from tierckpt.ranks.nodes import placement, senders
from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import CHUNK_BYTES, Manifest
from tierckpt.format.lineage import decoded, lineage_of
from tierckpt.tiers.base import GroupTier, Part, Staged, VersionInfo, VersionSource
from tierckpt.tiers.stored.check import check_records
from tierckpt.tiers import wire
from tierckpt.tiers.peer.recovery import PeerRecovery
from tierckpt.tiers.peer.replicas import ReplicaId, ReplicaStore
from tierckpt.units import format_size

log = logging.getLogger("tierckpt")


def check_peer(config: TierConfig, group: RankGroup | None) -> dict[int, tuple[int, ...]]:
    """Whether a peer tier can work in this job; its placement (group position -> the positions holding
    its copies) if so.

    Raises:
        ConfigError: no torch.distributed, ranks on too few nodes for ``copies``, or a ``bandwidth`` so
            low that one chunk takes near the group's timeout.
    """
    if group is None or group.nodes is None:
        raise ConfigError(
            f"tier {config.name!r}: a peer tier copies each rank's snapshots into the RAM of ranks on other nodes; "
            "it needs torch.distributed initialized, with ranks on at least 2 nodes",
            tier=config.name,
        )
    if config.bandwidth_bytes is not None and CHUNK_BYTES / config.bandwidth_bytes > group.timeout_s / 2:
        # Each chunk is one send that the receiver waits for with the group's timeout.
        raise ConfigError(
            f"tier {config.name!r}: bandwidth {format_size(config.bandwidth_bytes)}/s sends a {format_size(CHUNK_BYTES)} chunk "
            f"in {CHUNK_BYTES / config.bandwidth_bytes:.0f} s, too close to distributed.timeout ({group.timeout_s:g} s); "
            "raise bandwidth or the timeout",
            tier=config.name,
            key=f"tiers.{config.name}.bandwidth",
        )
    return placement(group.nodes, config.copies, tier=config.name)


class PeerTier(GroupTier):
    """See the module docstring. ``root``: where the copies this rank holds live (None: a private
    directory on /dev/shm, removed at close)."""

    def __init__(self, config: TierConfig, group: RankGroup, root: Path | None) -> None:
        super().__init__(config)
        place = check_peer(config, group)
        self.group = group
        self.peers = place[group.rank]  # group positions holding this rank's copies
        self.owners = senders(place)[group.rank]  # group positions whose copies this rank holds
        self.replicas = ReplicaStore(root, config.name)
        self.replicas.spares = len(self.owners)  # one copy in flight per owner at a time
        self.throttle = wire.Throttle(config.bandwidth_bytes)
        self.executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"tierckpt-{config.name}")
        # Receiving blocks a thread per owner for as long as a transfer runs: a pool of their own, so
        # that a cut transfer (waiting out the gloo timeout) never holds up sends or reads.
        self._receivers = concurrent.futures.ThreadPoolExecutor(max(1, len(self.owners)), thread_name_prefix=f"tierckpt-{config.name}-recv")
        self._bulk = group.bulk_group()
        self._index: dict[int, VersionInfo] = {}
        self._sent = 0  # transfers announced so far (each to every peer)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.last_copy_s: float | None = None  # seconds the latest copy took, from first byte to the last peer's ack

    def _key(self, *parts: Any) -> str:
        return "/".join(("peer", self.name, *map(str, parts)))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def open(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.executor, self.replicas.open)
        for owner in self.owners:
            self._spawn(self._receive_from(owner))

    # -- as an owner: this rank's copies ---------------------------------------------------------------

    def versions(self) -> list[VersionInfo]:
        return [self._index[s] for s in sorted(self._index)]

    async def write(self, source: VersionSource, staging: str | None = None) -> Staged:
        """Send this rank's part of ``source`` to every peer; returns once each acknowledged it verified."""
        group = self.group
        self._sent += 1
        n = self._sent
        records, nbytes = wire.relocate(source.records)
        announce = {"step": source.step, "world": group.world, "nbytes": nbytes, "layout": [[c.offset, c.stored] for r in records for c in r.all_chunks()]}
        for peer in self.peers:
            await group.put(self._key("copy", peer, group.rank, n), announce)
        started = time.monotonic()
        self.throttle.begin()
        dsts = [group.ranks[p] for p in self.peers]
        loop = asyncio.get_running_loop()
        try:
            sums = await loop.run_in_executor(self.executor, wire.send_copy, source, dsts, self._bulk, wire.TAG_COPY, self.throttle)
        except wire.CopyFailed as exc:
            for peer in self.peers:  # an empty manifest: the peers drop what they got now, not after a timeout
                await group.put(self._key("manifest", peer, group.rank, n), b"")
            said = "; ".join(f"rank {group.ranks.index(dst)}: {why}" for dst, why in sorted(exc.failed.items()))
            raise RuntimeError(f"tier {self.name!r}: copying rank {group.rank}'s step {source.step} failed ({said})") from exc
        manifest = Manifest(
            step=source.step,
            created=source.created,
            skeleton=source.skeleton,
            records=wire.with_checksums(records, sums),
            metadata=source.metadata,
        ).encode()
        for peer in self.peers:
            await group.put(self._key("manifest", peer, group.rank, n), manifest)
        acks = {peer: self._key("ack", group.rank, peer, n) for peer in self.peers}
        await group.wait_for(list(acks.values()), group.timeout_s)
        failed = []
        for peer, key in acks.items():
            if not await group.has([key]):
                failed.append(f"rank {peer} did not acknowledge within {group.timeout_s:g} s")
                continue
            reply = await group.get(key)
            await group.delete(key)
            if reply.get("error"):
                failed.append(f"rank {peer}: {reply['error']}")
        if failed:
            raise RuntimeError(f"tier {self.name!r}: the copies of rank {group.rank}'s step {source.step} were not stored: {'; '.join(failed)}")
        self.last_copy_s = time.monotonic() - started
        return Staged(source.step, None, nbytes, source.created, part=Part(self.name, 0, nbytes), lineage=lineage_of(source.metadata))

    async def seal(self, staged: Staged, parts: list[Part], metadata: dict[str, Any]) -> None:
        """The leader: every rank's copies are held; nothing to write (the holders hold them whole)."""
        staged.nbytes = sum(p.nbytes for p in parts)

    async def commit(self, staged: Staged) -> VersionInfo:
        return await self.adopt(staged, staged.nbytes)

    async def adopt(self, staged: Staged, nbytes: int) -> VersionInfo:
        info = VersionInfo(self.name, staged.step, nbytes, staged.created, lineage=staged.lineage)
        self._index[staged.step] = info
        await self._prune(staged.step)
        return info

    async def abort(self, staged: Staged) -> None:
        """The holders keep the copies of an abandoned version until a newer commit prunes them."""

    async def forget(self, step: int) -> None:
        self._index.pop(step, None)
        await self._drop(step)

    async def delete(self, step: int) -> None:
        self._index.pop(step, None)
        await self._drop(step)

    async def read(self, step: int) -> VersionSource:
        # A copy of this rank's part lies on its peers: only a restore fetches it (see recovery).
        raise KeyError(f"tier {self.name!r}: this rank's copies are read back only by restore_latest")

    def has_part(self, step: int) -> bool:
        return False  # this rank holds the others' parts: its own comes back through recovery()

    def recovery(self) -> PeerRecovery:
        return PeerRecovery(self)

    def holdings(self) -> list[list[Any]]:
        """The copies this rank holds for the others of a job of this size: [owner, step, bytes, created,
        lineage (tierckpt.format.lineage: encoded, or None)]."""
        world = self.group.world
        replicas = self.replicas
        return [
            [h.owner, h.step, nbytes, replicas.created(h), None if (lineage := replicas.lineage(h)) is None else lineage.encode()]
            for h, nbytes in replicas.held().items()
            if h.world == world
        ]

    async def learn(self, reports: Sequence[Any]) -> None:
        """After a restart: the versions every rank's part of which some rank still holds, from every
        rank's :meth:`holdings`; retention goes on from them."""
        by_step: dict[int, dict[int, tuple[int, float, Any]]] = {}
        for reply in reports:
            for owner, step, nbytes, created, lineage in reply:
                by_step.setdefault(step, {})[owner] = (nbytes, created, lineage)
        for step, parts in sorted(by_step.items()):
            if len(parts) == self.group.world:
                created = max(c for _, c, _ in parts.values())
                # Every rank's part of one save has the same lineage; the newest save's if copies of two were kept.
                lineages = [decoded(raw) for _, _, raw in parts.values()]
                lineage = max((x for x in lineages if x is not None), key=lambda x: x.serial, default=None)
                self._index[step] = VersionInfo(self.name, step, sum(n for n, _, _ in parts.values()), created, lineage=lineage)

    # -- as a holder: other ranks' copies --------------------------------------------------------------

    async def _receive_from(self, owner: int) -> None:
        """Take the copies ``owner`` announces, one after another, for as long as the tier is open."""
        group = self.group
        n = 1
        while True:
            key = self._key("copy", group.rank, owner, n)
            try:
                # Idle between saves: a look every 100 ms keeps the leader's store from serving a
                # poll per rank every 20 ms, and costs a copy at most that much of a head start.
                await group.wait_for([key], None, poll_max_s=0.1)
                announce = await group.get(key)
                await group.delete(key)
            except CoordinationLost as exc:
                log.error("tier %r: no more copies from rank %d: %s", self.name, owner, exc)
                return
            try:
                await self._receive(owner, n, announce)
                reply: dict[str, Any] = {"ok": True}
            except (asyncio.CancelledError, CoordinationLost):
                raise
            except Exception as exc:
                log.warning("tier %r: the copy of rank %d's step %s failed: %s", self.name, owner, announce.get("step"), exc)
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            try:
                await group.put(self._key("ack", owner, group.rank, n), reply)
            except CoordinationLost:
                return
            n += 1

    async def _receive(self, owner: int, n: int, announce: dict[str, Any]) -> None:
        group = self.group
        loop = asyncio.get_running_loop()
        held = ReplicaId(int(announce["world"]), owner, int(announce["step"]))
        layout = [(int(o), int(s)) for o, s in announce["layout"]]
        src = group.ranks[owner]
        try:
            incoming = await loop.run_in_executor(self.executor, self.replicas.stage, held, int(announce["nbytes"]))
        except Exception:
            await loop.run_in_executor(self._receivers, wire.drain, [size for _, size in layout], src, self._bulk, wire.TAG_COPY)
            raise
        try:

            def receive_all() -> None:
                with prefaulting(incoming.data):
                    for offset, size in layout:
                        wire.receive(incoming.data[offset : offset + size], src, self._bulk, wire.TAG_COPY)

            await loop.run_in_executor(self._receivers, receive_all)
            key = self._key("manifest", group.rank, owner, n)
            if not await group.wait_for([key], group.timeout_s):
                raise TimeoutError(f"rank {owner} sent no manifest within {group.timeout_s:g} s")
            encoded = await group.get(key)
            await group.delete(key)
            if not encoded:
                raise RuntimeError(f"rank {owner} abandoned its copy of step {held.step} (it could not send all of it)")
            manifest = await loop.run_in_executor(self.executor, self._check, incoming, encoded, layout)
            await loop.run_in_executor(self.executor, self.replicas.commit, incoming, encoded, manifest.created, lineage_of(manifest.metadata))
        except BaseException:
            await loop.run_in_executor(self.executor, self.replicas.discard, incoming)
            raise

    def _check(self, incoming: Any, encoded: bytes, layout: list[tuple[int, int]]) -> Manifest:
        """The copy's manifest is well formed, describes exactly what was received, and every chunk matches."""
        held = incoming.held
        manifest = Manifest.decode(encoded, tier=self.name, step=held.step)
        check_records(manifest.records, {wire.COPY_FILE: incoming.nbytes}, tier=self.name, step=held.step)
        if [(c.offset, c.stored) for r in manifest.records for c in r.all_chunks()] != layout or manifest.step != held.step:
            raise CorruptCheckpointError(f"tier {self.name!r}: rank {held.owner}'s manifest of step {held.step} does not describe the bytes it sent")
        bad = wire.first_mismatch(incoming.data, manifest.records)
        if bad is not None:
            raise CorruptCheckpointError(f"tier {self.name!r}: rank {held.owner}'s step {held.step} arrived damaged: {bad}")
        return manifest

    async def _prune(self, committed: int) -> None:
        """Copies no decision keeps: older than ``committed`` and not committed, or of another world."""
        doomed = [
            h for h in self.replicas.held()
            if h.world != self.group.world or (h.step < committed and h.step not in self._index)
        ]
        await self._delete(doomed)

    async def _drop(self, step: int) -> None:
        await self._delete([h for h in self.replicas.held() if h.step == step and h.world == self.group.world])

    async def _delete(self, doomed: list[ReplicaId]) -> None:
        loop = asyncio.get_running_loop()
        for held in doomed:
            try:
                await loop.run_in_executor(self.executor, self.replicas.delete, held)
            except OSError as exc:  # retried at the next prune; a directory left behind is swept at open
                log.warning("tier %r: could not delete the copy of rank %d's step %d: %s", self.name, held.owner, held.step, exc)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.executor.shutdown(wait=True)
        # A receive cut off mid-transfer waits out the gloo timeout in its thread: do not wait for it.
        self._receivers.shutdown(wait=False, cancel_futures=True)
        self.replicas.close()
