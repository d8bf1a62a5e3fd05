"""Fill a slot from the live state while training goes on (lazy capture).

``save()`` only enqueues the copies. The training loop may run forward and backward meanwhile (they
read parameters and optimizer state, never write them); the step pre-hook calls
:meth:`Copier.wait_captured` before the optimizer overwrites anything. Buffers that forward updates
in place (BatchNorm running statistics) need a forward pre-hook barrier (``attach(module)``); a
tensor whose in-place version counter moved before its copy finished fails the capture loudly
instead of storing a snapshot that mixes two steps.

CUDA tensors go to :class:`~tierckpt.capture.device.DeviceCopies` (a side stream per device; the
barrier makes the compute stream wait, not the host). Everything else is copied by copy threads:
large contiguous tensors are split into pieces so every thread works on one big tensor at once, and
each thread gets one batch per snapshot, balanced by bytes. The plan is made once per layout (the
engine thread does no per-tensor work while a state keeps its layout), and each thread copies its
batch's whole tensors with one ``torch._foreach_copy_`` into views of the slot made once per slot
and layout. Every torch call lets go of the interpreter lock, and each time the training thread and
a copy thread then take turns: measured here, 150 small jobs per save cost the caller 1-3 ms of
lock waits on 2 cores, and one ``copy_`` per tensor for 600 small tensors slowed a launch-bound
thread's next 2 ms to 10.8 ms, against 2.4 ms with one call per batch.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from tierckpt.capture.device import DeviceCopies
from tierckpt.capture.pool import HostPool
from tierckpt.capture.views import SaveMoment, TornCaptureError, check_unchanged, slot_tensor, source_tensor, tensor_pair
from tierckpt.snapshot import Entry, Slot, Snapshot

__all__ = ["Copier", "TornCaptureError"]

_PIECE_BYTES = 64 << 20


class _Countdown:
    """Completes ``future`` once all ``n`` jobs have finished, with the first failure if any.

    A failed capture completes only after every job has stopped, so its slot is never handed to a
    new snapshot while a copy into it is still running.
    """

    def __init__(self, n: int, future: concurrent.futures.Future[None]) -> None:
        self._left = n
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._future = future

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._left -= 1
            if error is not None and self._error is None:
                self._error = error
            if self._left:
                return
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(None)


# One copy job: (leaf index, first element, stop element); stop None for the whole leaf.
_Item = tuple[int, int, Optional[int]]


@dataclass(frozen=True)
class _Batch:
    """One copy thread's share of a snapshot: ``whole``, torch leaves copied in one ``_foreach_copy_``
    call; ``items``, the rest one by one (pieces of large tensors, numpy arrays)."""

    whole: tuple[int, ...]
    items: tuple[_Item, ...]


@dataclass(frozen=True)
class _Plan:
    """Which thread copies what of a state's leaves. Made once per layout and reused while the state
    keeps it, so that a ``save()`` of hundreds of tensors does no per-tensor work on the engine thread
    (planning 600 leaves cost 0.7 ms a save there, ahead of the caller's return)."""

    entries: tuple[Entry, ...]  # the layout it was made for (the very tuple: layouts are cached)
    on_device: tuple[int, ...]  # the leaves the device stage copies
    split: tuple[int, ...]  # leaves cut into pieces, planned for contiguous values
    batches: tuple[_Batch, ...]  # one per copy thread, balanced by bytes
    # Per (slot, batch index): the slot views a batch's ``whole`` leaves are copied into, made
    # by its thread at its first copy into that slot, then reused (a slot keeps its layout).
    views: dict[tuple[Slot, int], list[torch.Tensor]] = field(default_factory=dict, compare=False)

    def fits(self, entries: tuple[Entry, ...], values: Sequence[Any], on_device: tuple[int, ...]) -> bool:
        return entries is self.entries and on_device == self.on_device and all(_contiguous(values[i], entries[i].kind) for i in self.split)


class Copier:
    """Runs the host copies of every snapshot; owns the copy threads and the device stage, and shuts them down."""

    def __init__(self, pool: HostPool, threads: int) -> None:
        self._pool = pool
        self._threads = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-copy")
        self._devices: DeviceCopies | None = None  # made at the first CUDA tensor
        self._pending: set[concurrent.futures.Future[None]] = set()  # the copy threads' part of each capture
        self._lock = threading.Lock()
        self._plan: _Plan | None = None  # the last layout's, reused while saves keep it

    def start(self, snapshot: Snapshot, values: Sequence[Any], seen: SaveMoment) -> None:
        """Enqueue the copies of a state's leaf ``values`` into ``snapshot``'s slot; ``snapshot.capture``
        completes after.

        ``seen``: the leaves' version counters and CUDA events read by ``save()`` on the caller's thread
        (:func:`~tierckpt.capture.views.moment`).
        """
        plan = self._plan
        if plan is None or not plan.fits(snapshot.entries, values, seen.on_device):
            plan = self._plan = _make_plan(snapshot.entries, values, seen.on_device, self._threads)
        future = snapshot.capture
        # The copies run whatever a waiter does: a cancelled await (wait() under a timeout) must not
        # cancel the capture, or its slot would stay "capturing" forever. A running future cannot be.
        future.set_running_or_notify_cancel()
        parts = bool(plan.batches) + bool(plan.on_device)
        if not parts:
            future.set_result(None)
            return
        countdown = _Countdown(parts, future)
        if plan.on_device:
            if self._devices is None:
                self._devices = DeviceCopies(self._pool)
            items = [(values[i], snapshot.entries[i], seen.versions[i]) for i in plan.on_device]
            self._devices.start(snapshot, items, seen.ready, countdown.finish)
        if plan.batches:
            on_threads: concurrent.futures.Future[None] = concurrent.futures.Future()
            on_threads.set_running_or_notify_cancel()
            with self._lock:
                self._pending.add(on_threads)
            on_threads.add_done_callback(self._forget)
            on_threads.add_done_callback(lambda f: countdown.finish(f.exception()))
            threads = _Countdown(len(plan.batches), on_threads)
            for b in range(len(plan.batches)):
                self._executor.submit(_run, self._pool, snapshot, values, seen.versions, plan, b, threads)

    def wait_captured(self, timeout: float | None = None, *, host: bool = False) -> bool:
        """The barrier: wait until what ``save()`` calls so far copy can no longer be overwritten.

        Host copies: block until done. CUDA copies: block until queued, then make each device's
        current stream wait for them (``host=True``: block until done). False if ``timeout`` ran out.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._devices is not None:
            devices = self._devices.wait if host else self._devices.order
            if not devices(timeout):
                return False
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        _, not_done = concurrent.futures.wait(pending, timeout=left)
        return not not_done

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._plan = None  # its views of the pool's slots: the pool is unmapped next
        if self._devices is not None:
            self._devices.close()

    def _forget(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)


def _contiguous(value: Any, kind: str) -> bool:
    return bool(value.is_contiguous() if kind == "torch" else value.flags.c_contiguous)


def _make_plan(entries: tuple[Entry, ...], values: Sequence[Any], on_device: tuple[int, ...], threads: int) -> _Plan:
    """Host leaves in pieces of at most ``_PIECE_BYTES`` (contiguous ones; others whole), balanced
    over ``threads`` batches: greedy, biggest piece first, onto the thread with the fewest bytes."""
    device = set(on_device)
    pieces: list[tuple[int, _Item]] = []  # (bytes, item)
    split = []
    for index, (value, entry) in enumerate(zip(values, entries)):
        if index in device:
            continue
        if entry.nbytes <= _PIECE_BYTES or value.ndim == 0 or not _contiguous(value, entry.kind):
            pieces.append((entry.nbytes, (index, 0, None)))
            continue
        split.append(index)
        numel = value.numel() if entry.kind == "torch" else value.size
        itemsize = entry.nbytes // numel
        step = max(1, _PIECE_BYTES // itemsize)
        pieces.extend(((min(a + step, numel) - a) * itemsize, (index, a, min(a + step, numel))) for a in range(0, numel, step))
    batches: list[list[_Item]] = [[] for _ in range(min(threads, len(pieces)))]
    loads = [0] * len(batches)
    for nbytes, item in sorted(pieces, key=lambda p: -p[0]):
        i = loads.index(min(loads))
        batches[i].append(item)
        loads[i] += nbytes
    return _Plan(entries, on_device, tuple(split), tuple(_batch(b, entries) for b in batches))


def _batch(items: list[_Item], entries: Sequence[Entry]) -> _Batch:
    whole = tuple(item[0] for item in items if item[2] is None and entries[item[0]].kind == "torch")
    together = set(whole)
    return _Batch(whole, tuple(item for item in items if item[0] not in together))


def _copy(pool: HostPool, snapshot: Snapshot, value: Any, version: int, item: _Item) -> None:
    index, first, stop = item
    entry = snapshot.entries[index]
    if entry.kind == "torch":
        dest, src = tensor_pair(pool, snapshot, value, entry, first, stop)
        dest.copy_(src)
        check_unchanged(snapshot, entry.key, value, version)
    else:
        import numpy as np

        dest = pool.array(snapshot.slot, entry.offset, entry.nbytes, entry.dtype, entry.shape)
        src = value
        if stop is not None:
            src, dest = src.reshape(-1)[first:stop], dest.reshape(-1)[first:stop]
        np.copyto(dest, src)


def _run(pool: HostPool, snapshot: Snapshot, values: Sequence[Any], versions: Sequence[int], plan: _Plan, b: int, countdown: _Countdown) -> None:
    error = None
    batch = plan.batches[b]
    try:
        # Grad mode is per thread: without this, copying a tensor that requires grad records autograd history.
        with torch.no_grad():
            if batch.whole:
                # One call for all of them: one release of the interpreter lock instead of one per
                # tensor. Each release lets the training thread in and makes this thread wait for the
                # lock again: 600 small tensors slowed a launch-bound thread's next 2 ms by 9 ms here.
                torch._foreach_copy_(_views(pool, snapshot, plan, b), [source_tensor(values[i]) for i in batch.whole])
                for i in batch.whole:
                    check_unchanged(snapshot, snapshot.entries[i].key, values[i], versions[i])
            for item in batch.items:
                _copy(pool, snapshot, values[item[0]], versions[item[0]], item)
    except BaseException as exc:  # reported through the snapshot's future, re-raised at the next save()
        error = exc
    countdown.finish(error)


def _views(pool: HostPool, snapshot: Snapshot, plan: _Plan, b: int) -> list[torch.Tensor]:
    """The slot views batch ``b``'s whole leaves are copied into (made once per slot and plan). Keyed
    by the slot itself, not its index: a pool sized to the state maps new slots as the state grows."""
    key = (snapshot.slot, b)
    views = plan.views.get(key)
    if views is None:
        entries = [snapshot.entries[i] for i in plan.batches[b].whole]
        views = plan.views[key] = [slot_tensor(pool, snapshot, e) for e in entries]
    return views
