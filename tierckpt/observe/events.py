"""Events: what the pipeline did, as it happens, handed to whoever listens (:class:`Events`).

One :class:`Event` per thing an operator asks about: a save call, a capture, a flush, a failure, a
version passed over, evicted or deleted, a restore. The listeners (sinks) are the events file
(:mod:`tierckpt.observe.eventfile`), the Prometheus metrics (:mod:`tierckpt.observe.metrics`) and the
dotted log records (:mod:`tierckpt.observe.records`). Events are emitted on the thread where the thing
happened (the training thread for ``save``, the engine thread for the rest), so a sink's ``handle``
must be quick and thread-safe and must never block: the events file only queues the line.

A sink that raises is logged once and dropped: observing never fails a save or loses a checkpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

log = logging.getLogger("tierckpt")

__all__ = ["EVENTS", "Event", "Events", "Sink"]

# Every event's name, and what its fields hold beyond ``time``, ``event`` and ``rank``.
EVENTS: dict[str, str] = {
    "save": "step; seconds: the save() call, up to starting its copies; bytes: the state's",
    "save_skipped": "step: every host slot was busy (host.on_full: skip), or being read (evict)",
    "captured": "step; seconds: since the save() call began; bytes: copied into host memory",
    "capture_failed": "step; tier: the memory tier; error",
    "flushed": "step; tier; seconds: the flush (read, write, commit); bytes: stored on the tier",
    "flush_failed": "step (null: the flusher itself); tier; error",
    "passed_over": "step; tier: a tier that did not take this save (its flush policy, or a newer one waiting)",
    "evicted": "step; tier: the memory tier; a save took its host slot before every tier below had it",
    "deleted": "step; tier: retention removed the version",
    "delete_failed": "step; tier; error",
    "restored": "step; tier: read from; seconds: the restore call; bytes: stored bytes of the version read",
    "restore_failed": "step (null: the newest); error",
}


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened. ``time``: Unix seconds when it happened (for ``save``, just before the
    call starts its copies; ``time - seconds`` is when it began, for every event that has ``seconds``)."""

    event: str
    time: float
    rank: int
    step: int | None = None
    tier: str | None = None
    bytes: int | None = None
    seconds: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The event as one JSON object: every field, null where it does not apply."""
        return {
            "time": self.time, "event": self.event, "step": self.step, "tier": self.tier,
            "bytes": self.bytes, "seconds": self.seconds, "rank": self.rank, "error": self.error,
        }


class Sink(Protocol):
    """A listener: ``handle`` is called for every event, on the thread that emits it."""

    def handle(self, event: Event) -> None: ...

    def close(self) -> None: ...


class Events:
    """Hands each event to every sink; with none, :meth:`emit` returns at once."""

    def __init__(self, rank: int = 0, sinks: Sequence[Sink] = ()) -> None:
        self.rank = rank
        self._sinks = list(sinks)
        self._lock = threading.Lock()  # a sink dropped on one thread while another emits

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return tuple(self._sinks)

    def emit(
        self, event: str, *, step: int | None = None, tier: str | None = None, bytes: int | None = None,
        seconds: float | None = None, error: BaseException | str | None = None,
    ) -> None:
        sinks = self._sinks
        if not sinks:
            return
        assert event in EVENTS, event
        if isinstance(error, BaseException):
            error = str(error) or type(error).__name__
        happened = Event(event, time.time(), self.rank, step, tier, bytes, seconds, error)
        for sink in sinks:
            try:
                sink.handle(happened)
            except Exception as exc:  # a broken listener must not break what it listens to
                self._drop(sink, exc)

    def _drop(self, sink: Sink, exc: BaseException) -> None:
        with self._lock:
            if sink not in self._sinks:
                return
            self._sinks = [s for s in self._sinks if s is not sink]
        log.error("observability: %s failed and is switched off (checkpointing goes on): %s", type(sink).__name__, exc)

    def close(self) -> None:
        """Close every sink (the events file is flushed; the metrics endpoint stops)."""
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:
                log.error("observability: closing %s failed: %s", type(sink).__name__, exc)
