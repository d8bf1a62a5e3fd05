"""Load a saved layout into this rank's state: each destination filled from the stored pieces it overlaps.

The destination of a key is the template's local piece (a DTensor's shard, where its placements put
it in the global tensor), or the whole global tensor (a plain tensor in the template, or no template:
consolidation). For each stored piece that overlaps it, only the chunks holding overlapping elements
are read; each is verified against its checksum as it is read, decoded into a per-thread buffer of
one chunk, and the overlapping boxes are copied out of it (:mod:`tierckpt.reshard.boxes`). No rank
gathers a tensor it does not keep, and none builds a buffer of a whole tensor it restores only a
piece of.

As in every restore, a template is written only after every chunk verified: its pieces are staged
(in the saved dtype) and copied in by :func:`tierckpt.landing.finish`, which also converts the dtype
when the caller asked for ``cast=True``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from typing import Any, Sequence

import torch

from tierckpt._buffers import align_up, aligned_buffer
from tierckpt.errors import CorruptCheckpointError, RestoreError
from tierckpt.format import TensorRecord
from tierckpt.landing import Target, new_array
from tierckpt.reshard.boxes import Box, copy_boxes, intersect, linear_boxes
from tierckpt.reshard.layout import NotHere, SavedLayout, global_shape
from tierckpt.state import Leaf, numpy_dtype, torch_dtype
from tierckpt.tiers.base import VersionSource
from tierckpt.tiers.fsio import ChunkJobs, scratch, scratch2
from tierckpt.tiers.fswrite import scratch_bytes

__all__ = ["ReshardPlan", "fits", "plan", "staging_bytes"]


def fits(records: tuple[TensorRecord, ...], templates: dict[str, Leaf]) -> bool:
    """Whether one rank's own records load as they are: each is exactly its template's piece.

    False when any record needs the saved layout: a stored shard whose template is another piece (or
    a plain tensor, or none: consolidation), a template shard of a value stored whole, or a dtype or
    shape to convert or to refuse with the reason.
    """
    for r in records:
        t = templates.get(r.key)
        sharded = r.region is not None and r.region.global_shape != r.shape
        if t is None:
            if sharded:
                return False
            continue
        if t.kind != r.kind or t.dtype != r.dtype or tuple(t.shape) != r.shape:
            return False
        if sharded and t.region != r.region:
            return False
        if t.region is not None and t.region.global_shape != tuple(t.shape) and r.region is None:
            return False
    return True


def _itemsize(record: TensorRecord) -> tuple[Any, int]:
    if record.kind == "torch":
        dtype: Any = torch_dtype(record.dtype)
        return dtype, dtype.itemsize
    dtype = numpy_dtype(record.dtype)
    return dtype, dtype.itemsize


def _target_box(layout: SavedLayout, record: TensorRecord, template: Leaf | None, cast: bool) -> Box:
    """Where the destination lies in the global tensor, after checking the template against the record."""
    saved = global_shape(record)
    if template is None:
        return (0,) * len(saved), saved

    def refuse(why: str) -> RestoreError:
        return RestoreError(f"{record.key}: step {layout.step} on tier {layout.tier!r} {why}", tier=layout.tier, step=layout.step, key=record.key)

    want = template.region.global_shape if template.region is not None else tuple(template.shape)
    if template.kind != record.kind:
        raise refuse(f"holds a {record.kind} array, the template a {template.kind} one")
    if want != saved:
        raise refuse(f"holds {record.dtype}{list(saved)}, the template has {template.dtype}{list(want)} (global shapes differ)")
    if template.dtype != record.dtype and not (cast and record.kind == "torch"):
        hint = " (restore_latest(..., cast=True) converts it)" if record.kind == "torch" else ""
        raise refuse(f"holds {record.dtype}{list(saved)}, the template has {template.dtype}{list(want)}{hint}")
    if template.region is not None:
        return template.region.offset, tuple(template.shape)
    return (0,) * len(saved), saved


def staging_bytes(layout: SavedLayout, templates: dict[str, Leaf]) -> int:
    """The staging area :func:`plan` lays out for the template's pieces."""
    total = 0
    for r in layout.records:
        t = templates.get(r.key)
        if t is not None:
            total += align_up(math.prod(t.shape) * _itemsize(r)[1])
    return total


class ReshardPlan:
    """What this rank reads from a saved layout, and where it lands (built by :func:`plan`)."""

    def __init__(self, layout: SavedLayout, targets: list[Target], records: list[TensorRecord], work: list[tuple[Any, ...]], partial: bool) -> None:
        self.layout = layout
        self.targets = targets  # one per planned record, for tierckpt.landing.finish
        self.records = records  # the stored pieces to open (layout.open)
        # Some piece is read for only part of its elements: other ranks (on this node, likely) read
        # the same chunks for the rest, so they are better read through the page cache, where the
        # second reader finds them (O_DIRECT read a Shard(0) -> Shard(1) restore twice from disk).
        self.partial = partial
        self._work = work

    def open(self) -> VersionSource:
        """The source :meth:`run` reads from (blocking; the caller closes it)."""
        return self.layout.open(self.records, shared=self.partial)

    def run(self, source: VersionSource, executor: concurrent.futures.Executor, threads: int = 2) -> list[Target]:
        """Read, verify and copy every needed chunk of ``source`` (from ``layout.open(records)``; blocking)."""
        jobs = ChunkJobs([functools.partial(_copy_chunk, source, *w) for w in self._work], executor, threads)
        try:
            jobs.join()
        except BaseException as exc:
            jobs.stop()
            if isinstance(exc, CorruptCheckpointError) and exc.key is None:
                raise CorruptCheckpointError(str(exc), tier=self.layout.tier, step=self.layout.step) from exc
            raise
        return self.targets


def plan(
    layout: SavedLayout,
    templates: dict[str, Leaf],
    lent: memoryview | None = None,
    *,
    cast: bool = False,
    records: Sequence[TensorRecord] | None = None,
) -> ReshardPlan:
    """Check every template against the layout and lay out every destination; nothing is read yet.

    ``records``: plan only these of ``layout.records`` (one at a time, say, to bound memory); the
    plan's targets are then theirs, not a whole state's.

    Template pieces are staged in ``lent`` when it is large enough (see :func:`staging_bytes`), else in
    a fresh mapping; keys without a template get new tensors of their global shape.

    Raises:
        RestoreError: a template does not match its key (kind, global shape, dtype without ``cast``).
        CorruptCheckpointError: the pieces do not cover a destination, or disagree on its dtype.
        NotHere: the layout is only part of the version and lacks pieces this rank needs.
    """
    wanted = layout.records if records is None else tuple(records)
    boxes = [_target_box(layout, r, templates.get(r.key), cast) for r in wanted]
    staged_size = sum(align_up(math.prod(b[1]) * _itemsize(r)[1]) for r, b in zip(wanted, boxes) if r.key in templates)
    arena: memoryview | None = None
    if staged_size:
        arena = lent if lent is not None and lent.nbytes >= staged_size else memoryview(aligned_buffer(staged_size))
    targets: list[Target] = []
    work: list[tuple[Any, ...]] = []
    needed: dict[int, TensorRecord] = {}
    partial = False
    offset = 0
    for r, box in zip(wanted, boxes):
        dtype, itemsize = _itemsize(r)
        nbytes = math.prod(box[1]) * itemsize
        template = templates.get(r.key)
        if template is None:
            value, out, _ = new_array(r.kind, dtype, box[1], nbytes)
            targets.append(Target(r, value, out, False))
        else:
            assert arena is not None
            out = arena[offset : offset + nbytes]
            targets.append(Target(r, template.value, out, False, _over(arena, offset, nbytes, dtype, box[1], r.kind), template.dtensor))
            offset += align_up(nbytes)
        covered = 0
        for piece in layout.pieces(r):
            overlap = intersect(piece.box, box)
            if overlap is None:
                continue
            covered += math.prod(overlap[1])
            partial = partial or overlap[1] != piece.box[1]
            stored = piece.record
            if (stored.kind, stored.dtype) != (r.kind, r.dtype):
                raise CorruptCheckpointError(
                    f"step {layout.step} on tier {layout.tier!r}: {r.key} is {r.dtype} in one rank's part and {stored.dtype} in another's",
                    tier=layout.tier, step=layout.step, key=r.key,
                )
            needed[id(stored)] = stored
            # Only the chunks holding elements of the destination are read.
            per_chunk = stored.chunk_bytes // itemsize
            for c in range(len(stored.chunks)):
                first = c * per_chunk
                last = min(first + per_chunk, math.prod(stored.shape))
                spans = linear_boxes(stored.shape, first, last)
                if any(intersect((tuple(s + o for s, o in zip(start, piece.box[0])), size), box) for start, size in spans):
                    work.append((stored, c, piece.box, box, out, itemsize))
        if covered != math.prod(box[1]):
            if not layout.complete:
                raise NotHere(f"tier {layout.tier!r} holds only part of step {layout.step}: not all of {r.key}")
            raise CorruptCheckpointError(
                f"step {layout.step} on tier {layout.tier!r}: the stored pieces of {r.key} cover {covered} of the "
                f"{math.prod(box[1])} elements this rank restores",
                tier=layout.tier, step=layout.step, key=r.key,
            )
    return ReshardPlan(layout, targets, list(needed.values()), work, partial)


def _over(arena: memoryview, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...], kind: str) -> Any:
    """A tensor/array of ``dtype`` and ``shape`` over staging bytes (no copy)."""
    if kind == "torch":
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(arena, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
    import numpy as np

    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(arena, dtype=np.uint8, count=nbytes, offset=offset).view(dtype).reshape(shape)


def _copy_chunk(source: VersionSource, record: TensorRecord, chunk: int, piece: Box, target: Box, out: memoryview, itemsize: int) -> None:
    start, length = record.chunk_span(chunk)
    data = scratch2(record.chunk_bytes)[:length]
    source.read_logical(record, chunk, data, scratch(scratch_bytes(record.chunk_bytes)))
    copy_boxes(data, start // itemsize, piece, target, out, itemsize)
