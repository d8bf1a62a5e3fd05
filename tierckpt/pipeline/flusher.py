"""A flusher moves versions from one tier to the next, one at a time, always the newest eligible.

It is offered each version the tier above commits. Ineligible versions (``every``, ``every_steps``)
are passed over at once; an eligible version waiting while the flusher is busy is replaced by a newer
one (PCheck: a slow tier never falls further and further behind), and an older version offered after
a newer one (captures may finish out of order) is passed over. ``min_interval`` holds the pending
version back; the tier above keeps the pending version until it is taken or replaced. Reading from
the memory tier waits while a host copy is running: training waits for the copy, never for the disk,
and on few cores a write beside the copy slows it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Protocol

from tierckpt.config import FlushPolicy
from tierckpt.policy import Candidate, choose_flush, flush_eligible, retain
from tierckpt.tiers.base import Tier, VersionInfo

log = logging.getLogger("tierckpt")


class FlushEvents(Protocol):
    """What the pipeline hears from a flusher (all called on the engine thread)."""

    def skipped(self, tier: str, token: int) -> None: ...

    def committed(self, tier: str, candidate: Candidate, info: VersionInfo) -> None: ...

    def failed(self, tier: str, candidate: Candidate | None, error: BaseException) -> None: ...


class Flusher:
    def __init__(
        self,
        upstream: Tier,
        tier: Tier,
        policy: FlushPolicy,
        events: FlushEvents,
        *,
        clock: Callable[[], float],
        copy_running: Callable[[], bool] = lambda: False,
    ) -> None:
        self.upstream = upstream
        self.tier = tier
        self.policy = policy
        self._events = events
        self._clock = clock
        self._copy_running = copy_running
        self.pending: Candidate | None = None
        self.in_flight: Candidate | None = None
        # Whether the next tier's flusher is waiting to take a step of this tier (retention spares it).
        self.wanted_below: Callable[[int], bool] = lambda step: False
        self._newest_token = 0  # the newest save ever accepted here (pending, in flight or flushed)
        self._arrivals = 0
        self._last_start: float | None = None
        self._drains = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"tierckpt-flush-{self.tier.name}")

    def eligible(self, step: int, arrival: int) -> bool:
        return flush_eligible(self.policy, step, arrival)

    def offer(self, step: int, token: int, arrival: int | None = None) -> None:
        """A version was committed above; ``arrival`` defaults to this flusher's own count."""
        self._arrivals += 1
        arrival = self._arrivals if arrival is None else arrival
        if not self.eligible(step, arrival) or token < self._newest_token:
            # Ineligible, or older than a version this tier already has or will take: newest only.
            self._events.skipped(self.tier.name, token)
            return
        self._newest_token = token
        if self.pending is not None:
            self._events.skipped(self.tier.name, self.pending.token)
        self.pending = Candidate(step, arrival, token)
        self._idle.clear()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    async def drain(self) -> None:
        """Wait until nothing is pending or in flight, with ``min_interval`` waived meanwhile."""
        self._drains += 1
        self._wake.set()
        try:
            await self._idle.wait()
        finally:
            self._drains -= 1

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _sleep(self, timeout: float | None) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

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
        """One decision: sleep until something changes, or flush the pending version."""
        draining = self._drains > 0
        choice = choose_flush(self.pending, self.policy, last_start=self._last_start, now=self._clock(), drain=draining)
        if choice.take is None:
            if self.pending is None:
                self._idle.set()
            await self._sleep(choice.wait_s)
            return
        if self._copy_running():
            await self._sleep(None)  # woken when the copy finishes
            return
        candidate, self.pending = choice.take, None
        self.in_flight = candidate
        self._last_start = self._clock()
        try:
            await self._flush(candidate)
        finally:
            self.in_flight = None

    async def _flush(self, candidate: Candidate) -> None:
        try:
            lease = self.upstream.lease(candidate.step)
        except KeyError:
            # Evicted above before it could be read: a newer version replaced it.
            self._events.skipped(self.tier.name, candidate.token)
            return
        try:
            source = await self.upstream.read(candidate.step)
            try:
                staged = await self.tier.write(source)
            finally:
                source.close()
            try:
                info = await self.tier.commit(staged)
            except BaseException:
                await self.tier.abort(staged)
                raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("tier %r: flushing step %d failed: %s", self.tier.name, candidate.step, exc)
            self._events.failed(self.tier.name, candidate, exc)
            return
        finally:
            lease.release()
        self._events.committed(self.tier.name, candidate, info)
        await self.prune(committed=candidate.step)

    async def prune(self, committed: int) -> None:
        """Retention, after ``committed`` was committed: delete what the keep policy drops and nobody reads.

        The version just committed always stays (a leftover newer step from an earlier run must not
        push it out), and versions whose manifest did not verify are neither counted nor deleted.
        """
        infos = [i for i in self.tier.versions() if i.valid]
        keep = retain([i.step for i in infos], self.tier.config.keep) | {committed}
        for info in infos:
            if info.step in keep or self.tier.leased(info.step) or self.wanted_below(info.step):
                continue
            try:
                await self.tier.delete(info.step)
            except Exception as exc:
                log.error("tier %r: deleting step %d failed: %s", self.tier.name, info.step, exc)
                self._events.failed(self.tier.name, None, exc)
