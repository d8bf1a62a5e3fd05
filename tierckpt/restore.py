"""Restore: find the newest committed version across tiers, verify it, load it.

Candidates are every tier's committed versions, newest step first and, for one step, the fastest
tier first. A version that fails verification (damaged manifest, missing file, checksum mismatch)
gives a warning naming tier, step and key, and the next candidate is tried: the same step on a slower
tier, then older steps.

A version whose records are exactly the template's (same keys, dtypes, shapes, DTensor pieces) is
read as below. Any other (saved by another parallel layout, restored without a template where it holds
DTensor shards, or with ``cast``) is read through its saved layout (:mod:`tierckpt.reshard`). The
template's keys are checked against the version's first (:func:`check_keys`).

Bytes are read in the tier's threads with O_DIRECT where the tier allows it, chunk by chunk, each
chunk hashed right after its read while it is in cache. New tensors of 1 MiB or more get page-aligned
memory of their own, so the disk writes straight into them; smaller ones are copied from an aligned
scratch buffer. A template's tensors are overwritten only after the whole version has verified: from
a disk, bytes are staged and copied into the template at the end (the one extra copy, ~0.1 s per GiB
here; template memory is rarely page-aligned, so the disk could not write into it directly anyway).
A failed attempt therefore never leaves a half-restored model behind, and a caller told that nothing
verifies still holds the freshly initialised model it passed in. A snapshot in host memory cannot
fail half-way, so it is copied straight into the template.

The staging area is borrowed from the host pool when its free slots are large enough (one slot, or
adjacent ones: :meth:`MemoryTier.borrow <tierckpt.tiers.memory.MemoryTier.borrow>`), which is the
usual case at start-up: that memory was faulted in when the Checkpointer was made, and the disk
writes into it at full speed. Otherwise it is one fresh page-aligned mapping, faulted in ahead of
the reads; fresh memory costs 0.25-2.3 s per GiB to fault here. Measured at 4 GiB, in the same runs:
~78-81% of the O_DIRECT read limit staged in the pool, 55-57% in a fresh mapping. Most of the rest is
the copy into the template, which cannot start before the last chunk verified (benchmarks/RESULTS.md).
The slots are lent until the load is over, so a save meanwhile takes another slot or waits, skips or
evicts per ``host.on_full``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from tierckpt._buffers import align_up, aligned_buffer, prefault, tensor_bytes
from tierckpt.errors import CorruptCheckpointError, LayoutError, RestoreError
from tierckpt.format import TensorRecord
from tierckpt.landing import Target, finish, new_array
from tierckpt.reshard import load as reshard
from tierckpt.reshard.layout import NotHere, SavedLayout
from tierckpt.state import Leaf, flatten, format_path, numpy_dtype, skeleton_leaf_count, torch_dtype
from tierckpt.tiers.base import Tier, VersionSource
from tierckpt.tiers.fsio import ChunkJobs, scratch
from tierckpt.tiers.fswrite import scratch_bytes
from tierckpt.tiers.memory import MemorySource, MemoryTier

log = logging.getLogger("tierckpt")



@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore_latest` returns."""

    step: int
    state: Any
    tier: str  # the tier it was read from
    metadata: dict[str, Any] = field(default_factory=dict)
    # With a template: its array keys the version lacks (left as they were; only with strict=False),
    # and the version's keys the template lacks (new arrays in ``state``).
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()


def template_leaves(template: Any) -> dict[str, Leaf]:
    if template is None:
        return {}
    return {format_path(leaf.path): leaf for leaf in flatten(template)[1]}


async def restore_latest(
    tiers: Sequence[Tier],
    template: Any,
    staging: MemoryTier | None = None,
    *,
    strict: bool = True,
    cast: bool = False,
) -> Restored | None:
    """The newest version that verifies, loaded (into ``template`` when given); None if none does.

    ``staging``: the memory tier whose free slots may hold the bytes staged for the template (see the
    module docstring); without it, or when they are too small, a fresh mapping does. ``strict`` and
    ``cast``: see :func:`check_keys` and :func:`tierckpt.reshard.load.plan`.
    """
    by_path = template_leaves(template)
    candidates = sorted(
        ((info.step, i) for i, tier in enumerate(tiers) for info in tier.versions()),
        key=lambda c: (-c[0], c[1]),
    )
    for step, i in candidates:
        tier = tiers[i]
        try:
            lease = tier.lease(step)
        except KeyError:
            continue  # evicted from memory since the list was made
        with contextlib.ExitStack() as held_open:
            held_open.callback(lease.release)
            try:
                read, targets, keys = await read_version(held_open, tier, step, by_path, staging, strict=strict, cast=cast)
            except NotHere as exc:
                log.info("tierckpt: %s; trying the next candidate", exc)
                continue
            except CorruptCheckpointError as exc:
                message = f"tierckpt: step {step} on tier {tier.name!r} does not verify ({exc}); trying the next candidate"
                log.warning(message)
                warnings.warn(message, RuntimeWarning, stacklevel=3)
                continue
            state = await in_thread(finish, read, targets)
            return Restored(step, state, tier.name, dict(read.metadata), *keys)
    return None


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
    stage_all: bool = False,
) -> tuple[VersionSource | SavedLayout, list[Target], tuple[tuple[str, ...], tuple[str, ...]]]:
    """Read and verify what this rank restores of ``step`` from ``tier``; returns what
    :func:`~tierckpt.landing.finish` takes, and the keys :func:`check_keys` found. Only a snapshot in
    host memory may have written into the template yet (unless ``stage_all``). What it holds (files,
    staging) is released by ``held_open``.

    A version whose records are exactly this rank's template is read as it is; any other (saved with
    another parallel layout, or needing consolidation or a dtype conversion) is read from its saved
    layout (:mod:`tierckpt.reshard`).

    Raises:
        CorruptCheckpointError: it does not verify.
        NotHere: the tier holds only part of a version this rank needs more of.
        RestoreError: the template does not match (see :func:`check_keys`).
    """
    executor, threads = getattr(tier, "executor"), tier.config.io_threads
    try:
        source: VersionSource | None = await tier.read_whole(step)
    except LayoutError:  # saved by another number of ranks
        source = None
    if source is not None:
        held_open.callback(source.close)
        missing, unexpected = check_keys(source.records, templates, strict=strict, tier=tier.name, step=step)
        if reshard.fits(source.records, templates):
            arena = held_open.enter_context(_borrow(staging, staging_bytes(source, templates, stage_all=stage_all)))
            targets = await in_thread(read_verified, source, templates, executor, threads, arena, stage_all=stage_all)
            return source, targets, (tuple(missing), tuple(unexpected))
    layout = await tier.read_layout(step, rank)
    missing, unexpected = check_keys(layout.records, templates, strict=strict, tier=tier.name, step=step)
    arena = held_open.enter_context(_borrow(staging, reshard.staging_bytes(layout, templates)))
    planned = reshard.plan(layout, templates, arena, cast=cast)
    pieces = await asyncio.to_thread(planned.open)
    held_open.callback(pieces.close)
    return layout, await in_thread(planned.run, pieces, executor, threads), (tuple(missing), tuple(unexpected))


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
            f"step {step} on tier {tier!r} lacks {len(missing)} array(s) of the template: {_some(missing)} "
            "(restore_latest(..., strict=False) leaves them as they are)",
            tier=tier,
            step=step,
        )
    if missing or unexpected:
        log.info("tierckpt: step %d on tier %r: template keys not in the checkpoint: %s; checkpoint keys not in the template: %s",
                 step, tier, _some(missing) or "none", _some(unexpected) or "none")
    return missing, unexpected


def _some(keys: list[str], limit: int = 5) -> str:
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


def _mismatch(record: TensorRecord, source: VersionSource, value: Any) -> RestoreError:
    where = f"step {source.step} on tier {source.tier!r}"
    if record.kind == "torch":
        have = (
            f"{str(getattr(value, 'dtype', type(value).__name__)).removeprefix('torch.')}"
            f"{list(getattr(value, 'shape', ()))}"
        )
        text = f"{record.key}: {where} holds {record.dtype}{list(record.shape)}, the template has {have}"
    else:
        text = f"{record.key}: {where} holds {record.dtype}{list(record.shape)}, the template does not match"
    return RestoreError(text, tier=source.tier, step=source.step, key=record.key)


def _check(record: TensorRecord, source: VersionSource, template: Leaf | None) -> Any:
    """The record's dtype, after checking its length and the template (nothing is written yet)."""
    if record.kind == "torch":
        dtype: Any = torch_dtype(record.dtype)
        itemsize = dtype.itemsize
    else:
        import numpy as np

        dtype = numpy_dtype(record.dtype)
        itemsize = np.dtype(dtype).itemsize
    if math.prod(record.shape) * itemsize != record.nbytes:
        raise CorruptCheckpointError(
            f"{record.key}: {record.nbytes} stored bytes for {record.dtype}{list(record.shape)}",
            tier=source.tier,
            step=source.step,
            key=record.key,
        )
    if template is not None:
        value = template.value
        if template.kind != record.kind or value.dtype != dtype or tuple(value.shape) != record.shape:
            raise _mismatch(record, source, value)
    return dtype


def _in_place(source: VersionSource, record: TensorRecord, value: Any) -> memoryview | None:
    """The template's own bytes, when decoding straight into them cannot hurt; else None.

    Only a snapshot in host memory qualifies: it has no checksums to fail and no codec, so once the
    template check passed nothing can stop the copy half-way. Anything read from a disk is staged.
    """
    if not isinstance(source, MemorySource) or record.codec != "none" or record.nbytes == 0:
        return None
    if any(c.checksum >= 0 for c in record.all_chunks()):
        return None
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.is_contiguous() and not value.is_conj() and not value.is_neg():
            return tensor_bytes(value)
        return None
    if value.flags.c_contiguous and value.flags.writeable:
        return memoryview(value.reshape(-1).view("uint8"))
    return None


def _staged(source: VersionSource, record: TensorRecord, template: Leaf | None, stage_all: bool = False) -> bool:
    """Whether the record goes to a template through the staging area (every one, with ``stage_all``)."""
    if template is None or record.nbytes == 0:
        return False
    return stage_all or _in_place(source, record, template.value) is None


def staging_bytes(source: VersionSource, templates: dict[str, Leaf], *, stage_all: bool = False) -> int:
    """The size of the staging area :func:`_plan` lays out for loading ``source`` into ``templates``."""
    return sum(align_up(r.nbytes) for r in source.records if _staged(source, r, templates.get(r.key), stage_all))


def _plan(source: VersionSource, templates: dict[str, Leaf], lent: memoryview | None = None, stage_all: bool = False) -> list[Target]:
    """Destinations for every record, after every check: a mismatch raises before a byte moves.

    Staged records go to ``lent`` (memory already faulted in) when it is large enough, else to a
    fresh mapping.
    """
    dtypes = [_check(r, source, templates.get(r.key)) for r in source.records]
    targets: list[Target] = []
    to_stage: list[Target] = []
    for record, dtype in zip(source.records, dtypes):
        template = templates.get(record.key)
        if template is None:
            value, out, fresh = new_array(record.kind, dtype, record.shape, record.nbytes)
            targets.append(Target(record, value, out, fresh))
            continue
        staged = _staged(source, record, template, stage_all)
        own = None if staged else _in_place(source, record, template.value)
        targets.append(Target(record, template.value, own if own is not None else memoryview(b""), False, dtensor=template.dtensor))
        if staged:
            to_stage.append(targets[-1])
    if to_stage:
        # Staged records share one page-aligned area, 4 KiB-aligned as on disk: O_DIRECT lands in it.
        # A fresh mapping goes when the last view of it does, at the end of the load.
        size = sum(align_up(t.record.nbytes) for t in to_stage)
        if lent is not None and lent.nbytes >= size:
            arena, fresh = lent, False
        else:
            arena, fresh = memoryview(aligned_buffer(size)), True
        offset = 0
        for t in to_stage:
            t.out, t.fresh = arena[offset : offset + t.record.nbytes], fresh
            t.staged = _over(arena, offset, t.record, t.value)
            offset += align_up(t.record.nbytes)
    return targets


def _over(arena: memoryview, offset: int, record: TensorRecord, like: Any) -> Any:
    """A tensor/array of the record's dtype and shape over staging bytes (no copy)."""
    if isinstance(like, torch.Tensor):
        flat = torch.frombuffer(arena, dtype=torch.uint8, count=record.nbytes, offset=offset)
        return flat.view(like.dtype).view(record.shape)
    import numpy as np

    flat = np.frombuffer(arena, dtype=np.uint8, count=record.nbytes, offset=offset)
    return flat.view(like.dtype).reshape(record.shape)


def load(
    source: VersionSource,
    templates: dict[str, Leaf],
    executor: concurrent.futures.Executor,
    threads: int = 2,
    lent: memoryview | None = None,
) -> Any:
    """Read, verify and decode every record of ``source``; returns the rebuilt state (blocking).

    :func:`read_verified` then :func:`finish`; several ranks agree between the two, so that no
    template is written before every rank verified its part.
    """
    return finish(source, read_verified(source, templates, executor, threads, lent))


def read_verified(
    source: VersionSource,
    templates: dict[str, Leaf],
    executor: concurrent.futures.Executor,
    threads: int = 2,
    lent: memoryview | None = None,
    *,
    stage_all: bool = False,
) -> list[Target]:
    """Read, verify and decode every record of ``source`` into its destination (blocking).

    ``threads`` of the tier's ``executor`` read and verify chunk by chunk, straight into the
    destinations; meanwhile this thread faults the fresh destination pages in ahead of them, then
    reads alongside them. A template is written only after the whole version verified (staged bytes
    are copied then), except from host memory, where nothing can fail half-way (see :func:`_in_place`).
    ``lent``: page-aligned memory, already faulted in, to stage in when large enough (see :func:`_plan`);
    nothing uses it once :func:`finish` returns. ``stage_all``: stage even what could be copied
    straight into the template (a template is then written only by :func:`finish`).
    """
    if skeleton_leaf_count(source.skeleton) != len(source.records):
        raise CorruptCheckpointError(
            f"step {source.step} on tier {source.tier!r}: the skeleton does not match the {len(source.records)} tensor records",
            tier=source.tier,
            step=source.step,
        )
    targets = _plan(source, templates, lent, stage_all)
    calls = []
    ahead: list[tuple[int, memoryview]] = []
    for t in targets:
        for c in range(len(t.record.chunks)):
            start, length = t.record.chunk_span(c)
            out = t.out[start : start + length]
            calls.append(functools.partial(_read_chunk, source, t.record, c, out))
            if t.fresh:
                ahead.append((len(calls) - 1, out))
    jobs = ChunkJobs(calls, executor, threads)
    try:
        # Skip what the readers have reached already: where faults are slower than the disk, each
        # side then faults pages of its own instead of both waiting on the same ones.
        for index, out in ahead:
            if jobs.error is not None:
                break
            if index > jobs.started:
                prefault(out)
        jobs.join()
    except BaseException as exc:
        jobs.stop()
        if isinstance(exc, CorruptCheckpointError) and exc.key is None:
            raise CorruptCheckpointError(str(exc), tier=source.tier, step=source.step) from exc
        raise
    return targets


def _read_chunk(source: VersionSource, record: TensorRecord, chunk: int, out: memoryview) -> None:
    source.read_logical(record, chunk, out, scratch(scratch_bytes(record.chunk_bytes)))
