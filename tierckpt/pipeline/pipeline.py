"""The pipeline: host slots → memory tier → flushers down the tiers, with backpressure and drain.

Everything here runs on the engine thread; the only other threads it talks to are the copy threads
(through each snapshot's capture future) and the tiers' I/O threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tierckpt.capture import Copier, HostPool
from tierckpt.config import Config
from tierckpt.errors import FlushError
from tierckpt.pipeline.flusher import Flusher
from tierckpt.policy import Candidate
from tierckpt.snapshot import Entry, Snapshot, SnapshotState
from tierckpt.state import Leaf
from tierckpt.tiers.base import Tier, VersionInfo
from tierckpt.tiers.encoding import CompressionStats
from tierckpt.tiers.memory import MemoryTier

log = logging.getLogger("tierckpt")


@dataclass
class SaveTracker:
    """The futures a SaveHandle waits on: captured, and committed per tier (True, False, or an error)."""

    step: int
    token: int  # the snapshot's seq; 0 for a skipped save
    captured: concurrent.futures.Future[bool] = field(default_factory=concurrent.futures.Future)
    committed: dict[str, concurrent.futures.Future[bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A waiter must not cancel these: asyncio.wrap_future cancels its source when the awaiting task
        # is cancelled (a wait_for timeout), which loses the result for every later waiter and makes
        # set_result raise on the engine thread. A running concurrent future cannot be cancelled.
        for future in (self.captured, *self.committed.values()):
            future.set_running_or_notify_cancel()

    def resolve(self, tier: str, value: bool | BaseException) -> None:
        future = self.committed[tier]
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    def done(self) -> bool:
        return self.captured.done() and all(f.done() for f in self.committed.values())


@dataclass
class Counters:
    """What the pipeline did so far (``Checkpointer.counters`` returns a copy)."""

    saves: int = 0
    skipped_saves: int = 0  # saves that did not happen: every slot busy (on_full: skip, or evict with every slot being read)
    captures_failed: int = 0
    flushed: dict[str, int] = field(default_factory=dict)  # versions committed, per tier
    passed_over: dict[str, int] = field(default_factory=dict)  # versions a tier did not take, per tier
    flush_errors: int = 0
    evicted_saves: int = 0  # captured snapshots dropped from host memory before the next tier took them (on_full: evict)
    forced: dict[str, int] = field(default_factory=dict)  # versions a tier took only because max_staleness had passed
    # Per filesystem tier: bytes before/after compression, chunks kept raw, measured throughputs.
    compression: dict[str, CompressionStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # dataclasses.replace() goes through here: a copy never shares the per-tier dicts.
        self.flushed, self.passed_over, self.forced = dict(self.flushed), dict(self.passed_over), dict(self.forced)
        self.compression = dict(self.compression)


class Pipeline:
    def __init__(self, config: Config, pool: HostPool, copier: Copier, tiers: Sequence[Tier], *, clock: Callable[[], float]) -> None:
        self.config = config
        self.copier = copier
        self.tiers = list(tiers)
        memory = self.tiers[0]
        assert isinstance(memory, MemoryTier)
        self.memory = memory
        self.counters = Counters()
        self._clock = clock
        # Unix time on the injected clock: version creation times and keep.within use it, so a test's
        # clock moves them too, and a wall-clock step during a run does not.
        epoch = time.time() - clock()
        self._wall: Callable[[], float] = lambda: clock() + epoch
        self._seq = 0
        self._trackers: dict[int, SaveTracker] = {}
        self._errors: list[FlushError] = []
        self.flushers = [
            Flusher(
                upstream,
                tier,
                tier.config.flush,
                self,
                clock=clock,
                wall_clock=self._wall,
                copy_running=(lambda: bool(self.memory.capturing())) if upstream is memory else (lambda: False),
            )
            for upstream, tier in zip(self.tiers, self.tiers[1:])
        ]
        memory.needed = self._needed_below_memory
        memory.evicted = self._evicted
        memory.wall_clock = self._wall
        for above, below in zip(self.flushers, self.flushers[1:]):
            above.wanted_below = below.wants

    async def start(self) -> None:
        for tier in self.tiers:
            await tier.open()
        for flusher in self.flushers:
            flusher.start()

    # -- errors ----------------------------------------------------------------------------------

    def raise_pending(self) -> None:
        """Re-raise the first background failure not yet reported (the others are logged already)."""
        if self._errors:
            first, self._errors = self._errors[0], []
            raise first

    # -- saving ----------------------------------------------------------------------------------

    async def save(
        self,
        step: int,
        leaves: Sequence[Leaf],
        entries: tuple[Entry, ...],
        nbytes: int,
        skeleton: Any,
        metadata: dict[str, Any],
        ready: Sequence[Any] = (),
    ) -> SaveTracker:
        self.raise_pending()
        on_full = self.config.host.on_full
        slot = await self.memory.acquire(step, self._seq + 1, on_full=on_full)
        self.counters.saves += 1
        if slot is None:
            self.counters.skipped_saves += 1
            why = "being read" if on_full == "evict" else "busy"
            log.info("save of step %d skipped: every host slot is %s (host.on_full: %s)", step, why, on_full)
            tracker = SaveTracker(step, 0, committed={t.name: concurrent.futures.Future() for t in self.tiers})
            tracker.captured.set_result(False)
            for tier in self.tiers:
                tracker.resolve(tier.name, False)
            return tracker
        self._seq += 1
        snapshot = Snapshot(
            seq=self._seq,
            step=step,
            entries=entries,
            nbytes=nbytes,
            skeleton=skeleton,
            metadata=metadata,
            created=self._wall(),
            slot=slot,
        )
        tracker = SaveTracker(step, snapshot.seq, committed={t.name: concurrent.futures.Future() for t in self.tiers})
        self._trackers[snapshot.seq] = tracker
        self.memory.add(snapshot)
        loop = asyncio.get_running_loop()
        snapshot.capture.add_done_callback(lambda _: loop.call_soon_threadsafe(self._captured, snapshot))
        try:
            self.copier.start(snapshot, leaves, ready)
        except BaseException as exc:
            # Nothing was enqueued: fail the capture so the slot comes back and nobody waits on it.
            if not snapshot.capture.done():
                snapshot.report_failure = False  # raised right here: not again at the next call
                snapshot.capture.set_exception(exc)
            raise
        return tracker

    def _captured(self, snapshot: Snapshot) -> None:
        tracker = self._trackers.get(snapshot.seq)
        error = snapshot.capture.exception()
        if error is not None:
            snapshot.state = SnapshotState.FAILED
            self.counters.captures_failed += 1
            failure = FlushError(
                f"capturing step {snapshot.step} into host memory failed: {error!r}",
                tier=self.memory.name,
                step=snapshot.step,
            )
            failure.__cause__ = error
            if snapshot.report_failure:
                self._report(failure)
            if tracker is not None:
                tracker.captured.set_exception(failure)
                for tier in self.tiers:
                    tracker.resolve(tier.name, failure)
                self._forget(tracker)
            self.memory.drop(snapshot)
        else:
            snapshot.state = SnapshotState.CAPTURED
            if tracker is not None:
                tracker.captured.set_result(True)
                tracker.resolve(self.memory.name, True)
            if self.flushers:
                self.flushers[0].offer(snapshot.step, snapshot.seq, arrival=snapshot.seq)
            elif tracker is not None:
                self._forget(tracker)
            self.memory.prune()
        for flusher in self.flushers[:1]:
            flusher.wake()
        self.memory.notify()

    def _needed_below_memory(self, snapshot: Snapshot, incoming: tuple[int, int] | None) -> bool:
        """Whether the first flusher still wants ``snapshot``, given newer saves (see MemoryTier)."""
        if not self.flushers:
            return False
        newer = [Candidate(s.step, s.seq, s.seq) for s in self.memory.capturing() if s.seq > snapshot.seq]
        if incoming is not None:
            newer.append(Candidate(incoming[0], incoming[1], incoming[1]))
        return self.flushers[0].still_wanted(snapshot.seq, newer)

    def _evicted(self, snapshot: Snapshot) -> None:
        """A save took the slot of a snapshot the first flusher still wanted (on_full: evict)."""
        self.counters.evicted_saves += 1
        if self.flushers:  # always: only a flusher makes a snapshot wanted
            flusher = self.flushers[0]
            log.info("step %d evicted from host memory before tier %r took it (host.on_full: evict)", snapshot.step, flusher.tier.name)
            flusher.forget(snapshot.seq)

    # -- flusher events (FlushEvents) --------------------------------------------------------------

    def _index(self, tier: str) -> int:
        return next(i for i, t in enumerate(self.tiers) if t.name == tier)

    def skipped(self, tier: str, token: int) -> None:
        self.counters.passed_over[tier] = self.counters.passed_over.get(tier, 0) + 1
        tracker = self._trackers.get(token)
        if tracker is None:
            self.memory.notify()
            return
        for t in self.tiers[self._index(tier) :]:
            tracker.resolve(t.name, False)
        self._forget(tracker)
        self.memory.prune()
        self.memory.notify()

    def forced(self, tier: str, candidate: Candidate) -> None:
        self.counters.forced[tier] = self.counters.forced.get(tier, 0) + 1
        log.info("tier %r: taking step %d because max_staleness has passed", tier, candidate.step)

    def committed(self, tier: str, candidate: Candidate, info: VersionInfo) -> None:
        self.counters.flushed[tier] = self.counters.flushed.get(tier, 0) + 1
        i = self._index(tier)
        tracker = self._trackers.get(candidate.token)
        if tracker is not None:
            tracker.resolve(tier, True)
        if i < len(self.flushers):
            self.flushers[i].offer(candidate.step, candidate.token)
        elif tracker is not None:
            self._forget(tracker)
        self.memory.prune()
        self.memory.notify()

    def failed(self, tier: str, candidate: Candidate | None, error: BaseException) -> None:
        self.counters.flush_errors += 1
        step = candidate.step if candidate else None
        failure = error if isinstance(error, FlushError) else FlushError(
            f"tier {tier!r}: {'flushing step ' + str(step) if step is not None else 'retention'} failed: {error}",
            tier=tier,
            step=step,
        )
        if failure is not error:
            failure.__cause__ = error
        self._report(failure)
        if candidate is not None:
            tracker = self._trackers.get(candidate.token)
            if tracker is not None:
                tracker.resolve(tier, failure)
                for t in self.tiers[self._index(tier) + 1 :]:
                    tracker.resolve(t.name, False)
                self._forget(tracker)
        self.memory.prune()
        self.memory.notify()

    def _report(self, failure: FlushError) -> None:
        self._errors.append(failure)

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
        for flusher in self.flushers:
            await flusher.drain()
        self.raise_pending()

    def versions(self) -> list[VersionInfo]:
        return [info for tier in self.tiers for info in tier.versions()]

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
        for tier in self.tiers:
            try:
                await tier.close()
            except Exception as exc:
                log.error("tier %r: close failed: %s", tier.name, exc)
