"""Copy threads that fill a slot from the live state while training goes on (lazy capture on CPU).

``save()`` only enqueues the copies. The training loop may run forward and backward meanwhile (they
read parameters, never write them); the step pre-hook calls :meth:`Copier.wait_captured` before the
optimizer overwrites anything. Large contiguous tensors are split into pieces so every copy thread
works on one big tensor at once.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, Callable, Sequence

import torch

from tierckpt.capture.pool import HostPool
from tierckpt.snapshot import Entry, Snapshot
from tierckpt.state import Leaf

_PIECE_BYTES = 64 << 20


class _Countdown:
    """Completes ``future`` once all ``n`` jobs have finished, with the first failure if any.

    A failed capture completes only after every job has stopped, so its slot is never handed to a
    new snapshot while a copy into it is still running.
    """

    def __init__(self, n: int, future: concurrent.futures.Future[None], on_done: Callable[[], None]) -> None:
        self._left = n
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._future = future
        self._on_done = on_done

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
            self._on_done()
            self._future.set_result(None)


class Copier:
    """Runs the host copies of every snapshot on ``threads`` threads; owns them and shuts them down."""

    def __init__(self, pool: HostPool, threads: int) -> None:
        self._pool = pool
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-copy")
        self._pending: set[concurrent.futures.Future[None]] = set()
        self._lock = threading.Lock()

    def start(self, snapshot: Snapshot, leaves: Sequence[Leaf], started: float) -> None:
        """Enqueue the copies of ``leaves`` into ``snapshot``'s slot; ``snapshot.capture`` completes after."""
        jobs = [job for leaf, entry in zip(leaves, snapshot.entries) for job in self._jobs(snapshot, leaf, entry)]
        future = snapshot.capture
        # The copies run whatever a waiter does: a cancelled await (wait() under a timeout) must not
        # cancel the capture, or its slot would stay "capturing" forever. A running future cannot be.
        future.set_running_or_notify_cancel()
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

        def done() -> None:
            snapshot.capture_s = time.perf_counter() - started

        if not jobs:
            done()
            future.set_result(None)
            return
        countdown = _Countdown(len(jobs), future, done)
        for job in jobs:
            self._executor.submit(_run, job, countdown)

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Block until every capture started so far has finished; False if ``timeout`` ran out."""
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return True
        _, not_done = concurrent.futures.wait(pending, timeout=timeout)
        return not not_done

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _forget(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)

    def _jobs(self, snapshot: Snapshot, leaf: Leaf, entry: Entry) -> list[Callable[[], None]]:
        pool, slot = self._pool, snapshot.slot
        pad = -entry.nbytes % 4096
        jobs: list[Callable[[], None]] = []
        if leaf.kind == "torch":
            dest = pool.tensor(slot, entry.offset, entry.nbytes, entry.dtype, entry.shape)
            src = leaf.value.detach()
            if src.element_size() == 1 and src.dtype is not torch.uint8:
                # Sub-byte dtypes (uint1..7, int1..7) have no copy kernel; every 1-byte dtype copies
                # bitwise as uint8, at any strides.
                src, dest = src.view(torch.uint8), dest.view(torch.uint8)
            jobs += _split(src, dest, entry.nbytes, lambda d, s: d.copy_(s), src.is_contiguous())
        else:
            import numpy as np

            dest = pool.array(slot, entry.offset, entry.nbytes, entry.dtype, entry.shape)
            src = leaf.value
            jobs += _split(src, dest, entry.nbytes, lambda d, s: np.copyto(d, s), src.flags.c_contiguous)
        if pad:
            # Padding reaches the disk with O_DIRECT writes; zero it so no older snapshot leaks into files.
            tail = pool.raw(slot, entry.offset + entry.nbytes, pad)
            jobs.append(tail.zero_)
        return jobs


def _split(src: Any, dest: Any, nbytes: int, copy: Callable[[Any, Any], Any], contiguous: bool) -> list[Callable[[], None]]:
    if not contiguous or nbytes <= _PIECE_BYTES or src.ndim == 0:
        return [lambda: copy(dest, src)]
    flat_src, flat_dest = src.reshape(-1), dest.reshape(-1)
    step = max(1, _PIECE_BYTES // max(1, nbytes // flat_src.shape[0]))
    return [
        (lambda a=a: copy(flat_dest[a : a + step], flat_src[a : a + step]))
        for a in range(0, flat_src.shape[0], step)
    ]


def _run(job: Callable[[], None], countdown: _Countdown) -> None:
    try:
        # Grad mode is per thread: without this, copying a tensor that requires grad records autograd history.
        with torch.no_grad():
            job()
    except BaseException as exc:  # reported through the snapshot's future, re-raised at the next save()
        countdown.finish(exc)
    else:
        countdown.finish()
