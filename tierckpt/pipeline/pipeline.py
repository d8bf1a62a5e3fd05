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
    saves: int = 0
    skipped_saves: int = 0  # on_full: skip with every slot busy
    captures_failed: int = 0
    flushed: dict[str, int] = field(default_factory=dict)
    passed_over: dict[str, int] = field(default_factory=dict)  # versions a tier did not take
    flush_errors: int = 0


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
                copy_running=(lambda: bool(self.memory.capturing())) if upstream is memory else (lambda: False),
            )
            for upstream, tier in zip(self.tiers, self.tiers[1:])
        ]
        memory.needed = self._needed_below_memory
        for above, below in zip(self.flushers, self.flushers[1:]):
            above.wanted_below = lambda step, below=below: below.pending is not None and below.pending.step == step

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
        started: float,
        ready: Sequence[Any] = (),
    ) -> SaveTracker:
        self.raise_pending()
        wait = self.config.host.on_full == "block"
        slot = await self.memory.acquire(step, self._seq + 1, wait=wait)
        self.counters.saves += 1
        if slot is None:
            self.counters.skipped_saves += 1
            log.info("save of step %d skipped: every host slot is busy (host.on_full: skip)", step)
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
            created=time.time(),
            slot=slot,
        )
        tracker = SaveTracker(step, snapshot.seq, committed={t.name: concurrent.futures.Future() for t in self.tiers})
        self._trackers[snapshot.seq] = tracker
        self.memory.add(snapshot)
        loop = asyncio.get_running_loop()
        snapshot.capture.add_done_callback(lambda _: loop.call_soon_threadsafe(self._captured, snapshot))
        try:
            self.copier.start(snapshot, leaves, started, ready)
        except BaseException as exc:
            # Nothing was enqueued: fail the capture so the slot comes back and nobody waits on it.
            if not snapshot.capture.done():
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
        """Whether the first flusher still wants ``snapshot`` (see MemoryTier)."""
        if not self.flushers:
            return False
        flusher = self.flushers[0]
        if flusher.pending is None or flusher.pending.token != snapshot.seq:
            return False
        newer = [(s.step, s.seq) for s in self.memory.capturing() if s.seq > snapshot.seq]
        if incoming is not None:
            newer.append(incoming)
        # A newer eligible version will replace it as the pending one: it is not needed any more.
        return not any(flusher.eligible(step, seq) for step, seq in newer)

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
        for tier in self.tiers:
            try:
                await tier.close()
            except Exception as exc:
                log.error("tier %r: close failed: %s", tier.name, exc)
