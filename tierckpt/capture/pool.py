"""The host pool: page-aligned memory carved into equal slots, reused forever.

Copying into memory that is already touched runs at ~16 GB/s here, into a fresh allocation at
0.6-3.5 GB/s, so every slot is faulted in once, before its first capture, and never reallocated. That
happens in the background (:mod:`tierckpt.capture.prepare`), not at construction: a 4 GiB pool took
10 s to fault in, and a restarting job restores before it saves. A save waits only for its own slot
(:meth:`HostPool.prepare`); a restore pauses the preparation (:meth:`HostPool.paused`). Which slot is
free is decided by the memory tier on the engine thread; the pool only owns the bytes. A restore
that stages its bytes uses free slots when they are large enough (lent by the memory tier,
:meth:`MemoryTier.borrow <tierckpt.tiers.memory.tier.MemoryTier.borrow>`, as one :meth:`HostPool.span`).

How large: ``host.capacity`` when it is set, mapped at construction in one allocation. When it is
not, the pool is sized to the state: nothing is mapped until the first save, whose
:meth:`HostPool.fit` (in ``Pipeline.save``, on the engine thread, just before a slot is handed out)
maps ``host.snapshots`` slots of that state's laid-out size and an eighth more, in 64 KiB steps
(:func:`sized_slot`). A later save that does not fit maps a new generation of slots sized to it the
same way: saves take those from then on, and the older generation is unmapped once the last snapshot
it holds is dropped (:meth:`HostPool.release`). A pool sized to the state never maps more than
``limit_bytes`` for one generation (half of the host's physical memory): a save past that raises
:class:`~tierckpt.errors.CapacityError` naming ``host.capacity``. The save that maps a generation
faults (and pins) its own slot, as any save whose slot the background thread has not reached yet;
the other slots are prepared in the background. A memory tier with a ``path`` keeps its pool in a
file that the next process maps again, so its size cannot follow the state: without
``host.capacity`` it is :data:`FILE_POOL_BYTES`, fixed.

With CUDA, each slot is page-locked once (:mod:`tierckpt.capture.pinning`): copies from and to
devices are then DMAs that do not hold up the thread that queued them.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from typing import Callable, Iterator, Sequence

import torch

from tierckpt._buffers import address, align_up, aligned_buffer
from tierckpt.capture.prepare import SlotPreparer
from tierckpt.errors import CapacityError, ConfigError
from tierckpt.format import ALIGN
from tierckpt.snapshot import Slot
from tierckpt.state import numpy_dtype, torch_dtype
from tierckpt.units import format_size

__all__ = ["FILE_POOL_BYTES", "HostPool", "sized_slot"]

log = logging.getLogger("tierckpt")

# A memory tier's pool in a file (its ``path``) when host.capacity is not set: what every pool was before
# pools were sized to the state.
FILE_POOL_BYTES = 1 << 30
# A pool sized to the state: each slot holds the state and an eighth more (a state that grows a little
# keeps its slots), in steps of 64 KiB.
_HEADROOM = 8
_STEP = 64 << 10


def sized_slot(nbytes: int, snapshots: int, limit_bytes: int) -> int | None:
    """The slot of a pool sized to a state laying out ``nbytes``: the state and an eighth more, in
    64 KiB steps, at most ``limit_bytes`` for the ``snapshots`` slots; None when not even the state
    fits in that.

    Example:
        >>> sized_slot(40, 2, 1 << 30) == 64 << 10
        True
    """
    most = limit_bytes // snapshots // ALIGN * ALIGN
    if align_up(max(nbytes, 1), ALIGN) > most:
        return None
    return min(align_up(max(nbytes, 1) + nbytes // _HEADROOM, _STEP), most)


def half_of_memory() -> int:
    """Half of this host's physical memory: the most a pool sized to the state maps."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):  # not Linux, or not said
        return 1 << 40


class _Arena:
    """One allocation carved into ``count`` equal slots, prepared in the background: one generation of
    a pool's slots (a pool of configured size has one)."""

    def __init__(self, slot_size: int, count: int, memory: Callable[[int, int], mmap.mmap] | None, pinned: str | bool) -> None:
        self.slot_size = slot_size
        self.capacity_bytes = slot_size * count
        if memory is not None:
            self.memory = memory(slot_size, count)
        else:
            self.memory = aligned_buffer(self.capacity_bytes)  # faulted in by the preparer
            # A fork()ed child (a DataLoader worker) never uses the pool. Without this, Linux copies
            # every page of a pinned pool into each child at fork (pinned pages cannot be shared
            # copy-on-write), and every page the parent writes while a child lives otherwise.
            if hasattr(mmap, "MADV_DONTFORK"):  # Linux only
                self.memory.madvise(mmap.MADV_DONTFORK)
        self.bytes = torch.frombuffer(self.memory, dtype=torch.uint8)
        self.slots = tuple(Slot(i, i * slot_size, slot_size) for i in range(count))
        view = memoryview(self.memory)
        self.address = address(view)
        view.release()
        self.preparer = SlotPreparer(self.address, self.slots, pinned)
        self.released: set[int] = set()  # of a generation the pool grew past: its slots nothing holds any more

    def close(self) -> None:
        self.preparer.close()  # stopped and unpinned before the memory goes
        # Dropped, not closed: the mapping goes with the last reference to it. A torch tensor over the
        # pool holds one (torch.frombuffer keeps the mmap object, but no buffer export that would make
        # mmap.close() refuse), and may outlive the pool: a snapshot's views in a FlushError's traceback,
        # which pytest or an error reporter prints with its frames' locals. Unmapped under them, the
        # views would read freed memory and crash the process.
        del self.bytes, self.memory


class HostPool:
    """``snapshots`` equal slots of host memory: ``capacity_bytes`` of it, or, with None, sized to the
    state at the first save and grown with it (:meth:`fit`; see the module docstring).

    Call order: :meth:`fit` before each save takes a slot, and :meth:`release` for each slot that a
    snapshot left, on the engine thread; :meth:`view`, :meth:`tensor`, :meth:`array`, :meth:`prepare`
    and :meth:`paused` from any thread, for slots handed out; :meth:`close` once, when nothing uses
    the pool any more.
    """

    def __init__(
        self,
        capacity_bytes: int | None,
        snapshots: int,
        *,
        memory: Callable[[int, int], mmap.mmap] | None = None,
        pinned: str | bool = False,
        configured: bool = True,
        limit_bytes: int | None = None,
    ) -> None:
        """``capacity_bytes``: None sizes the pool to the state. ``configured``: whether
        ``host.capacity`` set ``capacity_bytes`` (then :meth:`fit` refuses a save larger than a slot;
        else it sizes the pool to the save; a pool in a file refuses it). ``memory(slot_size, slots)`` maps the pool
        instead of anonymous memory (a RAM tier's shared file; needs ``capacity_bytes``);
        ``pinned``: ``host.pinned`` (see :func:`~tierckpt.capture.pinning.pin`). ``limit_bytes``:
        the most a pool sized to the state maps (default: half of the host's physical memory).

        Raises:
            ConfigError: ``pinned`` is True and CUDA is unavailable (a refused registration is found
                later, in the background: :attr:`error`).
        """
        if pinned is True and (not torch.cuda.is_available() or torch.cuda._is_in_bad_fork()):
            raise ConfigError("host.pinned is true but CUDA is not available in this process; use auto or false", key="host.pinned")
        if capacity_bytes is None and memory is not None:
            raise ValueError("a pool in a file has the size it is given")
        self.snapshots = snapshots
        self.configured = configured and capacity_bytes is not None
        self.limit_bytes = half_of_memory() if limit_bytes is None else limit_bytes
        self._fixed = capacity_bytes is not None
        self._pinned = pinned
        self._arenas: list[_Arena] = []  # the last takes new saves; the others go with their last snapshot
        self._arena_of: dict[Slot, _Arena] = {}
        self._lock = threading.Lock()  # the list of arenas, against paused() from a restore's thread
        self._pauses = 0
        self._paused: contextlib.ExitStack | None = None
        if capacity_bytes is not None:
            self._add(_Arena(self.slot_bytes(capacity_bytes, snapshots), snapshots, memory, pinned))

    # -- size --------------------------------------------------------------------------------------

    @property
    def slots(self) -> tuple[Slot, ...]:
        """The slots saves take: the newest generation's (none before a pool sized to the state saw a save)."""
        return self._arenas[-1].slots if self._arenas else ()

    @property
    def slot_size(self) -> int:
        """The size of one slot saves take now (0 before a pool sized to the state saw a save)."""
        return self._arenas[-1].slot_size if self._arenas else 0

    @property
    def capacity_bytes(self) -> int:
        """Host memory the pool maps now: every slot of every generation not yet unmapped (0 before a
        pool sized to the state saw a save)."""
        return sum(a.capacity_bytes for a in self._arenas)

    def fit(self, nbytes: int, step: int) -> tuple[Slot, ...] | None:
        """Make room for the save of ``step`` laying out ``nbytes``. Returns the slots saves are to take
        from now on when this mapped a new generation of them (a pool sized to the state, at its first
        save or at one larger than its slots); None when nothing changed.

        Raises:
            CapacityError: the state is larger than one slot of a pool whose size ``host.capacity`` set
                (or of a pool in a file, a memory tier with a ``path``), or a pool sized to the state
                would map more than ``limit_bytes`` for it. Names ``host.capacity``.
        """
        if self._arenas and nbytes <= self._arenas[-1].slot_size:
            return None
        need = format_size(align_up(nbytes, ALIGN) * self.snapshots)
        if self.configured:
            raise CapacityError(
                f"step {step}: the state needs {format_size(nbytes)} of host memory but one slot holds "
                f"{format_size(self.slot_size)} (host.capacity {format_size(self.capacity_bytes)} / host.snapshots "
                f"{self.snapshots}); raise host.capacity to at least {need} or lower host.snapshots",
                step=step,
                key="host.capacity",
            )
        if self._fixed:  # a pool in a file, at its default size: it cannot follow the state
            raise CapacityError(
                f"step {step}: the state needs {format_size(nbytes)} of host memory but one slot holds "
                f"{format_size(self._arenas[-1].slot_size)}: host.capacity is not set, and the memory tier's pool "
                f"file (tiers[0].path) is {format_size(FILE_POOL_BYTES)} over host.snapshots {self.snapshots}; "
                f"set host.capacity to at least {need} or lower host.snapshots",
                step=step,
                key="host.capacity",
            )
        slot = sized_slot(nbytes, self.snapshots, self.limit_bytes)
        if slot is None:
            raise CapacityError(
                f"step {step}: the state needs {format_size(nbytes)} of host memory; a host pool sized to it "
                f"would map {need} (host.snapshots {self.snapshots}), more than the {format_size(self.limit_bytes)} "
                "a pool maps unless told (half of this host's memory); set host.capacity to what this process "
                "may use, or lower host.snapshots",
                step=step,
                key="host.capacity",
            )
        arena = self._add(_Arena(slot, self.snapshots, None, self._pinned))
        older = self._arenas[:-1]
        what = f"{self.snapshots} slot(s) of {format_size(slot)} ({format_size(arena.capacity_bytes)})"
        if not older:
            log.info("host pool sized to step %d's state of %s: %s mapped (host.capacity is not set)", step, format_size(nbytes), what)
        else:
            log.info("host pool grown for step %d's state of %s: %s mapped; the %s before go as the snapshots they hold are dropped",
                     step, format_size(nbytes), what, format_size(sum(a.capacity_bytes for a in older)))
        return arena.slots

    def release(self, slot: Slot) -> bool:
        """``slot`` holds nothing any more (its snapshot was dropped, a loan or a failed save gave it
        back): True when it is to be used again, put back among the free slots. False when its
        generation is one the pool grew past; the last of its slots unmaps it."""
        arena = self._arena_of[slot]
        if arena is self._arenas[-1]:
            return True
        arena.released.add(slot.index)
        if len(arena.released) == len(arena.slots):
            with self._lock:
                self._arenas.remove(arena)
            for s in arena.slots:
                del self._arena_of[s]
            arena.close()
        return False

    def _add(self, arena: _Arena) -> _Arena:
        with self._lock:
            self._arenas.append(arena)
            if self._paused is not None:  # a restore runs: this one waits for it too
                self._paused.enter_context(arena.preparer.paused())
        for slot in arena.slots:
            self._arena_of[slot] = arena
        return arena

    # -- preparation ---------------------------------------------------------------------------------

    def ready(self, slot: Slot) -> bool:
        """Whether ``slot`` is faulted in (and pinned, where it is to be)."""
        return self._arena_of[slot].preparer.ready(slot)

    def prepare(self, slot: Slot) -> None:
        """Make ``slot`` ready now, before a capture into it (blocking; see :mod:`tierckpt.capture.prepare`).

        Raises:
            ConfigError: ``host.pinned: true`` and page-locking was refused.
        """
        preparer = self._arena_of[slot].preparer
        preparer.prepare(slot)
        if preparer.error is not None:
            raise preparer.error

    @property
    def error(self) -> ConfigError | None:
        """Page-locking refused under ``host.pinned: true`` (raised by the next save)."""
        return self._arenas[-1].preparer.error if self._arenas else None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No background preparation inside the block (a restore runs), of any generation, even one
        mapped meanwhile."""
        with self._lock:
            self._pauses += 1
            if self._pauses == 1:
                self._paused = contextlib.ExitStack()
                for arena in self._arenas:
                    self._paused.enter_context(arena.preparer.paused())
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
                if not self._pauses:
                    assert self._paused is not None
                    stack, self._paused = self._paused, None
                    stack.close()

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait until every slot is prepared (the background threads are done); False on ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            arenas = list(self._arenas)
        return all(a.preparer.wait(None if deadline is None else max(0.0, deadline - time.monotonic())) for a in arenas)

    @property
    def pinned(self) -> bool:
        """Whether every slot saves take is page-locked; waits for the background preparation first.
        False before a pool sized to the state saw a save."""
        self.wait_prepared()
        return bool(self._arenas) and all(self._arenas[-1].preparer.pinned)

    @property
    def _preparer(self) -> SlotPreparer:  # the newest generation's, for tests
        return self._arenas[-1].preparer

    @property
    def _bytes(self) -> torch.Tensor:  # the newest generation's, for tests
        return self._arenas[-1].bytes

    @staticmethod
    def slot_bytes(capacity_bytes: int, snapshots: int) -> int:
        return capacity_bytes // snapshots // ALIGN * ALIGN

    # -- the bytes -----------------------------------------------------------------------------------

    def view(self, slot: Slot, offset: int, nbytes: int) -> memoryview:
        start = slot.offset + offset
        return memoryview(self._arena_of[slot].memory)[start : start + nbytes]

    def span(self, slots: Sequence[Slot]) -> memoryview:
        """The bytes of adjacent ``slots`` (in index order, of one generation) as one writable, page-aligned view."""
        if not slots or any(b.index != a.index + 1 or self._arena_of[a] is not self._arena_of[b] for a, b in zip(slots, slots[1:])):
            raise ValueError(f"not a run of adjacent slots: {[s.index for s in slots]}")
        return memoryview(self._arena_of[slots[0]].memory)[slots[0].offset : slots[-1].offset + slots[-1].size]

    def tensor(self, slot: Slot, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A torch tensor of ``dtype``/``shape`` over slot bytes (no copy)."""
        start = slot.offset + offset
        flat = self._arena_of[slot].bytes[start : start + nbytes]
        return flat.view(torch_dtype(dtype)).view(shape)

    def array(self, slot: Slot, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]):  # -> np.ndarray
        import numpy as np

        start = slot.offset + offset
        flat = np.frombuffer(self._arena_of[slot].memory, dtype=np.uint8, count=nbytes, offset=start)
        return flat.view(numpy_dtype(dtype)).reshape(shape)

    def close(self) -> None:
        with self._lock:
            arenas, self._arenas = self._arenas, []
        self._arena_of.clear()
        for arena in arenas:
            arena.close()
