"""The host pool: one page-aligned allocation made at start, carved into equal slots, reused forever.

Copying into memory that is already touched runs at ~16 GB/s here, into a fresh allocation at
0.6-3.5 GB/s, so every slot is faulted in once, before its first capture, and never reallocated. That
happens in the background (:mod:`tierckpt.capture.prepare`), not at construction: a 4 GiB pool took
10 s to fault in, and a restarting job restores before it saves. A save waits only for its own slot
(:meth:`HostPool.prepare`); a restore pauses the preparation (:meth:`HostPool.paused`). Which slot is
free is decided by the memory tier on the engine thread; the pool only owns the bytes. A restore
that stages its bytes uses free slots when they are large enough (lent by the memory tier,
:meth:`MemoryTier.borrow <tierckpt.tiers.memory.MemoryTier.borrow>`, as one :meth:`HostPool.span`).

With CUDA, each slot is page-locked once (:mod:`tierckpt.capture.pinning`): copies from and to
devices are then DMAs that do not hold up the thread that queued them.
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Callable, Sequence

import torch

from tierckpt._buffers import address, aligned_buffer
from tierckpt.capture.prepare import SlotPreparer
from tierckpt.errors import ConfigError
from tierckpt.format import ALIGN
from tierckpt.snapshot import Slot
from tierckpt.state import numpy_dtype, torch_dtype


class HostPool:
    """``snapshots`` equal slots in ``capacity_bytes`` of host memory."""

    def __init__(
        self,
        capacity_bytes: int,
        snapshots: int,
        *,
        memory: Callable[[int, int], mmap.mmap] | None = None,
        pinned: str | bool = False,
    ) -> None:
        """``memory(slot_size, slots)`` maps the pool instead of anonymous memory (a RAM tier's shared file);
        ``pinned``: ``host.pinned`` (see :func:`~tierckpt.capture.pinning.pin`).

        Raises:
            ConfigError: ``pinned`` is True and CUDA is unavailable (a refused registration is found
                later, in the background: :attr:`error`).
        """
        if pinned is True and (not torch.cuda.is_available() or torch.cuda._is_in_bad_fork()):
            raise ConfigError("host.pinned is true but CUDA is not available in this process; use auto or false", key="host.pinned")
        slot_size = self.slot_bytes(capacity_bytes, snapshots)
        self.slot_size = slot_size
        self.capacity_bytes = slot_size * snapshots
        if memory is not None:
            self._memory = memory(slot_size, snapshots)
        else:
            self._memory = aligned_buffer(self.capacity_bytes)  # faulted in by the preparer
            # A fork()ed child (a DataLoader worker) never uses the pool. Without this, Linux copies
            # every page of a pinned pool into each child at fork (pinned pages cannot be shared
            # copy-on-write), and every page the parent writes while a child lives otherwise.
            if hasattr(mmap, "MADV_DONTFORK"):  # Linux only
                self._memory.madvise(mmap.MADV_DONTFORK)
        self._bytes = torch.frombuffer(self._memory, dtype=torch.uint8)
        self.slots = tuple(Slot(i, i * slot_size, slot_size) for i in range(snapshots))
        view = memoryview(self._memory)
        self._address = address(view)
        view.release()
        self._preparer = SlotPreparer(self._address, self.slots, pinned)

    def ready(self, slot: Slot) -> bool:
        """Whether ``slot`` is faulted in (and pinned, where it is to be)."""
        return self._preparer.ready(slot)

    def prepare(self, slot: Slot) -> None:
        """Make ``slot`` ready now, before a capture into it (blocking; see :mod:`tierckpt.capture.prepare`).

        Raises:
            ConfigError: ``host.pinned: true`` and page-locking was refused.
        """
        self._preparer.prepare(slot)
        if self._preparer.error is not None:
            raise self._preparer.error

    @property
    def error(self) -> ConfigError | None:
        """Page-locking refused under ``host.pinned: true`` (raised by the next save)."""
        return self._preparer.error

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """No background preparation inside the block (a restore runs)."""
        return self._preparer.paused()

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait until every slot is prepared (the background thread is done); False on ``timeout``."""
        return self._preparer.wait(timeout)

    @property
    def pinned(self) -> bool:
        """Whether every slot is page-locked; waits for the background preparation first."""
        self.wait_prepared()
        return all(self._preparer.pinned)

    @staticmethod
    def slot_bytes(capacity_bytes: int, snapshots: int) -> int:
        return capacity_bytes // snapshots // ALIGN * ALIGN

    def view(self, slot: Slot, offset: int, nbytes: int) -> memoryview:
        start = slot.offset + offset
        return memoryview(self._memory)[start : start + nbytes]

    def span(self, slots: Sequence[Slot]) -> memoryview:
        """The bytes of adjacent ``slots`` (in index order) as one writable, page-aligned view."""
        if not slots or any(b.index != a.index + 1 for a, b in zip(slots, slots[1:])):
            raise ValueError(f"not a run of adjacent slots: {[s.index for s in slots]}")
        return memoryview(self._memory)[slots[0].offset : slots[-1].offset + slots[-1].size]

    def tensor(self, slot: Slot, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A torch tensor of ``dtype``/``shape`` over slot bytes (no copy)."""
        start = slot.offset + offset
        flat = self._bytes[start : start + nbytes]
        return flat.view(torch_dtype(dtype)).view(shape)

    def array(self, slot: Slot, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]):  # -> np.ndarray
        import numpy as np

        start = slot.offset + offset
        flat = np.frombuffer(self._memory, dtype=np.uint8, count=nbytes, offset=start)
        return flat.view(numpy_dtype(dtype)).reshape(shape)

    def close(self) -> None:
        preparer = getattr(self, "_preparer", None)
        if preparer is not None:
            preparer.close()  # stopped and unpinned before the memory goes
        del self._bytes
        try:
            self._memory.close()
        except BufferError:
            # A view handed out earlier is still alive; the mapping goes when it does.
            pass
