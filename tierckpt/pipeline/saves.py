"""What one save asks of the pipeline (:class:`SaveRequest`), what its handle waits on
(:class:`SaveTracker`), and what the pipeline did so far (:class:`Counters`)."""

from __future__ import annotations

import concurrent.futures
import threading
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from tierckpt.capture.views import SaveMoment, TornCaptureError
from tierckpt.errors import FlushError, TierckptError
from tierckpt.format.layout import after_where
from tierckpt.snapshot import Entry
from tierckpt.tiers.base import Tier
from tierckpt.tiers.stored.encoding import CompressionStats, TierEncoding


class Handoff:
    """Who starts a save's copies: whichever of the engine (the save is admitted) and the caller (done
    waiting for it) comes second. Normally the caller, once it has its handle: copy threads started
    before it woke took turns with it for the interpreter lock, in the middle of the call (measured
    here: 0.1-0.3 ms of a 1.2 ms ``save()`` of 600 tensors). A caller that stopped waiting early (a
    cancelled await, an interrupt) comes first, and the engine starts them as it admits the save: an
    admitted snapshot always gets its copies, or its slot would never come back.
    """

    __slots__ = ("_lock", "_start", "_caller_done")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start: Callable[[], None] | None = None
        self._caller_done = False

    def admitted(self, start: Callable[[], None]) -> None:
        """The engine: the save has its snapshot; ``start()`` starts its copies."""
        with self._lock:
            if not self._caller_done:
                self._start = start
                return
        start()

    def caller_done(self) -> None:
        """The caller: it has its handle, or stopped waiting. Starts the copies if the save was admitted."""
        with self._lock:
            self._caller_done = True
            start, self._start = self._start, None
        if start is not None:
            start()


@dataclass(frozen=True)
class SaveRequest:
    """One ``save()``, checked and laid out on the caller's thread, for :meth:`Pipeline.save`."""

    step: int
    values: Sequence[Any]  # the state's arrays (a DTensor's local tensor), in skeleton order
    entries: tuple[Entry, ...]  # where each leaf goes in a slot (plan_entries)
    nbytes: int  # slot bytes the entries need
    skeleton: Any  # the state without its arrays (msgpack-able)
    metadata: dict[str, Any]
    seen: SaveMoment  # what save() saw of each leaf (tensor versions, CUDA events)
    began: float = 0.0  # time.monotonic() when the save() call began
    handoff: Handoff = field(default_factory=Handoff, compare=False)


@dataclass
class SaveTracker:
    """The futures a SaveHandle waits on: captured, and committed per tier (True, False, or an error)."""

    step: int
    token: int  # the snapshot's seq; 0 for a skipped save
    captured: concurrent.futures.Future[bool] = field(default_factory=concurrent.futures.Future)
    committed: dict[str, concurrent.futures.Future[bool]] = field(default_factory=dict)
    began: float = 0.0  # time.monotonic() when its save() call began (0: unknown)

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
    flush_errors: int = 0  # failed flushes and deletions, all tiers
    evicted_saves: int = 0  # captured snapshots dropped from host memory before a tier that could get them nowhere else took them (on_full: evict)
    forced: dict[str, int] = field(default_factory=dict)  # versions a tier took only because max_staleness had passed
    # Per filesystem tier: bytes before/after compression, chunks kept raw, measured throughputs.
    compression: dict[str, CompressionStats] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)  # flushes and deletions that failed, per tier
    # The latest of those per tier, with its step, errno and path; kept after the tier works again
    # (compare its step with the versions the tier holds).
    last_error: dict[str, FlushError] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # dataclasses.replace() goes through here: a copy never shares the per-tier dicts.
        self.flushed, self.passed_over, self.forced = dict(self.flushed), dict(self.passed_over), dict(self.forced)
        self.compression = dict(self.compression)
        self.failed, self.last_error = dict(self.failed), dict(self.last_error)

    def record(self, tier: str, failure: FlushError) -> None:
        """Count a failed flush or deletion of ``tier`` and keep it as the tier's ``last_error``."""
        # Kept for as long as the Checkpointer lives: drop the locals of the frames its traceback holds
        # (a writer thread's frame holds views of a host slot, which would keep the pool mapped).
        seen: set[int] = set()
        error: BaseException | None = failure
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            if error.__traceback__ is not None:
                traceback.clear_frames(error.__traceback__)
            error = error.__cause__ or error.__context__
        self.flush_errors += 1
        self.failed[tier] = self.failed.get(tier, 0) + 1
        self.last_error[tier] = failure

    def with_compression(self, tiers: Sequence[Tier]) -> Counters:
        """A copy, with the compression so far of each tier that encodes what it stores (``Checkpointer.counters``)."""
        compression = {t.name: e.stats for t in tiers if isinstance(e := getattr(t, "encoding", None), TierEncoding)}
        return replace(self, compression=compression)


def capture_failure(error: BaseException, step: int) -> str:
    """A failed capture's error in words, for the FlushError that reports it: its message less the
    ``step N:`` that FlushError names already, led by its type where it is not one of tierckpt's
    (``RuntimeError: CUDA error: ...``); never a nested ``repr``."""
    text = after_where(error, None, step)
    if isinstance(error, (TierckptError, TornCaptureError)) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
