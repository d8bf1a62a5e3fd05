"""A memory tier on a RAM file system (a tier ``path`` there: :mod:`tierckpt.tiers.memory.shm`), whose
snapshots outlive the process: each captured snapshot is written there in the background, and the
snapshots a killed process left there go on down to the tiers below, as they would have gone.

A failed write is counted, reported and logged as a failed flush of the memory tier; the snapshot
stays in this process's memory only. Runs on the engine thread, as the pipeline does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Coroutine, Sequence

from tierckpt.format.lineage import order_key
from tierckpt.errors import CorruptCheckpointError, flush_failure
from tierckpt.observe.events import Events
from tierckpt.pipeline.flusher import Flusher
from tierckpt.pipeline.saves import Counters
from tierckpt.snapshot import Snapshot
from tierckpt.tiers.base import Lease
from tierckpt.tiers.memory.tier import MemoryTier

log = logging.getLogger("tierckpt")


class RamFiles:
    """The background tasks that write ``memory``'s snapshots to its RAM file system, and that send
    on down what a previous process left there. ``counters``, ``events``: the pipeline's."""

    def __init__(self, memory: MemoryTier, counters: Counters, events: Events) -> None:
        self.memory = memory
        self._counters = counters
        self._events = events
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._tasks.add(task := asyncio.get_running_loop().create_task(work))
        task.add_done_callback(self._tasks.discard)

    def persist(self, snapshot: Snapshot, done: Callable[[bool | BaseException], None]) -> None:
        """Write a captured snapshot into the memory tier's directory; committed there once written.

        ``done`` gets True once it is, else the failure (a :class:`~tierckpt.errors.FlushError`).
        """
        lease = self.memory.hold(snapshot)

        async def persist() -> None:
            began = time.monotonic()
            try:
                await self.memory.persist(snapshot)
            except Exception as exc:
                failure = flush_failure(self.memory.name, snapshot.step, f"writing step {snapshot.step} to its RAM file system", exc)
                self._counters.record(self.memory.name, failure)
                self._events.emit("flush_failed", step=snapshot.step, tier=self.memory.name, error=failure)
                log.error("%s; the snapshot stays in this process's memory only", failure)
                result: bool | BaseException = failure
            else:
                result = True
                self._events.emit("flushed", step=snapshot.step, tier=self.memory.name, bytes=snapshot.nbytes, seconds=time.monotonic() - began)
            finally:
                lease.release()
            done(result)

        self._spawn(persist())

    def flush_adopted(self, flushers: Sequence[Flusher]) -> None:
        """Offer the snapshots a previous process left (if any) to ``flushers``, in the background."""
        if self.memory.adopted():
            self._spawn(self._flush_adopted(flushers))

    async def _flush_adopted(self, all_flushers: Sequence[Flusher]) -> None:
        """Snapshots a killed process left in RAM go on down, as they would have gone: each to the tiers
        that hold nothing as new, after it verified (a damaged one stays out)."""
        checked: list[tuple[Snapshot, list[Flusher], Lease]] = []
        try:
            for snapshot in self.memory.adopted():
                # Newer by the save's order (tierckpt.format.lineage): after a rollback a snapshot of
                # the new direction has a lower step than what the tier still holds of the old one.
                newer = order_key(snapshot)
                flushers = [f for f in all_flushers if newer > max((order_key(v) for v in f.tier.versions()), default=(-1, -1, 0.0))]
                if not flushers:
                    continue
                lease = self.memory.hold(snapshot)  # retention must not drop it before the flushers want it
                try:
                    await self.memory.verify(snapshot)
                except CorruptCheckpointError as exc:
                    lease.release()
                    log.warning("%s; it is not flushed to %s", exc, ", ".join(repr(f.tier.name) for f in flushers))
                    continue
                checked.append((snapshot, flushers, lease))
            # All at once, oldest first, as their saves came: a newest_only tier then takes the newest.
            for snapshot, flushers, _ in checked:
                for flusher in flushers:
                    # Arrival 0: every `every` counts it (the count starts again with this process).
                    flusher.offer(snapshot.step, snapshot.seq, arrival=0)
        finally:
            for _, _, lease in checked:
                lease.release()

    async def wait(self) -> None:
        """Until every write and hand-on started so far has ended (a failure is reported by then)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
