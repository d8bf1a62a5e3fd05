"""A flusher moves the versions its tier selects into that tier, one at a time.

It is offered every captured save and keeps a :class:`~tierckpt.policy.FlushState` that the pure
functions of :mod:`tierckpt.policy` update: which versions wait (the newest selected one under
``newest_only``, a FIFO queue otherwise, and with ``max_staleness`` a fallback), and when the last
flushes started. Selection is on the stream of saves, so no other tier's choices or speed decide
what this tier can get. The flusher only applies those decisions: it leases the version where it is
read fastest (host memory, else a stored tier above that holds it: :mod:`tierckpt.pipeline.sources`),
writes, commits, tells the pipeline, and prunes its tier. A flush starts only while no host copy is
running, unless the tier is overdue: training waits for the copy, never for the disk, and on few
cores a write beside the copy slows it.

A flush that finds its tier's file system full (ENOSPC) says what the tier needs and has
(:mod:`tierckpt.pipeline.space`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Protocol, Sequence

from tierckpt.config import FlushPolicy
from tierckpt.errors import flush_failure, io_cause
from tierckpt.format.records import TensorRecord
from tierckpt.format.lineage import Lineage
from tierckpt.policy import (
    Candidate,
    FlushState,
    Update,
    choose_flush,
    finished,
    forget,
    offer,
    retain,
    stale_at,
    still_wanted,
    take,
)
from tierckpt.pipeline.space import space_needed
from tierckpt.tiers.base import Lease, Tier, VersionInfo, VersionSource

log = logging.getLogger("tierckpt")

# A tier waits for a tier above that is writing, encoded alike, the save it is about to take (no
# compressor runs twice), but never longer than its own last write took, nor less than this: waiting
# longer than doing the work itself never pays, and a stuck tier above must not hold this one.
DEFER_FLOOR_S = 1.0


class FlushEvents(Protocol):
    """What the pipeline hears from a flusher (all called on the engine thread)."""

    def skipped(self, tier: str, token: int, step: int) -> None: ...

    def forced(self, tier: str, candidate: Candidate) -> None: ...

    def committed(self, tier: str, candidate: Candidate, info: VersionInfo, started: float) -> None:
        """``started``: when the flush began, on the flusher's clock."""

    def failed(self, tier: str, candidate: Candidate | None, error: BaseException) -> None: ...

    def delete_failed(self, tier: str, step: int, error: BaseException) -> None: ...

    def deleted(self, tier: str, step: int) -> None: ...


@dataclass
class Located:
    """A version leased where it will be read from; ``open()`` opens it (the caller closes the source).
    What :meth:`Upstream.locate` answers, so it lives beside that protocol."""

    tier: str
    lease: Lease
    open: Callable[[], Awaitable[VersionSource]]


class Upstream(Protocol):
    """Where a flusher reads what it takes, and what the tiers above keep for it (:class:`~tierckpt.pipeline.sources.Sources`)."""

    def locate(self, tier: str, candidate: Candidate) -> Located | None: ...

    def defer(self, tier: str, candidate: Candidate) -> bool: ...

    def spared(self, tier: str, step: int) -> bool: ...

    def direction(self) -> Lineage | None:
        """The lineage whose direction retention counts (see :meth:`~tierckpt.pipeline.sources.Sources.direction`)."""


class Flusher:
    # A newer save of a step replaces a waiting older one (policy.offer); not on a follower of several ranks.
    replaces_step = True
    # Retention spared for a tier below is tried again when a flush ends; not where the leader of
    # several ranks publishes each version's deletions with its commit (they wait for the next one).
    retries_retention = True

    def __init__(
        self,
        tier: Tier,
        policy: FlushPolicy,
        events: FlushEvents,
        *,
        upstream: Upstream,
        clock: Callable[[], float],
        wall_clock: Callable[[], float] = time.time,
        copy_running: Callable[[], bool] = lambda: False,
    ) -> None:
        self.upstream = upstream
        self.tier = tier
        self.policy = policy
        self._events = events
        self._clock = clock
        self._wall_clock = wall_clock  # unix seconds, for keep.within
        self._copy_running = copy_running
        self.state = FlushState()
        self.in_flight: Candidate | None = None
        self._last_write_s = 0.0  # seconds the last successful flush took (bounds a deferral)
        self._written_records: Sequence[TensorRecord] = ()  # the records of the version being written (sizes a full disk)
        self._deferring: tuple[int, float] | None = None  # (token, since when, monotonic) while deferring
        self._drains = 0
        # Retention left a version it drops because a tier below was reading it or waiting for it: it
        # tries again, against the step it last committed, whenever it is woken (every flush end).
        self._retention_owed: int | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.state = replace(self.state, last_ok_start=self._clock())  # max_staleness runs from here
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"tierckpt-flush-{self.tier.name}")

    def wants(self, step: int) -> bool:
        """Whether a version of ``step`` waits here to be taken or is being written (the tiers above must
        keep it: of several ranks, the others may still be reading their parts)."""
        return any(c.step == step for c in self.state.waiting()) or (self.in_flight is not None and self.in_flight.step == step)

    def still_wanted(self, token: int, newer: Sequence[Candidate]) -> bool:
        """Whether version ``token`` must stay above, given ``newer`` versions that will be offered."""
        return still_wanted(self.state, self.policy, token, newer)

    def offer(self, step: int, token: int, arrival: int) -> None:
        """Save ``token`` of ``step`` was captured; ``arrival``: how many saves there were, this one
        included (what ``every`` counts)."""
        self._apply(offer(self.state, self.policy, Candidate(step, arrival, token), replace_step=self.replaces_step))
        self._idle.clear()
        self._wake.set()

    def forget(self, token: int) -> None:
        """Nothing above holds version ``token`` any more (evicted): it will not go down."""
        self._apply(forget(self.state, token))
        self._wake.set()

    def give_up(self) -> None:
        """Closing: nothing waiting here will go down any more (only a fallback is left after a drain)."""
        self._apply(Update(replace(self.state, queue=(), fallback=None), self.state.waiting()))

    def _apply(self, update: Update) -> None:
        self.state = update.state  # first: the events below look at what waits here
        for candidate in update.passed_over:
            self._events.skipped(self.tier.name, candidate.token, candidate.step)

    def wake(self) -> None:
        if self._retention_owed is not None:
            self._idle.clear()  # not idle until it looked again: a drain that follows waits for it
        self._wake.set()

    async def drain(self) -> None:
        """Wait until nothing is queued or in flight, with ``min_interval`` waived meanwhile.

        A fallback (``max_staleness``) goes down only if the tier is overdue by now; it is not waited for.
        """
        self._drains += 1
        if self.state.waiting():
            self._idle.clear()  # look again first: a fallback may have fallen overdue meanwhile
        self._wake.set()
        try:
            await self._idle.wait()
        finally:
            self._drains -= 1

    async def stop(self) -> None:
        if self._task is None:
            return
        # Cancel until it takes: on Python 3.11, asyncio.wait_for swallows a cancellation that arrives
        # just as what it waits for completes (a wake-up set by drain() right before stop(), say).
        while not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task], timeout=0.1)
        await asyncio.gather(self._task, return_exceptions=True)

    async def _sleep(self, timeout: float | None) -> None:
        """Sleep until woken (or ``timeout``). A wake-up that came since the last sleep ended returns at
        once: the decision to sleep may predate it (a retention retry awaits its deletions between the
        decision and here, while a capture ends and offers a version), so it is consumed only here."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not silently stop this tier's flushing
                log.exception("tier %r: flusher error", self.tier.name)
                self._events.failed(self.tier.name, None, exc)
                await asyncio.sleep(0.1)

    async def _step(self) -> None:
        """One decision: sleep until something changes, or flush the version the policy picks."""
        now = self._clock()
        choice = choose_flush(
            self.state, self.policy, now=now, drain=self._drains > 0, copy_running=self._copy_running()
        )
        candidate = choice.take
        if candidate is None:
            if self._retention_owed is not None:
                await self.prune(committed=self._retention_owed)
            if not self.state.queue:
                self._idle.set()
            await self._sleep(choice.wait_s)
            return
        wait = self._deferral(candidate, now)
        if wait is not None:
            await self._sleep(wait)  # a tier above is writing it, encoded as here: woken when it ends
            return
        self._deferring = None
        located = self.upstream.locate(self.tier.name, candidate)
        if located is None:
            # Gone from above before it could be read (evicted from host memory): this tier will not get it.
            self._apply(forget(self.state, candidate.token))
            return
        self._apply(take(self.state, self.policy, candidate, now=now))
        if choice.forced:
            self._events.forced(self.tier.name, candidate)
        self.in_flight = candidate
        try:
            await self._flush(candidate, located, started=now)
        finally:
            self.in_flight = None

    def _deferral(self, candidate: Candidate, now: float) -> float | None:
        """How long to wait for a tier above writing ``candidate`` encoded as here, or None to go now:
        not when overdue (``max_staleness``), and at most ``max(last write, DEFER_FLOOR_S)`` in all."""
        due = stale_at(self.state, self.policy)
        if (due is not None and now >= due) or not self.upstream.defer(self.tier.name, candidate):
            return None
        clock = time.monotonic()
        if self._deferring is None or self._deferring[0] != candidate.token:
            self._deferring = (candidate.token, clock)
        left = self._deferring[1] + max(self._last_write_s, DEFER_FLOOR_S) - clock
        return left if left > 0 else None

    async def _flush(self, candidate: Candidate, located: Located, *, started: float) -> None:
        began = time.monotonic()
        try:
            info = await self._store(candidate, located)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the pipeline logs it, and the handle raises it; the next flush tries again
            failure: Exception = exc
            cause = io_cause(exc)
            if cause is not None and cause.errno == errno.ENOSPC and self.tier.config.path is not None:
                newest = max((i for i in self.tier.versions() if i.valid), key=lambda i: i.step, default=None)
                space = await asyncio.to_thread(space_needed, newest, self.tier.config.keep, str(self.tier.config.path), self._written_records)
                failure = flush_failure(self.tier.name, candidate.step, f"flushing step {candidate.step}", exc, space=space)
            self._events.failed(self.tier.name, candidate, failure)
            return
        finally:
            located.lease.release()
            self._written_records = ()
        self._last_write_s = time.monotonic() - began
        self.state = finished(self.state, started=started, ok=True)
        self._events.committed(self.tier.name, candidate, info, started)
        await self.prune(committed=candidate.step)

    async def _store(self, candidate: Candidate, located: Located) -> VersionInfo:
        """Read ``candidate`` where it was located, write it here and commit it (the caller holds the lease)."""
        source = await located.open()
        self._written_records = source.records
        try:
            staged = await self.tier.write(source)
        finally:
            source.close()
        try:
            return await self.tier.commit(staged)
        except BaseException:
            await self.tier.abort(staged)
            raise

    async def prune(self, committed: int) -> None:
        """Retention, after ``committed`` was committed: delete what :meth:`doomed` names."""
        await self.delete(self.doomed(committed))

    def doomed(self, committed: int) -> list[int]:
        """The steps retention deletes after ``committed`` was committed: what the keep policy drops
        and nobody reads.

        The version just committed always stays (a leftover newer step from an earlier run must not
        push it out), and versions whose manifest did not verify, or that a restore of this process
        found damaged, are neither counted nor deleted.
        Retention runs only after a commit: a failed flush never deletes anything, so the last good
        version stays. What it spares for a tier below is owed: tried again when a flush ends. The
        base of a differential version it keeps or spares is kept with it; where a tier does not keep
        the earlier version of a step saved again aside, the versions written against it go with it.
        """
        infos = [i for i in self.tier.versions() if i.valid and self.tier.damage_of(i) is None]
        # Versions that depend on ``committed`` were written against the version of that step this
        # commit replaced (none can depend on a version just committed): on a tier that does not keep
        # that earlier version aside for them, they can never be read again.
        broken = set() if self.tier.keeps_replaced_bases else {i.step for i in infos if i.base == committed}
        keep = (retain(infos, self.tier.config.keep, now=self._wall_clock(), top=self.upstream.direction()) | {committed}) - broken
        dropped = [info.step for info in infos if info.step not in keep]
        spared = {s for s in dropped if self.tier.leased(s) or self.upstream.spared(self.tier.name, s)}
        self._retention_owed = committed if spared and self.retries_retention else None
        # A differential version's base stays while the version does (tiers with delta).
        needed = {i.base for i in infos if i.base is not None and (i.step in keep or i.step in spared)}
        doomed = [i for i in infos if i.step in dropped and i.step not in spared and i.step not in needed]
        # Differential versions before the bases: a crash between two deletes never leaves one without its base.
        return [i.step for i in sorted(doomed, key=lambda i: (i.base is None, i.step))]

    async def delete(self, steps: list[int]) -> None:
        """A failed delete leaves the version whole (tried again at the next prune) or under ``.trash-``
        (swept by the tier); the base of a version left whole is not deleted after it."""
        kept: set[int] = set()
        for step in steps:
            if step in kept:
                continue
            try:
                await self.tier.delete(step)
            except Exception as exc:  # logged by the pipeline; the version is whole, or under .trash-
                self._events.delete_failed(self.tier.name, step, exc)
                kept.update(i.base for i in self.tier.versions() if i.step == step and i.base is not None)
            else:
                self._events.deleted(self.tier.name, step)

