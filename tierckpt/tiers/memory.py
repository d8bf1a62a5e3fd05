"""The memory tier: captured snapshots held in host-pool slots (PCheck-style, several at once).

Every save lands here first. A slot is reused only when its snapshot is no longer needed: not being
read (leased), not a version the next tier's flusher is waiting to take, and not kept by this tier's
retention; when a save needs a slot and none is free, the oldest snapshot nobody needs gives way to
it, even one retention keeps. Under ``host.on_full: evict`` a save may also take the slot of the
oldest snapshot the next tier was still waiting for (the pipeline counts it and tells that flusher);
a snapshot being copied into or read is never dropped. :func:`tierckpt.policy.choose_slot` decides.
In a new process this tier is empty, and restore looks further down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Callable

from tierckpt.capture.pool import HostPool, Slot
from tierckpt.config import TierConfig
from tierckpt.format import CHUNK_BYTES, Chunk, TensorRecord
from tierckpt.format.manifest import chunk_count
from tierckpt.policy import Held, choose_slot, retain
from tierckpt.snapshot import Snapshot, SnapshotState
from tierckpt.tiers.base import Lease, Tier, VersionInfo, VersionSource

# needed(snapshot, incoming): whether the tier below still wants ``snapshot``, given a save of
# (step, seq) that is about to take a slot (or None).
Needed = Callable[[Snapshot, "tuple[int, int] | None"], bool]


class MemoryTier(Tier):
    def __init__(self, config: TierConfig, pool: HostPool) -> None:
        super().__init__(config)
        self.pool = pool
        self.executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"tierckpt-mem-{config.name}")
        self.needed: Needed = lambda snapshot, incoming: False
        # Called with a snapshot dropped under on_full: evict although the next tier wanted it.
        self.evicted: Callable[[Snapshot], None] = lambda snapshot: None
        self.wall_clock: Callable[[], float] = time.time  # unix seconds, for keep.within
        self._free: list[Slot] = list(pool.slots)
        self._snapshots: dict[int, Snapshot] = {}  # by seq, in save order
        self._changed: asyncio.Condition | None = None

    async def open(self) -> None:
        self._changed = asyncio.Condition()

    # -- slots -----------------------------------------------------------------------------------

    async def acquire(self, step: int, seq: int, *, on_full: str) -> Slot | None:
        """A slot for the save (step, seq), or None when it is to be skipped (see :func:`choose_slot`).

        ``block`` waits until a slot can be had; ``evict`` waits only while a host copy runs; ``skip``
        never waits.
        """
        assert self._changed is not None
        async with self._changed:
            while True:
                slot, wait = self._choose(step, seq, on_full)
                if slot is not None or not wait:
                    return slot
                await self._changed.wait()

    def _choose(self, step: int, seq: int, on_full: str) -> tuple[Slot | None, bool]:
        held = [
            Held(
                s.seq,
                copying=s.state is SnapshotState.CAPTURING,
                leased=s.leases > 0,
                wanted=s.state is SnapshotState.CAPTURED and self.needed(s, (step, seq)),
            )
            for s in self._snapshots.values()
        ]
        choice = choose_slot(held, free=len(self._free), on_full=on_full)
        if choice.action in ("drop", "evict"):
            assert choice.token is not None
            victim = self._snapshots[choice.token]
            self.drop(victim)
            slot = self._free.pop(0)
            if choice.action == "evict":
                self.evicted(victim)
            return slot, False
        if choice.action == "free":
            return self._free.pop(0), False
        return None, choice.action == "wait"

    def _evictable(self, snapshot: Snapshot, incoming: tuple[int, int] | None) -> bool:
        if snapshot.state is SnapshotState.CAPTURING or snapshot.leases:
            return False
        return snapshot.state is not SnapshotState.CAPTURED or not self.needed(snapshot, incoming)

    def notify(self) -> None:
        """Something changed that may free a slot: wake blocked saves."""
        if self._changed is None:
            return

        async def wake() -> None:
            assert self._changed is not None
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(wake())

    # -- snapshots ---------------------------------------------------------------------------------

    def add(self, snapshot: Snapshot) -> None:
        self._snapshots[snapshot.seq] = snapshot

    def snapshots(self) -> list[Snapshot]:
        return list(self._snapshots.values())

    def capturing(self) -> list[Snapshot]:
        return [s for s in self._snapshots.values() if s.state is SnapshotState.CAPTURING]

    def drop(self, snapshot: Snapshot) -> None:
        """Forget a snapshot and free its slot (it must not be capturing or leased)."""
        if self._snapshots.pop(snapshot.seq, None) is None:
            return
        if snapshot.state is not SnapshotState.FAILED:
            snapshot.state = SnapshotState.DROPPED
        self._free.append(snapshot.slot)
        self.notify()

    def prune(self) -> None:
        """Retention: drop captured snapshots the keep policy lets go and nobody needs."""
        newest: dict[int, Snapshot] = {}
        for s in self._snapshots.values():
            if s.state is SnapshotState.CAPTURED:
                newest[s.step] = s  # a later save of the same step replaces the earlier one
        keep = retain(list(newest.values()), self.config.keep, now=self.wall_clock())
        for s in list(self._snapshots.values()):
            if s.state is SnapshotState.FAILED and not s.leases:
                self.drop(s)
            elif s.state is SnapshotState.CAPTURED and (s.step not in keep or newest[s.step] is not s):
                if self._evictable(s, None):
                    self.drop(s)

    def _find(self, step: int) -> Snapshot | None:
        found = None
        for s in self._snapshots.values():
            if s.step == step and s.state is SnapshotState.CAPTURED:
                found = s
        return found

    # -- the Tier interface ------------------------------------------------------------------------

    def versions(self) -> list[VersionInfo]:
        found: dict[int, Snapshot] = {}
        for s in self._snapshots.values():
            if s.state is SnapshotState.CAPTURED:
                found[s.step] = s
        return [VersionInfo(self.name, step, found[step].nbytes, found[step].created) for step in sorted(found)]

    def lease(self, step: int) -> Lease:
        snapshot = self._find(step)
        if snapshot is None:
            raise KeyError(f"tier {self.name!r} holds no step {step}")
        snapshot.leases += 1

        def release() -> None:
            snapshot.leases -= 1
            if not snapshot.leases:
                self.prune()
                self.notify()

        return Lease(release)

    def leased(self, step: int) -> bool:
        return any(s.leases for s in self._snapshots.values() if s.step == step)

    async def read(self, step: int) -> VersionSource:
        snapshot = self._find(step)
        if snapshot is None:
            raise KeyError(f"tier {self.name!r} holds no step {step}")
        return MemorySource(self.name, snapshot, self.pool)

    async def delete(self, step: int) -> None:
        for s in list(self._snapshots.values()):
            if s.step == step and not s.leases and s.state is not SnapshotState.CAPTURING:
                self.drop(s)

    async def close(self) -> None:
        self.executor.shutdown(wait=True)


class MemorySource(VersionSource):
    """A captured snapshot's slot, read in place (no copy until a destination asks for one)."""

    def __init__(self, tier: str, snapshot: Snapshot, pool: HostPool) -> None:
        self.tier = tier
        self.step = snapshot.step
        self.created = snapshot.created
        self.skeleton = snapshot.skeleton
        self.metadata = snapshot.metadata
        self._snapshot = snapshot
        self._pool = pool
        self.records = tuple(
            TensorRecord(
                index=e.index,
                key=e.key,
                kind=e.kind,
                dtype=e.dtype,
                shape=e.shape,
                nbytes=e.nbytes,
                file="",
                codec="none",
                chunk_bytes=CHUNK_BYTES,
                chunks=tuple(
                    Chunk(e.offset + c * CHUNK_BYTES, min(CHUNK_BYTES, e.nbytes - c * CHUNK_BYTES), -1)
                    for c in range(chunk_count(e.nbytes))
                ),
            )
            for e in snapshot.entries
        )

    def read_stored(self, record: TensorRecord, chunk: int, scratch: memoryview) -> memoryview:
        c = record.chunks[chunk]
        return self._pool.view(self._snapshot.slot, c.offset, c.stored)
