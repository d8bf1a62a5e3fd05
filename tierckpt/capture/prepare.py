"""Preparing the host pool's slots off the critical path: each faulted in and, with CUDA, page-locked.

A 4 GiB pool took 10 s to fault in here when the pool was made, before a restore could start; a real
rank's pool of tens of GiB, page-locked as well, adds seconds to every restart. So the pool is mapped
untouched, and :class:`SlotPreparer` prepares it slot by slot, in slot order, on a thread of its own
at the lowest priority (nice 19: it takes only the cores that training leaves idle):
``MADV_POPULATE_WRITE`` (which faults pages in without writing them, so it is safe beside anything
else using the memory), then ``cudaHostRegister`` of the slot under ``host.pinned``. Slots are
registered one by one, so that the first is ready long before the last; a snapshot never spans two.

The thread also rests after each piece for three times the CPU time the piece took: it uses at
most a quarter of one core. Priority alone did not keep it off the training threads here: on a VM
whose hypervisor backs each new page with the vCPU stalled, the first training step after a resume
at 1 GiB took 1.02 s beside the fault-in of the 2.1 GiB pool, against 0.53 s without it. The pool is
needed only by the first save, usually many steps later, and a save that comes sooner prepares its
own slot.

- A save that gets a slot not yet prepared prepares it itself (:meth:`SlotPreparer.prepare`), at its
  own priority, even beside the thread: it waits for its own slot only, never for the low-priority
  thread. A capture thus always runs into faulted memory, as it did when the whole pool was faulted
  at construction. (Only a slot the thread is pinning makes a save wait for the thread: a CUDA host
  whose every core is busy would see that.)
- A restore pauses the thread (:meth:`SlotPreparer.paused`): on a host with few cores, faulting pages
  competes with the restore's reads, checksums and copies, and every GPU of the job waits for the
  restore. The thread goes on when the last restore ends.
- :meth:`SlotPreparer.close` stops the thread at its next piece and waits for it, before the pool is
  unpinned and unmapped.

Page-locking is refused in some containers: under ``auto`` the slots then stay pageable (one warning
per process, as before); under ``true`` the refusal is kept as :attr:`SlotPreparer.error`, a
:class:`~tierckpt.errors.ConfigError` that the next ``save()`` raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from typing import Iterator, Sequence

from tierckpt._buffers import prefault
from tierckpt.capture.pinning import pin, unpin
from tierckpt.errors import ConfigError
from tierckpt.snapshot import Slot
from tierckpt.units import format_size

__all__ = ["SlotPreparer"]

# Faulted per call: small enough that a pause or a close waits little (16 MiB faults in ~5-50 ms
# here), large enough that the calls cost nothing beside the faults.
_PIECE = 16 << 20
# The share of one core the background thread takes at most (see the module docstring).
_SHARE = 0.25


class SlotPreparer:
    """Faults in (and pins, under ``pinned``) the ``slots`` of the memory at ``base``.

    ``pinned``: ``host.pinned`` (``"auto"``, True or False). The background thread starts at once.
    Call order: :meth:`prepare` and :meth:`paused` from any thread, any number of times; :meth:`close`
    once, when nothing uses the pool any more.
    """

    def __init__(self, base: int, slots: Sequence[Slot], pinned: str | bool) -> None:
        self._base = base
        self._slots = tuple(slots)
        self._mode = pinned
        self._locks = [threading.Lock() for _ in self._slots]
        self._ready = [False] * len(self._slots)
        self._faulted = [0] * len(self._slots)  # how far the pool's thread has faulted each slot
        self.pinned = [False] * len(self._slots)
        self.error: ConfigError | None = None
        self._refused = False  # under auto, a refusal: the other slots stay pageable too
        self._stop = threading.Event()
        self._running = threading.Event()  # set while no restore pauses the thread
        self._running.set()
        self._pauses = 0
        self._pause_lock = threading.Lock()
        # Set while the background thread touches nothing: paused by a restore, stopped, or done.
        self.idle = threading.Event()
        # The background thread's CPU seconds faulting and pinning (it rests rested_s after them).
        self.worked_s = 0.0
        self._thread = threading.Thread(target=self._run, name="tierckpt-pool", daemon=True)
        self._thread.start()

    # -- readiness -------------------------------------------------------------------------------

    def ready(self, slot: Slot) -> bool:
        """Whether ``slot`` is faulted in (and pinned where it is to be)."""
        return self._ready[slot.index]

    def prepare(self, slot: Slot) -> None:
        """Make ``slot`` ready now, in this thread (blocking; at once when it is ready already).

        The caller owns the slot: a save about to capture into it. It faults the slot in itself, at
        its own priority, beside the pool's thread if that is at the same slot (faulting a page twice
        costs nothing the second time), so a save never waits on a low-priority thread's faults.
        Where the kernel cannot fault pages in without writing them (Linux before 5.14), this writes
        zeros over the slot instead.
        """
        if self._ready[slot.index]:
            return
        faulted = prefault(self._view(slot))
        with self._locks[slot.index]:
            if self._ready[slot.index]:
                return
            if not faulted:
                ctypes.memset(self._base + slot.offset, 0, slot.size)  # ctypes lets go of the GIL
            self._pin(slot)
            self._ready[slot.index] = True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the background thread is done with every slot; False on ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No background faulting or pinning inside the block (a restore runs); a piece under way
        finishes first, in the background thread, while the block goes on."""
        with self._pause_lock:
            self._pauses += 1
            self._running.clear()
        try:
            yield
        finally:
            with self._pause_lock:
                self._pauses -= 1
                if not self._pauses:
                    self._running.set()

    def close(self) -> None:
        """Stop the background thread (at its next piece) and wait for it; unpin every pinned slot."""
        self._stop.set()
        self._running.set()
        self._thread.join()
        for slot in self._slots:
            with self._locks[slot.index]:
                if self.pinned[slot.index]:
                    self.pinned[slot.index] = False
                    unpin(self._base + slot.offset)

    # -- the background thread ------------------------------------------------------------------

    def _run(self) -> None:
        # The lowest priority: faulting pages is kernel work on this thread's time slices, and on a
        # host whose cores train (or restore) it must take only what they leave idle. A save that
        # needs its slot before this thread got there prepares it itself, at its own priority.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            for slot in self._slots:
                while not self._stop.is_set():
                    if not self._running.is_set():
                        self.idle.set()
                        self._running.wait()
                        self.idle.clear()
                    if self._stop.is_set() or self._background(slot):
                        break
        finally:
            self.idle.set()

    def _background(self, slot: Slot) -> bool:
        """Fault ``slot`` in piece by piece, then pin it; False when a restore paused it half-way (it
        goes on from that piece later). Faulting takes no lock: a save may fault the same slot."""
        view = self._view(slot)
        for start in range(self._faulted[slot.index], slot.size, _PIECE):
            if self._ready[slot.index]:
                return True  # a save got there first
            if self._stop.is_set() or not self._running.is_set():
                self._faulted[slot.index] = start
                return False
            began = time.thread_time()
            faulted = prefault(view[start : start + _PIECE])
            self._rest(time.thread_time() - began)
            if not faulted:
                return True  # an old kernel: a save prepares its own slot (prepare)
        self._faulted[slot.index] = slot.size
        began = time.thread_time()
        with self._locks[slot.index]:
            if not self._ready[slot.index]:
                self._pin(slot)
                self._ready[slot.index] = True
        self._rest(time.thread_time() - began)
        return True

    @property
    def rested_s(self) -> float:
        """Seconds the background thread rested after its work (a close cuts the last rest short)."""
        return _rest_for(self.worked_s)

    def _rest(self, worked: float) -> None:
        """Wait (touching nothing) long enough that ``worked`` CPU seconds are :data:`_SHARE` of the
        time; a close ends the wait."""
        self.worked_s += worked
        rest = _rest_for(worked)
        if rest > 0:
            self._stop.wait(rest)

    def _view(self, slot: Slot) -> memoryview:
        return memoryview((ctypes.c_char * slot.size).from_address(self._base + slot.offset)).cast("B")

    def _pin(self, slot: Slot) -> None:
        """Page-lock ``slot`` under ``host.pinned`` (its lock held)."""
        if self._mode is False or self._refused or self.error is not None:
            return
        try:
            what = f"slot {slot.index} ({format_size(slot.size)}) of the host pool"
            self.pinned[slot.index] = pin(self._base + slot.offset, slot.size, self._mode, what=what)
        except ConfigError as exc:  # refused under pinned: true
            self.error = exc
            return
        if not self.pinned[slot.index]:
            self._refused = True


def _rest_for(worked: float) -> float:
    """The rest after ``worked`` CPU seconds that makes them :data:`_SHARE` of the time."""
    return worked * (1 - _SHARE) / _SHARE
