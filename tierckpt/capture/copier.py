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
each thread gets one batch per snapshot, balanced by bytes, and builds its own views of the slot:
the engine thread only plans, and the threads take the GIL once per piece, not once per job
hand-off (measured: 150 small jobs per save cost the caller 1-3 ms of GIL waits on 2 cores).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from tierckpt.capture.device import DeviceCopies
from tierckpt.capture.pool import HostPool
from tierckpt.capture.views import SaveMoment, TornCaptureError, check_unchanged, tensor_pair
from tierckpt.snapshot import Entry, Snapshot
from tierckpt.state import Leaf

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


@dataclass(slots=True)  # not frozen: hundreds are made per save(), and a frozen init costs 2.5x
class _Piece:
    """Elements ``[first, stop)`` of one leaf, or the whole leaf when ``stop`` is None."""

    leaf: Leaf
    entry: Entry
    first: int = 0
    stop: int | None = None
    itemsize: int = 0
    version: int = -1  # the tensor's in-place version counter when save() was called

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes if self.stop is None else (self.stop - self.first) * self.itemsize


class Copier:
    """Runs the host copies of every snapshot; owns the copy threads and the device stage, and shuts them down."""

    def __init__(self, pool: HostPool, threads: int) -> None:
        self._pool = pool
        self._threads = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-copy")
        self._devices: DeviceCopies | None = None  # made at the first CUDA tensor
        self._pending: set[concurrent.futures.Future[None]] = set()  # the copy threads' part of each capture
        self._lock = threading.Lock()

    def start(self, snapshot: Snapshot, leaves: Sequence[Leaf], seen: SaveMoment) -> None:
        """Enqueue the copies of ``leaves`` into ``snapshot``'s slot; ``snapshot.capture`` completes after.

        ``seen``: the leaves' version counters and CUDA events read by ``save()`` on the caller's thread
        (:func:`~tierckpt.capture.views.moment`).
        """
        on_device, on_host = [], []
        for leaf, entry, version in zip(leaves, snapshot.entries, seen.versions):
            if leaf.kind == "torch" and leaf.value.is_cuda:
                on_device.append((leaf, entry, version))
            else:
                on_host.extend(_pieces(leaf, entry, version))
        batches = _balance(on_host, self._threads)
        future = snapshot.capture
        # The copies run whatever a waiter does: a cancelled await (wait() under a timeout) must not
        # cancel the capture, or its slot would stay "capturing" forever. A running future cannot be.
        future.set_running_or_notify_cancel()
        parts = bool(batches) + bool(on_device)
        if not parts:
            future.set_result(None)
            return
        countdown = _Countdown(parts, future)
        if on_device:
            if self._devices is None:
                self._devices = DeviceCopies(self._pool)
            self._devices.start(snapshot, on_device, seen.ready, countdown.finish)
        if batches:
            on_threads: concurrent.futures.Future[None] = concurrent.futures.Future()
            on_threads.set_running_or_notify_cancel()
            with self._lock:
                self._pending.add(on_threads)
            on_threads.add_done_callback(self._forget)
            on_threads.add_done_callback(lambda f: countdown.finish(f.exception()))
            threads = _Countdown(len(batches), on_threads)
            for batch in batches:
                self._executor.submit(_run, self._pool, snapshot, batch, threads)

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
        if self._devices is not None:
            self._devices.close()

    def _forget(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)


def _pieces(leaf: Leaf, entry: Entry, version: int) -> list[_Piece]:
    value = leaf.value
    torch_leaf = leaf.kind == "torch"
    contiguous = value.is_contiguous() if torch_leaf else value.flags.c_contiguous
    if not contiguous or entry.nbytes <= _PIECE_BYTES or value.ndim == 0:
        return [_Piece(leaf, entry, version=version)]
    numel = value.numel() if torch_leaf else value.size
    itemsize = entry.nbytes // numel
    step = max(1, _PIECE_BYTES // itemsize)
    return [_Piece(leaf, entry, a, min(a + step, numel), itemsize, version) for a in range(0, numel, step)]


def _balance(pieces: list[_Piece], threads: int) -> list[list[_Piece]]:
    """Greedy: biggest piece first, onto the thread with the fewest bytes so far."""
    batches: list[list[_Piece]] = [[] for _ in range(min(threads, len(pieces)))]
    loads = [0] * len(batches)
    for piece in sorted(pieces, key=lambda p: -p.nbytes):
        i = loads.index(min(loads))
        batches[i].append(piece)
        loads[i] += piece.nbytes
    return batches


def _copy(pool: HostPool, snapshot: Snapshot, piece: _Piece) -> None:
    entry = piece.entry
    if piece.leaf.kind == "torch":
        dest, src = tensor_pair(pool, snapshot, piece.leaf, entry, piece.first, piece.stop)
        dest.copy_(src)
        check_unchanged(snapshot, entry.key, piece.leaf.value, piece.version)
    else:
        import numpy as np

        dest = pool.array(snapshot.slot, entry.offset, entry.nbytes, entry.dtype, entry.shape)
        src = piece.leaf.value
        if piece.stop is not None:
            src, dest = src.reshape(-1)[piece.first : piece.stop], dest.reshape(-1)[piece.first : piece.stop]
        np.copyto(dest, src)


def _run(pool: HostPool, snapshot: Snapshot, batch: list[_Piece], countdown: _Countdown) -> None:
    error = None
    try:
        # Grad mode is per thread: without this, copying a tensor that requires grad records autograd history.
        with torch.no_grad():
            for piece in batch:
                _copy(pool, snapshot, piece)
    except BaseException as exc:  # reported through the snapshot's future, re-raised at the next save()
        error = exc
    countdown.finish(error)
