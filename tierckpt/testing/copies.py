"""Seams for tests of capture: a Checkpointer's copy threads held at a gate, stopped, or watched.

A save's host copies run on the Checkpointer's copy threads (:mod:`tierckpt.capture.copier`). A test that
checks what happens *while* a copy is still to do (the lazy barrier, a torn capture, a flush deciding
beside a running copy) holds those threads with :class:`HeldCopies` instead of hoping the copy is slow::

    with HeldCopies(ckpt) as held:                  # every copy thread waits at the gate
        handle = ckpt.save_sync(1, state)           # its copies are queued behind the gate
        assert captured_done(handle) is False       # (tierckpt.testing.inspect)
        held.release()                              # the copies run now
    assert handle.captured_sync(60)

:func:`stopped_copy_threads` makes the copies impossible to enqueue, as after interpreter shutdown;
:class:`CopyWatch` calls a function after each copy a copy thread makes one by one. For tests only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Any, Callable, Iterator

from tierckpt.capture import copier
from tierckpt.checkpointer import Checkpointer

__all__ = ["COPY_PIECE_BYTES", "CopyWatch", "HeldCopies", "stopped_copy_threads"]

# The copy threads split a contiguous leaf larger than this into pieces of at most this many bytes,
# so that several threads copy one large tensor together.
COPY_PIECE_BYTES: int = copier._PIECE_BYTES


class HeldCopies:
    """Holds ``threads`` copy threads of ``ckpt`` (default: every one) at :attr:`gate` until :meth:`release`
    (or the end of the ``with`` block): copies enqueued meanwhile wait behind them, in order.

    A held thread gives up after ``deadline_s`` (a guard against a test that never releases it), and
    :meth:`release` then raises :class:`TimeoutError`. It holds by running a job that waits on the gate:
    nothing of the Checkpointer is changed.
    """

    def __init__(self, ckpt: Checkpointer, threads: int | None = None, *, deadline_s: float = 60.0) -> None:
        self.gate = threading.Event()
        self.deadline_s = deadline_s
        count = ckpt.config.host.copy_threads if threads is None else threads
        executor = ckpt._copier._executor
        self.jobs: list[concurrent.futures.Future[bool]] = [executor.submit(self.gate.wait, deadline_s) for _ in range(count)]

    def release(self) -> None:
        """Open the gate and wait until every held thread has left it.

        Raises:
            TimeoutError: a held thread gave up waiting before the gate opened (the test held it too long).
        """
        self.gate.set()
        done, _ = concurrent.futures.wait(self.jobs, self.deadline_s)
        if len(done) != len(self.jobs) or not all(job.result() for job in self.jobs):
            raise TimeoutError("a held copy thread gave up waiting at the gate: the test held it past its deadline")

    def __enter__(self) -> HeldCopies:
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()


@contextlib.contextmanager
def stopped_copy_threads(ckpt: Checkpointer) -> Iterator[None]:
    """Inside the block the copy threads of ``ckpt`` are shut down, as at interpreter exit: a ``save()``
    cannot enqueue its copies (``RuntimeError: cannot schedule new futures after shutdown``). After it,
    as many fresh copy threads take their place. A fault for tests, like :class:`~tierckpt.testing.IOFaults`."""
    runner = ckpt._copier
    runner._executor.shutdown(wait=True)
    try:
        yield
    finally:
        runner._executor = concurrent.futures.ThreadPoolExecutor(runner._threads, thread_name_prefix="tierckpt-copy")


class CopyWatch:
    """Inside ``with CopyWatch(after)``, every copy thread of every Checkpointer calls ``after()`` on its own
    thread once it has copied a leaf, or a piece of one, on its own (leaves copied together in one batch
    call are not seen one by one). For kill points and counts; whatever ``after`` raises fails that
    capture. ``__enter__()`` without a ``with`` watches for the life of the process."""

    def __init__(self, after: Callable[[], Any]) -> None:
        self.after = after
        self._copy: Callable[..., None] | None = None

    def __enter__(self) -> CopyWatch:
        copy = self._copy = copier._copy
        after = self.after

        def copying(*args: Any, **kwargs: Any) -> None:
            copy(*args, **kwargs)
            after()

        copier._copy = copying
        return self

    def __exit__(self, *exc: object) -> None:
        if self._copy is not None:
            copier._copy, self._copy = self._copy, None
