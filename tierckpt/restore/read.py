"""Reading one version of one tier for this rank: the source or the saved layout, the keys, the plan.

A version whose records are exactly the template's (same keys, dtypes, shapes, DTensor pieces) is
read from the source of this rank's part, by the planner's fast path. Any other (saved by another
parallel layout, restored without a template where it holds DTensor shards, or with ``cast``) is read
through its saved layout, by the planner's general path (:mod:`tierckpt.restore.plan`). The template's
keys are checked against the version's first (:func:`check_keys`).

Bytes that are staged (``verify_first``, the general path, a template the chunks cannot land in
directly) go to free host slots when they are large enough (one slot, or adjacent ones:
:meth:`MemoryTier.borrow <tierckpt.tiers.memory.tier.MemoryTier.borrow>`), else to one fresh page-aligned
mapping, faulted in ahead of the reads (fresh memory costs 0.25-2.3 s per GiB to fault here). The
host pool is prepared in the background and may not be faulted in yet when a job restarts
(:mod:`tierckpt.capture.prepare`); the restore pauses that preparation meanwhile. The slots are lent
until the load is over, so a save meanwhile takes another slot or waits, skips or evicts per
``host.on_full``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Iterator, Sequence

from tierckpt.errors import LayoutError, RestoreError
from tierckpt.format import TensorRecord
from tierckpt.format.source import VersionSource
from tierckpt.observe.progress import progress_bar, progress_wanted
from tierckpt.restore.plan import Plan, Saved, fits, plan, staging_bytes
from tierckpt.restore.replicas import LeftToOwners
from tierckpt.state import Leaf
from tierckpt.tiers.base import Tier
from tierckpt.tiers.memory.tier import MemoryTier

__all__ = ["check_keys", "in_thread", "read_version", "some_keys"]

log = logging.getLogger("tierckpt")


async def read_version(
    held_open: contextlib.ExitStack,
    tier: Tier,
    step: int,
    templates: dict[str, Leaf],
    staging: MemoryTier | None,
    *,
    strict: bool,
    cast: bool,
    rank: int = 0,
    verify_first: bool = True,
    stage_all: bool = False,
    touched: set[str] | None = None,
    show_progress: bool = False,
    owner: int | None = None,
) -> tuple[Plan, tuple[tuple[str, ...], tuple[str, ...]], LeftToOwners | None]:
    """Read and verify what this rank restores of ``step`` from ``tier``; returns the plan run (what
    :func:`~tierckpt.restore.landing.finish` takes is its ``saved`` and ``targets``), and the keys
    :func:`check_keys` found. With
    ``verify_first``, only a snapshot in host memory may have written into the template yet (none
    with ``stage_all``); without, the template keys the read lands in directly are added to
    ``touched`` before a byte is read (:attr:`Plan.touched <tierckpt.restore.plan.Plan.touched>`).
    What it holds (files, staging) is released by ``held_open``. ``show_progress``: a bar over the
    bytes it reads, when stderr is a terminal (:func:`~tierckpt.observe.progress.progress_bar`).
    ``owner``: this rank, when the chunks of replicated values that other ranks stored are to come
    from them (:mod:`tierckpt.restore.replicas`): what is left to them is returned, else None (also
    when the version is not read as it was saved: then this rank read everything).

    A version whose records are exactly this rank's template is read as it is; any other (saved with
    another parallel layout, or needing consolidation or a dtype conversion) is read from its saved
    layout. Both are planned by :func:`~tierckpt.restore.plan.plan`: the first is its exact-fit fast path.

    Raises:
        CorruptCheckpointError: it does not verify.
        NotHere: the tier holds only part of a version this rank needs more of.
        RestoreError: the template does not match (see :func:`check_keys`).
    """
    executor, threads = getattr(tier, "executor"), tier.threads
    try:
        source: VersionSource | None = await tier.read_whole(step)
    except LayoutError:  # saved by another number of ranks
        source = None
    saved: Saved | None = None
    if source is not None:
        held_open.callback(source.close)
        missing, unexpected = check_keys(source.records, templates, strict=strict, tier=tier.name, step=step)
        if fits(source.records, templates):
            saved = source
    if saved is None:
        # Reading every rank's manifest is left to the versions this rank cannot read as they are.
        saved = await tier.read_layout(step, rank)
        missing, unexpected = check_keys(saved.records, templates, strict=strict, tier=tier.name, step=step)
    arena = held_open.enter_context(_borrow(staging, staging_bytes(saved, templates, verify_first=verify_first, stage_all=stage_all)))
    # Planning allocates the destinations (fresh mappings, new tensors): in a thread, off the loop.
    planned = await in_thread(plan, saved, templates, arena, cast=cast, verify_first=verify_first, stage_all=stage_all, owner=owner)
    if touched is not None:
        touched.update(planned.touched)
    if planned.exact:
        opened = planned.open()  # the source read above
    else:
        opened = await asyncio.to_thread(planned.open)
        held_open.callback(opened.close)
    # The total is counted over every chunk: only for a bar that is drawn.
    total = planned.read_bytes if show_progress and progress_wanted() else 0
    with progress_bar(total, f"restore step {step} from {tier.name}") as bar:
        # No bar: no callback at all, so the chunk jobs run as they would without this.
        counted = bar.update if bar.enabled else None
        await in_thread(planned.run, opened, executor, threads, counted)
    left = LeftToOwners(planned, opened, executor, threads) if owner is not None and planned.exact else None
    return planned, (tuple(missing), tuple(unexpected)), left


def check_keys(records: Sequence[TensorRecord], templates: dict[str, Leaf], *, strict: bool, tier: str, step: int) -> tuple[list[str], list[str]]:
    """Compare the template's array keys with the version's: returns (missing, unexpected).

    ``missing``: template keys the version lacks (their arrays are left as they are), an error when
    ``strict``: a model would silently keep its initial values. ``unexpected``: version keys the
    template lacks; they come back as new arrays in the returned state, as for a restore without a
    template. That is not an error: an optimizer's state is empty until its first step, and a
    template made from a fresh one lacks it; ``optimizer.load_state_dict`` takes it from the result.

    Raises:
        RestoreError: ``strict`` and template keys are missing from the version; names them.
    """
    if not templates:
        return [], []
    saved = {r.key for r in records}
    missing = [key for key in templates if key not in saved]
    unexpected = [r.key for r in records if r.key not in templates]
    if missing and strict:
        raise RestoreError(
            f"step {step} on tier {tier!r} lacks {len(missing)} array(s) of the template: {some_keys(missing)} "
            "(restore_latest(..., strict=False) leaves them as they are)",
            tier=tier,
            step=step,
        )
    if missing or unexpected:
        log.info("tierckpt: step %d on tier %r: template keys not in the checkpoint: %s; checkpoint keys not in the template: %s",
                 step, tier, some_keys(missing) or "none", some_keys(unexpected) or "none")
    return missing, unexpected


def some_keys(keys: list[str], limit: int = 5) -> str:
    """The first ``limit`` of ``keys`` for a message, and how many more there are."""
    return ", ".join(keys[:limit]) + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)`` in a worker thread; a cancellation waits for the thread to be done with what it holds.

    The thread cannot be stopped: the files stay open, the version leased and the staging slots lent
    until it returns, then the cancellation goes through.
    """
    running = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.gather(running, return_exceptions=True)
        raise


@contextlib.contextmanager
def _borrow(staging: MemoryTier | None, nbytes: int) -> Iterator[memoryview | None]:
    if staging is None or not nbytes:
        yield None
        return
    with staging.borrow(nbytes) as lent:
        yield lent
