"""The pipeline: host slots → memory tier → a flusher per tier below, with backpressure and drain.

Everything here runs on the engine thread, but the start of a save's copies, which the saving thread
runs once it has its handle (:class:`~tierckpt.pipeline.saves.Handoff`); the only other threads it
talks to are the copy threads (through each snapshot's capture future) and the tiers' I/O threads.

Every captured save is offered to every tier's flusher, and each tier selects on that stream with its
own policy; a tier reads what it takes from host memory, or from a stored tier (filesystem or
object) above that holds it (:mod:`tierckpt.pipeline.sources`, which also says what the tiers above
keep for it). So one tier's speed or policy never decides which versions another tier can get.

Failures. A failed flush (a full disk, a quota, EIO, EACCES on any write, fsync, rename or delete)
raises from that save's ``handle.committed(tier)`` (the other tiers go on with that save), is counted
(``flush_errors``, ``failed[tier]``), kept as ``last_error[tier]`` and logged, with what the tier
still holds. It never makes a later ``save()`` raise: training goes on, and the tier's next flush
tries again. ``wait()``/``close()`` raise it once if that tier has committed nothing since: they are
the calls that promise durability. A failed deletion is counted, kept and logged the same way, and
raised by nobody: the version is still whole, or under ``.trash-``, and retention tries again. A
failed capture (a torn snapshot: a bug in the training loop, which would tear every save) is raised
by its handle and once more by the next ``save``/``wait``/``close``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from typing import Callable, Sequence

from tierckpt.capture import Copier
from tierckpt.config import Config
from tierckpt.errors import FlushError, flush_failure
from tierckpt.observe.events import Events
from tierckpt.format.lineage import KEY as LINEAGE, Lineage, head, newest
from tierckpt.pipeline.direction import Direction
from tierckpt.pipeline.flusher import Flusher
from tierckpt.pipeline.ramfs import RamFiles
from tierckpt.pipeline.saves import Counters, SaveRequest, SaveTracker, capture_failure
from tierckpt.pipeline.sources import Sources
from tierckpt.policy import Candidate
from tierckpt.snapshot import Snapshot, SnapshotState
from tierckpt.tiers.base import Tier, VersionInfo
from tierckpt.tiers.memory.tier import MemoryHooks, MemoryTier, Want

log = logging.getLogger("tierckpt")


class Pipeline:
    """Host memory and the tiers below it, with a flusher per tier below.

    ``memory(hooks)`` makes the memory tier: the pipeline is its :class:`MemoryHooks`. ``below``: the
    other tiers, fastest first. ``flusher``: the kind of flusher each of those gets (of several ranks,
    the leader's flushers decide and the others follow: :mod:`tierckpt.pipeline.ranked`), and
    ``several_ranks`` says so. ``events``: where what happens is reported (:mod:`tierckpt.observe`).
    """

    def __init__(
        self,
        config: Config,
        copier: Copier,
        memory: Callable[[MemoryHooks], MemoryTier],
        below: Sequence[Tier],
        *,
        clock: Callable[[], float],
        flusher: Callable[..., Flusher] = Flusher,
        several_ranks: bool = False,
        events: Events | None = None,
    ) -> None:
        self.config = config
        self.copier = copier
        self.memory = memory(self)
        self.tiers: list[Tier] = [self.memory, *below]
        self.counters = Counters()
        self.events = events if events is not None else Events()
        self._clock = clock
        # Unix time on the injected clock: version creation times and keep.within use it, so a test's
        # clock moves them too, and a wall-clock step during a run does not.
        epoch = time.time() - clock()
        self._wall: Callable[[], float] = lambda: clock() + epoch
        self._seq = 0
        self.direction = Direction()  # which lineage each save gets (tierckpt.format.lineage)
        self._trackers: dict[int, SaveTracker] = {}
        self._capturing: dict[int, Snapshot] = {}  # by token, until its capture ends
        self._single = not several_ranks
        self._capture_errors: list[FlushError] = []  # raised once by the next save, wait or close
        self._unresolved: dict[str, FlushError] = {}  # per tier, its newest failed flush with no commit since
        self._failing: dict[str, int] = {}  # per tier, failed flushes since its last commit (for the log)
        self.ram = RamFiles(self.memory, self.counters, self.events)
        self.sources = Sources(self.memory, self.tiers, lambda: self.flushers)
        # A flush waits for running host copies unless its tier is overdue, whichever tier it reads:
        # on a host with few cores any flush slows the copy that training waits for.
        self.flushers = [
            flusher(
                tier,
                tier.config.flush,
                self,
                upstream=self.sources,
                clock=clock,
                wall_clock=self._wall,
                copy_running=lambda: bool(self.memory.capturing()),
            )
            for tier in self.tiers[1:]
        ]

    # -- MemoryHooks ------------------------------------------------------------------------------

    def wanted(self, snapshot: Snapshot, incoming: tuple[int, int] | None) -> Want:
        return self.sources.wanted(snapshot, incoming)

    def wall_clock(self) -> float:
        return self._wall()

    def held_direction(self) -> Lineage | None:
        return head(v for t in self.tiers for v in t.versions() if v.valid)

    def held_head(self) -> tuple[int, Lineage | None, int]:
        """What this rank's tiers hold, for :meth:`Direction.held`: the newest save's step and lineage
        (:func:`~tierckpt.format.lineage.head`; step -1 when nothing is held) and the highest serial."""
        held = [v for t in self.tiers for v in t.versions()]
        found = newest(v for v in held if v.valid)
        highest = max((v.serial for v in held), default=0)
        return (-1, None, highest) if found is None else (found.step, found.lineage, highest)

    def save_waits(self) -> None:
        self._wake_flushers()

    async def start(self) -> None:
        for tier in self.tiers:
            await tier.open()
        self.direction.held(*self.held_head())
        for flusher in self.flushers:
            flusher.start()
        if self._single:  # not for several ranks yet: every rank would have to have kept the same steps
            self.ram.flush_adopted(self.flushers)

    # -- errors ----------------------------------------------------------------------------------

    def raise_pending(self, *, flushes: bool) -> None:
        """Re-raise the first failed capture not yet reported and, with ``flushes``, else the first tier's
        failed flush that nothing committed since (once each; all of them were logged already)."""
        pending = self._capture_errors + (list(self._unresolved.values()) if flushes else [])
        self._capture_errors = []
        if flushes:
            self._unresolved = {}
        if pending:
            raise pending[0]

    # -- saving ----------------------------------------------------------------------------------

    async def save(self, request: SaveRequest) -> SaveTracker:
        step = request.step
        self.raise_pending(flushes=False)  # a failed flush never fails a later save: see the module docstring
        pool = self.memory.pool
        # Without host.capacity the pool is sized to the state: mapped at the first save, and again,
        # larger, for a save that does not fit (tierckpt.capture.pool); CapacityError past its limit.
        grown = pool.fit(request.nbytes, step)
        if grown is not None:
            self.memory.take_slots(grown)
        if pool.error is not None:  # host.pinned: true, and page-locking was refused
            raise pool.error
        on_full = self.config.host.on_full
        slot = await self.memory.acquire(step, self._seq + 1, on_full=on_full)
        if slot is not None and not pool.ready(slot):
            # The pool is prepared in the background (tierckpt.capture.prepare): this save waits for
            # its own slot only, which it faults in (and pins) itself, at its own priority.
            try:
                await asyncio.to_thread(pool.prepare, slot)
            except BaseException:
                self.memory.give_back(slot)
                raise
        # Every call takes its serial, a skipped save's too: ranks that skip different saves still
        # number each save alike. Taken here, with no await before its seq: saves from several threads
        # at once (each waiting for its own slot above) get serials in the order of their seqs.
        lineage = self.direction.next(step)
        request.metadata[LINEAGE] = lineage.encode()
        self.counters.saves += 1
        if slot is None:
            self.counters.skipped_saves += 1
            why = "being read" if on_full == "evict" else "busy"
            log.info("save of step %d skipped: every host slot is %s (host.on_full: %s)", step, why, on_full)
            self.events.emit("save_skipped", step=step)
            tracker = SaveTracker(step, 0, committed={t.name: concurrent.futures.Future() for t in self.tiers})
            tracker.captured.set_result(False)
            for tier in self.tiers:
                tracker.resolve(tier.name, False)
            return tracker
        self._seq += 1
        snapshot = Snapshot(
            seq=self._seq,
            step=step,
            entries=request.entries,
            nbytes=request.nbytes,
            skeleton=request.skeleton,
            metadata=request.metadata,
            created=self._wall(),
            slot=slot,
            lineage=lineage,
        )
        tracker = SaveTracker(step, snapshot.seq, committed={t.name: concurrent.futures.Future() for t in self.tiers}, began=request.began)
        self._trackers[snapshot.seq] = tracker
        self.memory.add(snapshot)
        loop, seq, captured = asyncio.get_running_loop(), snapshot.seq, self._capture_ended
        # The capture future keeps its callback after it ran: a callback holding the snapshot would make
        # a cycle (snapshot -> future -> callback -> snapshot) that leaves every dropped snapshot, its
        # skeleton's thousand nodes with it, to the collector (measured: 0.4-0.5 ms of collections a
        # save of 600 tensors, on the training thread). So the callback names it by its token.
        self._capturing[seq] = snapshot
        snapshot.capture.add_done_callback(lambda _: loop.call_soon_threadsafe(captured, seq))
        request.handoff.admitted(lambda: self._start_copies(snapshot, request))
        return tracker

    def _start_copies(self, snapshot: Snapshot, request: SaveRequest) -> None:
        """Start ``snapshot``'s copies (on the saving thread, or here: :class:`~tierckpt.pipeline.saves.Handoff`)."""
        try:
            self.copier.start(snapshot, request.values, request.seen)
        except BaseException as exc:
            # Nothing was enqueued: fail the capture so the slot comes back and nobody waits on it.
            if not snapshot.capture.done():
                snapshot.report_failure = False  # raised right here: not again at the next call
                snapshot.capture.set_exception(exc)
            raise

    def _capture_ended(self, seq: int) -> None:
        self._captured(self._capturing.pop(seq))

    def _captured(self, snapshot: Snapshot) -> None:
        tracker = self._trackers.get(snapshot.seq)
        error = snapshot.capture.exception()
        if error is not None:
            snapshot.state = SnapshotState.FAILED
            self.counters.captures_failed += 1
            failure = FlushError(
                f"capturing step {snapshot.step} into host memory failed: {capture_failure(error, snapshot.step)}",
                tier=self.memory.name,
                step=snapshot.step,
            )
            failure.__cause__ = error
            self.events.emit("capture_failed", step=snapshot.step, tier=self.memory.name, error=failure)
            if snapshot.report_failure:
                self._capture_errors.append(failure)
            if tracker is not None:
                tracker.captured.set_exception(failure)
                for tier in self.tiers:
                    tracker.resolve(tier.name, failure)
                self._forget(tracker)
            self.memory.drop(snapshot)
        else:
            snapshot.state = SnapshotState.CAPTURED
            since = time.monotonic() - tracker.began if tracker is not None and tracker.began else None
            self.events.emit("captured", step=snapshot.step, bytes=snapshot.nbytes, seconds=since)
            if tracker is not None:
                tracker.captured.set_result(True)
                if not self.memory.persistent:
                    tracker.resolve(self.memory.name, True)
            if self.memory.persistent:
                self.ram.persist(snapshot, lambda result: self._resolve(tracker, self.memory.name, result))
            for flusher in self.flushers:
                flusher.offer(snapshot.step, snapshot.seq, arrival=snapshot.seq)
            if not self.flushers and tracker is not None:
                self._forget(tracker)
            self.memory.prune()
        for flusher in self.flushers:
            flusher.wake()  # a copy ended: a flush held back by it may start
        self.memory.notify()

    def evicted(self, snapshot: Snapshot) -> None:
        """A save took the slot of a snapshot a tier below could get from nowhere else (on_full: evict)."""
        self.counters.evicted_saves += 1
        lost = self.sources.lost(snapshot)
        names = ", ".join(repr(f.tier.name) for f in lost)
        log.info("step %d evicted from host memory before tier(s) %s took it (host.on_full: evict)", snapshot.step, names)
        self.events.emit("evicted", step=snapshot.step, tier=self.memory.name)
        for flusher in lost:
            flusher.forget(snapshot.seq)

    # -- flusher events (FlushEvents) --------------------------------------------------------------

    def _index(self, tier: str) -> int:
        return next(i for i, t in enumerate(self.tiers) if t.name == tier)

    def skipped(self, tier: str, token: int, step: int) -> None:
        self.counters.passed_over[tier] = self.counters.passed_over.get(tier, 0) + 1
        self.events.emit("passed_over", step=step, tier=tier)
        tracker = self._trackers.get(token)
        if tracker is None:
            self.memory.notify()
            return
        tracker.resolve(tier, False)  # only this tier: every other tier selects on its own
        self._forget(tracker)
        self.memory.prune()
        self.memory.notify()

    def forced(self, tier: str, candidate: Candidate) -> None:
        self.counters.forced[tier] = self.counters.forced.get(tier, 0) + 1
        log.info("tier %r: taking step %d because max_staleness has passed", tier, candidate.step)

    def committed(self, tier: str, candidate: Candidate, info: VersionInfo, started: float) -> None:
        self.counters.flushed[tier] = self.counters.flushed.get(tier, 0) + 1
        self.events.emit("flushed", step=candidate.step, tier=tier, bytes=info.nbytes, seconds=self._clock() - started)
        self._unresolved.pop(tier, None)
        failures = self._failing.pop(tier, 0)
        if failures:
            log.warning("tier %r: step %d committed; the tier works again after %d failed flush(es)", tier, candidate.step, failures)
        self.sources.committed(tier, candidate)  # the tiers below may read it from here now
        self._resolve(self._trackers.get(candidate.token), tier, True)
        self._flush_ended()

    def _wake_flushers(self) -> None:
        for flusher in self.flushers:
            flusher.wake()

    def _flush_ended(self) -> None:
        """A flush ended: a slot may be free, and a tier waiting for this one (Sources.defer) may go."""
        self._wake_flushers()
        self.memory.prune()
        self.memory.notify()

    def failed(self, tier: str, candidate: Candidate | None, error: BaseException) -> None:
        step = candidate.step if candidate else None
        failure = flush_failure(tier, step, f"flushing step {step}" if step is not None else "its flusher", error)
        self.counters.record(tier, failure)
        self.events.emit("flush_failed", step=step, tier=tier, error=failure)
        self._unresolved[tier] = failure
        self._failing[tier] = self._failing.get(tier, 0) + 1
        log.error("%s; tier %r holds steps %s; its next flush tries again", failure, tier, self._held(tier))
        if candidate is not None:  # the other tiers go on: this one failure is theirs to ignore
            self._resolve(self._trackers.get(candidate.token), tier, failure)
        self._flush_ended()

    def delete_failed(self, tier: str, step: int, error: BaseException) -> None:
        failure = flush_failure(tier, step, f"deleting step {step}", error)
        self.counters.record(tier, failure)
        self.events.emit("delete_failed", step=step, tier=tier, error=failure)
        if step in self._held(tier):
            where = "stays whole and in place; retention tries again after the next commit"
        else:
            where = "is no longer part of the tier; what is left of it under .trash- is swept later"
        log.error("%s; step %d %s", failure, step, where)

    def deleted(self, tier: str, step: int) -> None:
        self.events.emit("deleted", step=step, tier=tier)

    def _held(self, tier: str) -> list[int]:
        return [info.step for info in self.tiers[self._index(tier)].versions()]

    def _resolve(self, tracker: SaveTracker | None, tier: str, result: bool | BaseException) -> None:
        if tracker is not None:
            tracker.resolve(tier, result)
            self._forget(tracker)

    def _forget(self, tracker: SaveTracker) -> None:
        if tracker.done():
            self._trackers.pop(tracker.token, None)

    # -- waiting and closing -----------------------------------------------------------------------

    async def wait(self) -> None:
        """Every capture finished and every due flush done, down to the last tier."""
        capturing = [asyncio.wrap_future(s.capture) for s in self.memory.capturing()]
        await asyncio.gather(*capturing, return_exceptions=True)
        # Let the capture callbacks (scheduled with call_soon_threadsafe) run before draining.
        await asyncio.sleep(0)
        await self.ram.wait()
        # Twice: a flush that ended lets a tier above delete what its retention spared, and that
        # tier's drain may have come first (it is not idle until it looked again).
        for flusher in (*self.flushers, *self.flushers):
            await flusher.drain()
        self.raise_pending(flushes=True)

    def versions(self) -> list[VersionInfo]:
        """Every tier's versions, with what a restore of this process found damaged said."""
        return [info if (why := tier.damage_of(info)) is None else dataclasses.replace(info, damaged=why) for tier in self.tiers for info in tier.versions()]

    async def close(self) -> None:
        try:
            await self.wait()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Stop flushers and close every tier without draining (after close, or a failed start)."""
        for flusher in self.flushers:
            await flusher.stop()
        for flusher in self.flushers:
            flusher.give_up()  # what still waits (a fallback) will not go down: its handles resolve False
        await self.ram.wait()  # the memory tier's executor is next to go
        for tier in self.tiers:
            try:
                await tier.close()
            except Exception as exc:
                log.error("tier %r: close failed: %s", tier.name, exc)

