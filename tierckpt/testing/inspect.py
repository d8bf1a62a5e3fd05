"""Seams for tests: what a test may read of a Checkpointer's inner parts, in one place.

A test that checks *how* the library did something (which slot a save took, whether the pool thread
is done, what a flusher decided) needs more than the public API shows. It asks here instead of
reaching into private attributes, so that renaming a part's internals changes this module, not every
test that looks at it. Everything here reads, waits, or watches (a watch calls the test's function
beside the library's own and changes nothing else). For tests only: none of it is API a training loop
should use::

    from tierckpt.testing.inspect import captured_done, host_pool, run_on_engine, tier_of

    pool = host_pool(ckpt)
    assert pool.wait_prepared(60) and all(pool.ready(slot) for slot in pool.slots)
    handle = ckpt.save_sync(1, state)
    assert captured_done(handle) is False            # save() returned before its copy

The Checkpointer's parts (:func:`host_pool`, :func:`tiers_of`, :func:`pipeline_of`, :func:`flushers_of`,
:func:`run_on_engine`, ...), a :class:`~tierckpt.SaveHandle`'s state without waiting
(:func:`captured_done`, :func:`committed_done`, :func:`settled`, :func:`save_number`), the CUDA copy
stage (:func:`device_copies_of`, :func:`wait_device_queued`, ...), parts tests build on their own
(:func:`free_slots`, :func:`memory_hooks`, :func:`held_windows`) and watches (:func:`noticed_copy_checks`,
:func:`watch_memory_checks`). Holding, stopping or watching the copy threads is in
:mod:`tierckpt.testing.copies`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Iterator, TypeVar

import torch

from tierckpt.capture.device import DeviceCopies
from tierckpt.capture.pool import HostPool
from tierckpt.capture.prepare import SlotPreparer
from tierckpt.checkpointer import Checkpointer
from tierckpt.handle import SaveHandle
from tierckpt.integrations.saves import DurableSaves
from tierckpt.pipeline import Pipeline
from tierckpt.pipeline.flusher import Flusher
from tierckpt.ranks.tally import StoreTally
from tierckpt.snapshot import Slot, Snapshot
from tierckpt.storage.coalesce import CoalescingReader
from tierckpt.tiers.base import Tier
from tierckpt.tiers.memory.tier import MemoryHooks, MemoryTier

__all__ = [
    "PoolView", "PreparerView", "HostSlots",
    "host_pool", "tiers_of", "tier_of", "pipeline_of", "flushers_of", "flusher_of", "is_closed",
    "engine_loop", "engine_thread", "run_on_engine", "call_on_engine", "store_tally", "node_store_tally", "exchange_tally",
    "newest_save_number", "host_slots", "committed_saves", "noticed_copy_checks",
    "captured_done", "committed_done", "settled", "save_number",
    "device_copies_of", "wait_device_queued", "pending_device_snapshots", "copy_done_event", "device_slot_views",
    "free_slots", "watch_memory_checks", "memory_hooks", "held_windows", "opened_checkpointer",
]

T = TypeVar("T")

# -- the host pool -----------------------------------------------------------------------------------


def _live(part: str, name: str, doc: str) -> Any:
    """A read-only property that reads ``name`` of the viewed ``part`` each time (a view stays live)."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class PreparerView:
    """One generation's background preparation of host slots (:mod:`tierckpt.capture.prepare`), for tests:
    pause it as a restore does, see it idle or stopped, and what it worked and rested."""

    def __init__(self, preparer: SlotPreparer) -> None:
        self._preparer = preparer

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """No background faulting or pinning inside the block, as while a restore runs."""
        return self._preparer.paused()

    idle = _live("_preparer", "idle", "Set while the background thread is not working on a piece (paused, or done).")
    worked_s = _live("_preparer", "worked_s", "CPU seconds the background thread spent preparing.")
    rested_s = _live("_preparer", "rested_s", "Seconds it rested after that work (its share of a core).")

    def stopped(self) -> bool:
        """Whether the background thread has ended (every slot done, or the pool closed)."""
        thread = self._preparer._thread
        return thread is not None and not thread.is_alive()


class PoolView:
    """A Checkpointer's host pool (:mod:`tierckpt.capture.pool`) as tests look at it. Every read is live:
    keep the view and read it again after a save."""

    def __init__(self, pool: HostPool) -> None:
        self._pool = pool

    capacity_bytes = _live(
        "_pool", "capacity_bytes", "Bytes mapped now, every generation of slots together (0 before a pool sized to the state saw a save)."
    )
    slots = _live("_pool", "slots", "The slots saves take now (the newest generation's).")
    slot_size = _live("_pool", "slot_size", "Bytes of each slot saves take now.")
    limit_bytes = _live("_pool", "limit_bytes", "The most a pool sized to the state maps for one generation.")

    @property
    def memory(self) -> torch.Tensor:
        """The newest generation's whole allocation, as bytes: its address (``data_ptr()``) and whether it is
        page-locked (``is_pinned()``)."""
        return self._pool._bytes

    def ready(self, slot: Slot) -> bool:
        """Whether ``slot`` is faulted in (and pinned where it is to be)."""
        return self._pool.ready(slot)

    def prepare(self, slot: Slot) -> None:
        """Make ``slot`` ready in this thread, as a save given that slot does before its copy."""
        self._pool.prepare(slot)

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait until the background preparation of every slot is over; False on ``timeout``."""
        return self._pool.wait_prepared(timeout)

    def preparer(self) -> PreparerView:
        """The background preparation of the slots saves take now (kept: still readable after a close)."""
        return PreparerView(self._pool._preparer)


def host_pool(ckpt: Checkpointer) -> PoolView:
    """The host pool of ``ckpt``: its size, slots, preparation and memory."""
    return PoolView(ckpt._pool)


# -- tiers, pipeline, engine -------------------------------------------------------------------------


def tiers_of(ckpt: Checkpointer) -> list[Tier]:
    """The open tiers of ``ckpt``, fastest first (host memory first), to ask them through the tier interface
    (on the engine thread where the interface says so: :func:`run_on_engine`)."""
    return list(ckpt._pipeline.tiers)


def tier_of(ckpt: Checkpointer, name: str) -> Tier:
    """The open tier ``name`` of ``ckpt`` (host memory included)."""
    return next(t for t in tiers_of(ckpt) if t.name == name)


def pipeline_of(ckpt: Checkpointer) -> Pipeline:
    """The pipeline of ``ckpt`` (:mod:`tierckpt.pipeline.pipeline`): its memory tier, flushers, sources and
    counters, for tests that check its decisions. Read it on the engine thread (:func:`call_on_engine`)."""
    return ckpt._pipeline


def flushers_of(ckpt: Checkpointer) -> list[Flusher]:
    """The flushers of the tiers below host memory, in tier order."""
    return list(pipeline_of(ckpt).flushers)


def flusher_of(ckpt: Checkpointer, tier: str) -> Flusher:
    """The flusher that writes tier ``tier``."""
    return next(f for f in flushers_of(ckpt) if f.tier.name == tier)


def is_closed(ckpt: Checkpointer) -> bool:
    """Whether ``close()`` has begun (a close that raised counts: the Checkpointer is closed all the same)."""
    return ckpt._closed


def engine_loop(ckpt: Checkpointer) -> asyncio.AbstractEventLoop:
    """The event loop of ``ckpt``'s engine thread."""
    return ckpt._engine.loop


def engine_thread(ckpt: Checkpointer) -> threading.Thread:
    """``ckpt``'s engine thread (also after a close: to check that it ended)."""
    return ckpt._engine._thread


def run_on_engine(ckpt: Checkpointer, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on ``ckpt``'s engine thread, where the pipeline calls its tiers, and block for its
    result. ``run_on_engine(ckpt, asyncio.sleep(0))`` returns once what the engine was doing has yielded."""
    return ckpt._engine.run_sync(coro)


def call_on_engine(ckpt: Checkpointer, fn: Callable[[], T]) -> T:
    """Call ``fn()`` on ``ckpt``'s engine thread and block for its result: a consistent read of what only
    that thread changes."""

    async def call() -> T:
        return fn()

    return run_on_engine(ckpt, call())


def store_tally(ckpt: Checkpointer) -> StoreTally | None:
    """A copy of what this rank of ``ckpt`` asked of its group's store so far (None: one process)."""
    group = ckpt._group
    return None if group is None else call_on_engine(ckpt, group.tally.copy)


def node_store_tally(ckpt: Checkpointer) -> StoreTally | None:
    """A copy of what this rank asked of its node's store so far (None: its node does not relay)."""
    group = ckpt._group
    return None if group is None or group.link is None else call_on_engine(ckpt, group.link.store.tally.copy)


def exchange_tally(ckpt: Checkpointer) -> StoreTally | None:
    """A copy of this rank's collectives on the group's gloo group so far (None: one process)."""
    group = ckpt._group
    return None if group is None else call_on_engine(ckpt, group.exchanges.copy)


def newest_save_number(ckpt: Checkpointer) -> int:
    """The number of the newest save that took a host slot (what ``flush.every`` counts; 0 before any).
    Engine thread (:func:`call_on_engine`)."""
    return pipeline_of(ckpt)._seq


@dataclass(frozen=True)
class HostSlots:
    """The memory tier's slots at one moment: ``held`` snapshots, ``free`` and ``lent`` slot indices (free
    ones sorted), ``loans`` (``borrow()`` calls that got slots, so far) and ``waiting_saves`` (saves
    waiting for a slot now)."""

    held: int
    free: list[int]
    lent: list[int]
    loans: int
    waiting_saves: int


def host_slots(ckpt: Checkpointer) -> HostSlots:
    """What the memory tier of ``ckpt`` holds, lends and has free, read on the engine thread."""

    def read() -> HostSlots:
        memory = pipeline_of(ckpt).memory
        return HostSlots(
            len(memory.snapshots()), sorted(s.index for s in free_slots(memory)), [s.index for s in memory.lent],
            memory.loans, memory.waiting_saves,
        )

    return call_on_engine(ckpt, read)


def committed_saves(ckpt: Checkpointer, tier: str) -> dict[int, int]:
    """Per step, the number of the save that stored tier ``tier`` committed under it, as far as the
    pipeline remembers (what a tier below may read back from ``tier``); read on the engine thread."""
    return call_on_engine(ckpt, lambda: dict(pipeline_of(ckpt).sources._tokens[tier]))


@contextlib.contextmanager
def noticed_copy_checks(ckpt: Checkpointer, tier: str) -> Iterator[threading.Event]:
    """An event set, inside the block, when ``tier``'s flusher asks whether a host copy runs and hears
    that one does. It asks at each decision, on the engine loop, and decides in that same step."""
    flusher = flusher_of(ckpt, tier)
    asks = flusher._copy_running
    looked = threading.Event()

    def noticed() -> bool:
        running = asks()
        if running:
            looked.set()
        return running

    flusher._copy_running = noticed
    try:
        yield looked
    finally:
        flusher._copy_running = asks


# -- a save's handle, without waiting ----------------------------------------------------------------


def captured_done(handle: SaveHandle) -> bool:
    """Whether the save's host copy has ended (done, failed, or skipped), without waiting for it."""
    return handle._tracker.captured.done()


def committed_done(handle: SaveHandle, tier: str) -> bool:
    """Whether it is decided, without waiting, if the save is committed on ``tier`` (done, passed over,
    or failed)."""
    return handle._tracker.committed[tier].done()


def settled(handle: SaveHandle) -> bool:
    """Whether the save's copy and every tier's outcome are decided: nothing of it is left hanging."""
    return handle._tracker.done()


def save_number(handle: SaveHandle) -> int:
    """The save's number among the saves that took a slot (its snapshot's ``seq``: what ``flush.every``
    counts); 0 for a skipped save."""
    return handle._tracker.token


# -- the CUDA copy stage ------------------------------------------------------------------------------


def device_copies_of(ckpt: Checkpointer) -> DeviceCopies | None:
    """The CUDA copy stage of ``ckpt`` (:mod:`tierckpt.capture.device`); None before its first CUDA tensor."""
    return ckpt._copier._devices


def wait_device_queued(copies: DeviceCopies, timeout: float | None = None) -> None:
    """Wait until the queueing thread of ``copies`` has queued every copy started so far."""
    copies._queue.submit(lambda: None).result(timeout)


def pending_device_snapshots(copies: DeviceCopies) -> list[Snapshot]:
    """The snapshots whose device copies have not completed yet, oldest first."""
    with copies._lock:
        return [batch.snapshot for batch in copies._pending]


def copy_done_event(copies: DeviceCopies, snapshot: Snapshot, device: torch.device) -> Any:
    """The event recorded on ``device``'s copy stream after ``snapshot``'s copies (a pending snapshot's):
    what the barrier makes the current stream wait on."""
    with copies._lock:
        (batch,) = [b for b in copies._pending if b.snapshot is snapshot]
    return batch.events[device]


def device_slot_views(copies: DeviceCopies) -> dict[tuple[Slot, torch.device], list[torch.Tensor]]:
    """The views of host slots that ``copies`` keeps, per (slot, device), to copy into while a layout stays."""
    return {key: views for key, (_, views) in copies._slot_views.items()}


# -- parts a test builds itself ----------------------------------------------------------------------


def free_slots(memory: MemoryTier) -> list[Slot]:
    """The slots of a memory tier that no snapshot holds and no loan has, in the order saves take them.
    Engine thread, for a memory tier a Checkpointer runs."""
    return list(memory._free)


@contextlib.contextmanager
def watch_memory_checks(before: Callable[[Snapshot, int], None]) -> Iterator[None]:
    """Inside the block, every memory tier calls ``before(snapshot, i)`` on its worker thread just before it
    checks leaf ``i`` of a snapshot against its checksums (one it found in its RAM file system at start,
    before a restore or a flush reads it): to count the checks, or hold one open a while."""
    verify = MemoryTier._verify

    def checking(self: MemoryTier, snapshot: Snapshot, i: int) -> None:
        before(snapshot, i)
        verify(self, snapshot, i)

    setattr(MemoryTier, "_verify", checking)
    try:
        yield
    finally:
        setattr(MemoryTier, "_verify", verify)


def memory_hooks(memory: MemoryTier) -> MemoryHooks:
    """What a memory tier asks of the pipeline above it (the ``hooks`` it was made with)."""
    return memory._hooks


def held_windows(reader: CoalescingReader) -> list[int]:
    """The groups (by index) whose fetched bytes a coalescing reader still keeps."""
    with reader._lock:
        return list(reader._held)


def opened_checkpointer(integration: Any) -> Checkpointer | None:
    """The Checkpointer a trainer integration (``TierckptCheckpointIO``, ``TierckptTrainer``, ...) or its
    :class:`~tierckpt.integrations.saves.DurableSaves` has opened; None while it opened none (never opens one)."""
    saves = integration if isinstance(integration, DurableSaves) else next(v for v in vars(integration).values() if isinstance(v, DurableSaves))
    return saves._ckpt
