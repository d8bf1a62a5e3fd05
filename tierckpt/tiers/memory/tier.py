"""The memory tier: captured snapshots held in host-pool slots (PCheck-style, several at once).

Every save lands here first. A slot is reused only when its snapshot is no longer needed: not being
read (leased), not a version a tier below is waiting to take, and not kept by this tier's retention;
when a save needs a slot and none is free, the oldest snapshot nobody needs gives way to it, even one
retention keeps, or one a tier below waits for that a stored tier above it already holds (that
tier reads it from there: :class:`Want`). Under ``host.on_full: evict`` a save may also take the slot
of the oldest snapshot a tier below was still waiting for (the pipeline counts it and tells those
flushers); a snapshot being copied into or read is never dropped. :func:`tierckpt.policy.choose_slot`
decides.
In a new process this tier is empty, and restore looks further down; unless the tier has a ``path``
on a RAM-backed file system: then the pool is a shared file there, each captured snapshot is also
written as a version directory (manifest and checksums, its data a hard link to the pool, see
:mod:`tierckpt.tiers.memory.shm`), and a new process finds those snapshots, verifies each whole the first
time it is read, and keeps them under the same retention.

Free slots can also be lent for a while (:meth:`MemoryTier.borrow`): a restore stages the bytes it
reads from a disk there, in memory faulted in long ago, instead of in a fresh mapping. A lent slot
is not free: a save meanwhile takes another slot, or waits, skips or evicts per ``on_full`` as it
would while that slot were being read; it comes back when the borrower is done, failure included.

A pool sized to the state (no ``host.capacity``) has no slots before the first save, and maps a new
generation of them for a save larger than its slots (:meth:`HostPool.fit`, called by the pipeline
before :meth:`MemoryTier.acquire`): saves then take the new slots (:meth:`MemoryTier.take_slots`),
and a slot of an older generation goes back to the pool, not to the free slots, once it holds
nothing (:meth:`HostPool.release`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Iterator, Sequence

from tierckpt.capture.pool import HostPool
from tierckpt.config import TierConfig
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import DATA_FILE, Manifest
from tierckpt.format.lineage import head
from tierckpt.policy import SlotChoice, SlotOccupant, choose_slot, retain
from tierckpt.snapshot import Entry, Slot, Snapshot, SnapshotState
from tierckpt.tiers.base import Lease, Tier, VersionInfo, VersionSource
from tierckpt.tiers.memory.hooks import Alone, MemoryHooks, Want
from tierckpt.tiers.memory.adopt import leftover_snapshots
from tierckpt.tiers.memory.source import MemorySource
from tierckpt.tiers.memory.shm import ShmStore, chunk_checksums, first_mismatch, slot_manifest

__all__ = ["Alone", "MemoryHooks", "MemorySource", "MemoryTier", "Want"]



class MemoryTier(Tier):
    def __init__(self, config: TierConfig, pool: HostPool, store: ShmStore | None = None, *, hooks: MemoryHooks | None = None) -> None:
        super().__init__(config)
        self.pool = pool
        self.store = store  # the directory that makes snapshots outlive the process, if any
        self.executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"tierckpt-mem-{config.name}")
        self._hooks: MemoryHooks = hooks if hooks is not None else Alone()
        self._free: list[Slot] = list(pool.slots)
        self.lent: list[Slot] = []  # slots lent by borrow(), not free until they come back
        self.loans = 0  # borrow() calls that got slots, so far
        self.waiting_saves = 0  # saves waiting for a slot now (on_full: block, or evict while copies run)
        self._snapshots: dict[int, Snapshot] = {}  # by seq, in save order
        self._verifying: dict[int, asyncio.Future[None]] = {}  # by seq: one check, however many wait for it
        self._changed: asyncio.Condition | None = None

    async def open(self) -> None:
        self._changed = asyncio.Condition()
        if self.store is not None:
            found = await asyncio.get_running_loop().run_in_executor(self.executor, self.store.scan)
            self._adopt(found)

    def _adopt(self, found: list[tuple[Manifest, int | None]]) -> None:
        """Snapshots a previous process left in the pool: held again, older than any new save."""
        for snapshot in leftover_snapshots(found, self._free, self.store.root if self.store else None):
            self._free.remove(snapshot.slot)
            self._snapshots[snapshot.seq] = snapshot

    @property
    def persistent(self) -> bool:
        return self.store is not None

    async def persist(self, snapshot: Snapshot) -> None:
        """Write a captured snapshot's version directory (checksums first), so it outlives the process.

        Holds a lease meanwhile (the slot cannot be reused under it); take it with :meth:`hold` on the
        engine loop before scheduling this.
        """
        assert self.store is not None
        store = self.store
        loop = asyncio.get_running_loop()

        def sums(entry: Entry) -> tuple[int, ...]:
            return chunk_checksums(self.pool.view(snapshot.slot, entry.offset, entry.nbytes), entry.nbytes)

        snapshot.checksums = tuple(await asyncio.gather(*(loop.run_in_executor(self.executor, sums, e) for e in snapshot.entries)))
        manifest = slot_manifest(
            snapshot.step, snapshot.created, snapshot.skeleton, snapshot.metadata, snapshot.entries, snapshot.slot.offset, snapshot.checksums
        )
        snapshot.persisted = await loop.run_in_executor(self.executor, store.persist, manifest)

    def hold(self, snapshot: Snapshot) -> Lease:
        """A lease on this very snapshot (not just its step)."""
        snapshot.leases += 1

        def release() -> None:
            snapshot.leases -= 1
            if not snapshot.leases:
                self.prune()
                self.notify()

        return Lease(release)

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
                self.waiting_saves += 1
                self._hooks.save_waits()
                try:
                    await self._changed.wait()
                finally:
                    self.waiting_saves -= 1

    def slot_choice(self, step: int, seq: int, on_full: str) -> SlotChoice:
        """What the save (step, seq) would do for a slot now (no side effects: :meth:`acquire` acts on it)."""
        held = [
            SlotOccupant(
                s.seq,
                copying=s.state is SnapshotState.CAPTURING,
                leased=s.leases > 0,
                wanted=s.state is SnapshotState.CAPTURED and self._hooks.wanted(s, (step, seq)) is Want.ONLY_HERE,
            )
            for s in self._snapshots.values()
        ]
        return choose_slot(held, free=len(self._free), on_full=on_full)

    def give_back(self, slot: Slot) -> None:
        """A slot :meth:`acquire` gave that the save did not use after all (it failed first)."""
        if self.pool.release(slot):
            self._free.insert(0, slot)
        self.notify()

    def take_slots(self, slots: Sequence[Slot]) -> None:
        """The pool mapped a new generation of slots for a save (:meth:`HostPool.fit`): saves take
        those from now on. The free slots of the generation before go back to the pool now, the
        others as their snapshots are dropped (retention, or a save needing a slot)."""
        old, self._free = self._free, list(slots)
        for slot in old:
            self.pool.release(slot)
        self.notify()

    def _choose(self, step: int, seq: int, on_full: str) -> tuple[Slot | None, bool]:
        choice = self.slot_choice(step, seq, on_full)
        if choice.action in ("drop", "evict"):
            assert choice.token is not None
            victim = self._snapshots[choice.token]
            self.drop(victim)
            if choice.action == "evict":
                self._hooks.evicted(victim)
            if not self._free:  # its slot was of a generation the pool has grown past: choose again
                return self._choose(step, seq, on_full)
            return self._free.pop(0), False
        if choice.action == "free":
            return self._free.pop(0), False
        return None, choice.action == "wait"

    def _evictable(self, snapshot: Snapshot) -> bool:
        """Whether retention may drop it: not being copied into or read, and no tier below wants it."""
        if snapshot.state is SnapshotState.CAPTURING or snapshot.leases:
            return False
        return snapshot.state is not SnapshotState.CAPTURED or self._hooks.wanted(snapshot, None) is Want.NO

    def notify(self) -> None:
        """Something changed that may free a slot: wake blocked saves."""
        if self._changed is None:
            return

        async def wake() -> None:
            assert self._changed is not None
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(wake())

    @contextlib.contextmanager
    def borrow(self, nbytes: int) -> Iterator[memoryview | None]:
        """Free slot memory of at least ``nbytes``, lent for the ``with`` block; None when none fits.

        One free slot when it is large enough, else the fewest adjacent free slots that together are,
        as one page-aligned view (:meth:`HostPool.span`). Only free slots are lent, never a snapshot's.
        While lent they are not free: a save takes another slot, or waits, skips or evicts per
        ``on_full`` as if they were being read. They come back when the block exits, by an error or a
        cancellation too, and blocked saves are woken; the borrower must be done with the memory by
        then (no thread may still write into it). Call on the engine loop, like every slot decision.

        Example::

            with memory.borrow(staged_bytes) as scratch:
                arena = scratch if scratch is not None else memoryview(aligned_buffer(staged_bytes))
        """
        slots = self._lend(nbytes)
        if slots is None:
            yield None
            return
        try:
            yield self.pool.span(slots)
        finally:
            for slot in slots:
                self.lent.remove(slot)
                if self.pool.release(slot):
                    self._free.append(slot)
            self.notify()

    def _lend(self, nbytes: int) -> list[Slot] | None:
        if nbytes <= 0:
            return None
        free = sorted(self._free, key=lambda s: s.index)
        best: list[Slot] | None = None
        for i in range(len(free)):
            run, size = [free[i]], free[i].size
            for slot in free[i + 1 :]:
                if size >= nbytes or slot.index != run[-1].index + 1:
                    break
                run.append(slot)
                size += slot.size
            if size >= nbytes and (best is None or len(run) < len(best)):
                best = run
        if best is None:
            return None
        for slot in best:
            self._free.remove(slot)
        self.lent.extend(best)
        self.loans += 1
        return best

    # -- snapshots ---------------------------------------------------------------------------------

    def add(self, snapshot: Snapshot) -> None:
        self._snapshots[snapshot.seq] = snapshot

    def snapshots(self) -> list[Snapshot]:
        return list(self._snapshots.values())

    def busy_slots(self) -> int:
        """Host slots holding a snapshot or lent out; read by the metrics endpoint's thread (a length: no lock needed)."""
        return len(self._snapshots) + len(self.lent)

    def capturing(self) -> list[Snapshot]:
        return [s for s in self._snapshots.values() if s.state is SnapshotState.CAPTURING]

    def drop(self, snapshot: Snapshot) -> None:
        """Forget a snapshot and free its slot (it must not be capturing or leased)."""
        if self._snapshots.pop(snapshot.seq, None) is None:
            return
        if snapshot.state is not SnapshotState.FAILED:
            snapshot.state = SnapshotState.DROPPED
        if snapshot.persisted is not None and self.store is not None:
            # Out of sight before the slot takes another capture: a version directory always
            # describes the bytes its slot holds.
            path, snapshot.persisted = snapshot.persisted, None
            self.store.remove_dir(path)
        if self.pool.release(snapshot.slot):
            self._free.append(snapshot.slot)
        self.notify()

    def prune(self) -> None:
        """Retention: drop captured snapshots the keep policy lets go and nobody needs."""
        newest: dict[int, Snapshot] = {}
        for s in self._snapshots.values():
            if s.state is SnapshotState.CAPTURED:
                newest[s.step] = s  # a later save of the same step replaces the earlier one
        top = self._hooks.held_direction()
        keep = retain(list(newest.values()), self.config.keep, now=self._hooks.wall_clock(), top=top or head(newest.values()))
        for s in list(self._snapshots.values()):
            if s.state is SnapshotState.FAILED and not s.leases:
                self.drop(s)
            elif s.state is SnapshotState.CAPTURED and (s.step not in keep or newest[s.step] is not s):
                if self._evictable(s):
                    self.drop(s)

    def captured(self, seq: int) -> Snapshot | None:
        """The captured snapshot of save ``seq``, if this tier still holds it."""
        snapshot = self._snapshots.get(seq)
        return snapshot if snapshot is not None and snapshot.state is SnapshotState.CAPTURED else None

    async def read_snapshot(self, snapshot: Snapshot) -> VersionSource:
        """As :meth:`read`, of this very snapshot (a later save of the same step may be held too);
        the caller holds it (:meth:`hold`)."""
        await self.verify(snapshot)
        return MemorySource(self.name, snapshot, self.pool)

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
        return [
            VersionInfo(
                self.name, step, found[step].nbytes, found[step].created, str(found[step].persisted) if found[step].persisted else None,
                lineage=found[step].lineage,
            )
            for step in sorted(found)
        ]

    def lease(self, step: int) -> Lease:
        snapshot = self._find(step)
        if snapshot is None:
            raise KeyError(f"tier {self.name!r} holds no step {step}")
        return self.hold(snapshot)

    def leased(self, step: int) -> bool:
        return any(s.leases for s in self._snapshots.values() if s.step == step)

    async def read(self, step: int) -> VersionSource:
        snapshot = self._find(step)
        if snapshot is None:
            raise KeyError(f"tier {self.name!r} holds no step {step}")
        return await self.read_snapshot(snapshot)

    def adopted(self) -> list[Snapshot]:
        """The snapshots a previous process left here, still held, oldest save first."""
        return [s for s in self._snapshots.values() if s.restored and s.state is SnapshotState.CAPTURED]

    async def verify(self, snapshot: Snapshot) -> None:
        """Check every chunk of a snapshot a previous process left, once (captured ones need not be).

        Done before anything is copied out, so a restore may then copy straight into a template as
        from a snapshot captured here, and a tier below never takes damaged bytes.

        Raises:
            CorruptCheckpointError: a chunk does not match its checksum (names the key).
        """
        if not snapshot.restored or snapshot.verified:
            return
        # A restore and the flush of the same leftover (at start) may ask at once: hash it once.
        check = self._verifying.get(snapshot.seq)
        if check is None:
            check = self._verifying[snapshot.seq] = asyncio.ensure_future(self._verify_all(snapshot))
            check.add_done_callback(lambda _: self._verifying.pop(snapshot.seq, None))
        await asyncio.shield(check)

    async def _verify_all(self, snapshot: Snapshot) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self.executor, self._verify, snapshot, i) for i in range(len(snapshot.entries))))
        snapshot.verified = True

    def _verify(self, snapshot: Snapshot, i: int) -> None:
        entry, sums = snapshot.entries[i], snapshot.checksums[i] if snapshot.checksums else ()
        chunk = first_mismatch(self.pool.view(snapshot.slot, entry.offset, entry.nbytes), entry.nbytes, sums)
        if chunk is not None:
            raise CorruptCheckpointError(
                f"step {snapshot.step} on tier {self.name!r}: checksum mismatch in {entry.key} (chunk {chunk}) "
                f"of {snapshot.persisted}/{DATA_FILE.format(rank=0)}",
                tier=self.name, step=snapshot.step, key=entry.key,
            )

    async def delete(self, step: int) -> None:
        for s in list(self._snapshots.values()):
            if s.step == step and not s.leases and s.state is not SnapshotState.CAPTURING:
                self.drop(s)

    async def close(self) -> None:
        self.executor.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
