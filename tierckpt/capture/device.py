"""The CUDA side of a capture: copies on a side stream per device, into the (pinned) host slot.

``save()`` records an event on each device's current stream (everything queued before ``save()``).
One queueing thread then makes that device's copy stream (created once) wait for the event, queues
one ``non_blocking`` copy per tensor into the slot and records a done event on the copy stream. The
training thread queues nothing itself: 200 copy launches cost milliseconds of Python and driver time,
more than ``save()`` may take.

The lazy barrier (:meth:`DeviceCopies.order`) does not wait for the copies on the host. It waits only
until they are queued (normally long done when the optimizer steps), then makes the current stream
of each device wait on the done event: kernels queued after the barrier (the optimizer's in-place
updates) run after the copies, in the GPU's own order, and the host goes on at once.

A waiter thread sleeps on the done events (blocking-sync events: no spinning core) and then
completes the capture; only then do the tiers read the slot. The sources stay referenced until
then, so the caching allocator cannot give their memory to a new tensor while a copy stream still
reads it.

In-place writes that bypass the barrier fail the capture (:class:`TornCaptureError`) where they can
be seen: a tensor whose version counter moved before its copy was queued, before a barrier ordered
the streams, or before its copy finished with no barrier at all. A write on another stream after the
barrier ran on this one cannot be seen: order it with ``wait_captured()`` under that stream.

A non-contiguous source is copied through a contiguous temporary on the copy stream (torch's
``copy_`` makes it): device memory as large as that tensor, cached for the copy stream afterwards.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from tierckpt.capture.pool import HostPool
from tierckpt.capture.views import TornCaptureError, check_unchanged, slot_tensor, source_tensor
from tierckpt.snapshot import Entry, Slot, Snapshot


@dataclass(eq=False)
class _Batch:
    """One snapshot's device tensors: queued once, completed once."""

    snapshot: Snapshot
    items: Sequence[tuple[torch.Tensor, Entry, int]]  # a leaf's value, its entry, its version counter at save()
    ready: Mapping[torch.device, Any]  # per device: the event recorded at save() on its current stream
    done: Callable[[BaseException | None], None]
    queued: threading.Event = field(default_factory=threading.Event)
    completed: threading.Event = field(default_factory=threading.Event)
    events: dict[torch.device, Any] = field(default_factory=dict)
    ordered: bool = False  # a barrier made some stream wait for the copies: later writes are safe
    error: BaseException | None = None


class DeviceCopies:
    """Queues the device-to-host copies of every snapshot and completes them; owns its two threads."""

    def __init__(self, pool: HostPool) -> None:
        self._pool = pool
        self._streams: dict[torch.device, Any] = {}
        self._queue = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-cuda")
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-cuda-wait")
        self._pending: list[_Batch] = []
        self._lock = threading.Lock()
        # Per (slot, device): the entries last copied there, and their slot views (_views).
        self._slot_views: dict[tuple[Slot, torch.device], tuple[list[Entry], list[torch.Tensor]]] = {}

    def start(
        self,
        snapshot: Snapshot,
        items: Sequence[tuple[torch.Tensor, Entry, int]],
        ready: Mapping[torch.device, Any],
        done: Callable[[BaseException | None], None],
    ) -> None:
        """Queue the copies of ``items``; ``done(error)`` is called once they have finished (or failed)."""
        batch = _Batch(snapshot, items, ready, done)
        with self._lock:
            self._pending.append(batch)
        self._queue.submit(self._launch, batch)

    def order(self, timeout: float | None = None) -> bool:
        """The barrier: the current stream of each device waits for every capture started so far.

        Blocks the host only until those copies are queued; False if ``timeout`` ran out first.
        """
        with self._lock:
            pending = list(self._pending)
        deadline = None if timeout is None else time.monotonic() + timeout
        for batch in pending:
            if not batch.queued.wait(_left(deadline)):
                return False
        with self._lock:  # against _complete's own check: one of the two sees each change
            for batch in pending:
                if batch.error is None and not batch.ordered and not batch.completed.is_set():
                    # Changed before this barrier ordered anything: unordered with the copy.
                    batch.error = _torn(batch)
                batch.ordered = True
        for batch in pending:
            for device, event in batch.events.items():
                torch.cuda.current_stream(device).wait_event(event)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block the host until every capture started so far has finished; False if ``timeout`` ran out."""
        with self._lock:
            pending = list(self._pending)
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(batch.completed.wait(_left(deadline)) for batch in pending)

    def close(self) -> None:
        self._queue.shutdown(wait=True)
        self._waiter.shutdown(wait=True)
        self._slot_views.clear()  # views of the pool's slots: the pool is unmapped next

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _launch(self, batch: _Batch) -> None:
        used = []
        try:
            by_device: dict[torch.device, list[tuple[torch.Tensor, Entry, int]]] = {}
            for item in batch.items:
                by_device.setdefault(item[0].device, []).append(item)
            with torch.no_grad():  # grad mode is per thread
                for device, items in by_device.items():
                    stream = self._stream(device)
                    used.append(stream)
                    batch.events[device] = self._queue_copies(batch, stream, device, items)
            # Written before its copy was even queued: no barrier can have ordered that write.
            _check(batch)
        except BaseException as exc:  # reported through the snapshot's capture
            batch.error = exc
            for stream in used:  # what was queued must finish before the slot can be reused
                stream.synchronize()
            batch.events.clear()
        finally:
            batch.queued.set()
            self._waiter.submit(self._complete, batch)

    def _queue_copies(self, batch: _Batch, stream: Any, device: torch.device, items: list[tuple[torch.Tensor, Entry, int]]) -> Any:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            ready = batch.ready.get(device)
            if ready is not None:
                stream.wait_event(ready)
            sources = []
            for value, _, _ in items:
                src = source_tensor(value)
                if src.is_conj() or src.is_neg():
                    # A cross-device copy applies these bits to the host copy afterwards, on the host,
                    # racing the DMA: resolve them on the device first, on this stream.
                    src = src.resolve_conj().resolve_neg()
                sources.append(src)
            # One call queues every copy (torch's own loop of non_blocking copy_ for tensors on two
            # devices): the interpreter lock is let go once, not once per tensor, each time making the
            # training thread's kernel launches and this thread take turns (on CPU copies, one release
            # per tensor slowed a launch-bound thread's next 2 ms by 9 ms; see copier.py).
            torch._foreach_copy_(self._views(batch.snapshot, device, items), sources, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
        return done

    def _views(self, snapshot: Snapshot, device: torch.device, items: list[tuple[torch.Tensor, Entry, int]]) -> list[torch.Tensor]:
        """The slot views ``items``' copies go into: made at the first copy of a layout into a slot,
        then reused while saves keep that layout (a slot's layout is its entries)."""
        key = (snapshot.slot, device)  # the slot itself: a pool sized to the state maps new ones as it grows
        entries = [entry for _, entry, _ in items]
        cached = self._slot_views.get(key)
        if cached is None or len(cached[0]) != len(entries) or any(a is not b for a, b in zip(cached[0], entries)):
            if cached is None:  # a slot not seen before: let go of the views of slots the pool no longer hands out
                current = self._pool.slots
                for old in [k for k in self._slot_views if not any(k[0] is s for s in current)]:
                    del self._slot_views[old]
            cached = self._slot_views[key] = (entries, [slot_tensor(self._pool, snapshot, e) for e in entries])
        return cached[1]

    def _complete(self, batch: _Batch) -> None:
        failure = None
        for event in batch.events.values():  # every one, even after a failure: the slot is reused after
            try:
                event.synchronize()
            except BaseException as exc:
                failure = failure or exc
        with self._lock:
            error = batch.error or failure
            if error is None and not batch.ordered:
                # No barrier yet: whatever changed, changed unordered with the copy.
                error = _torn(batch)
            self._pending.remove(batch)
            batch.items = ()  # the sources may go now
            batch.completed.set()
        batch.done(error)


def _check(batch: _Batch) -> None:
    for value, entry, version in batch.items:
        check_unchanged(batch.snapshot, entry.key, value, version)


def _torn(batch: _Batch) -> TornCaptureError | None:
    try:
        _check(batch)
    except TornCaptureError as exc:
        return exc
    return None


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
