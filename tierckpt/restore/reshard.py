"""The general path of the planner: this rank's destinations filled from the stored pieces they overlap.

The destination of a key is the template's local piece (a DTensor's shard, where its placements put
it in the global tensor), or the whole global tensor (a plain tensor in the template, or no template:
consolidation). For each stored piece that overlaps it, only the chunks holding overlapping elements
are read; each is verified against its checksum as it is read, decoded into a per-thread buffer of
one chunk, and the overlapping boxes are copied out of it (:mod:`tierckpt.restore.boxes`). No rank
gathers a tensor it does not keep, and none builds a buffer of a whole tensor it restores only a
piece of.

As in every restore, a template is written only after every chunk verified: its pieces are staged
(in the saved dtype) and copied in by :func:`tierckpt.restore.landing.finish`, which also converts the
dtype when the caller asked for ``cast=True``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from tierckpt._buffers import align_up
from tierckpt.errors import CorruptCheckpointError, RestoreError
from tierckpt.format import TensorRecord
from tierckpt.format.saved_layout import Box, NotHere, SavedLayout, global_shape
from tierckpt.format.source import VersionSource
from tierckpt.restore.boxes import copy_boxes, intersect, linear_boxes
from tierckpt.restore.landing import Target, Work, new_array, over, staging_area
from tierckpt.state import Leaf, numpy_dtype, torch_dtype
from tierckpt.storage.scratch import scratch, scratch2, scratch_bytes

__all__ = ["land", "staging_bytes"]


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


def staging_bytes(records: Sequence[TensorRecord], templates: dict[str, Leaf]) -> int:
    """The staging area :func:`land` lays out for the template's pieces of ``records`` (a layout's)."""
    total = 0
    for r in records:
        t = templates.get(r.key)
        if t is not None:
            total += align_up(math.prod(t.shape) * _itemsize(r)[1])
    return total


def land(
    layout: SavedLayout,
    templates: dict[str, Leaf],
    lent: memoryview | None = None,
    *,
    cast: bool = False,
    records: Sequence[TensorRecord] | None = None,
) -> tuple[list[Target], list[Work], list[TensorRecord], bool]:
    """Check every template against the layout and lay out every destination; nothing is read yet.

    Returns the targets (one per planned record), one chunk job per stored chunk holding elements of a
    destination (each reads, verifies and decodes the chunk and copies the overlapping boxes out of it),
    the stored pieces to open (``layout.open``), and whether some piece is read for only part of its
    elements (then other ranks read the rest: see :attr:`tierckpt.restore.plan.Plan.partial`).

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
        arena = staging_area(lent, staged_size)[0]
    targets: list[Target] = []
    work: list[Work] = []
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
            targets.append(Target(r, template.value, out, False, over(arena, offset, nbytes, dtype, box[1], r.kind), template.dtensor, template=True))
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
                    work.append((_copy_chunk, (stored, c, piece.box, box, out, itemsize)))
        if covered != math.prod(box[1]):
            if not layout.complete:
                raise NotHere(f"tier {layout.tier!r} holds only part of step {layout.step}: not all of {r.key}")
            raise CorruptCheckpointError(
                f"step {layout.step} on tier {layout.tier!r}: the stored pieces of {r.key} cover {covered} of the "
                f"{math.prod(box[1])} elements this rank restores",
                tier=layout.tier, step=layout.step, key=r.key,
            )
    return targets, work, list(needed.values()), partial


def _copy_chunk(source: VersionSource, record: TensorRecord, chunk: int, piece: Box, target: Box, out: memoryview, itemsize: int) -> None:
    start, length = record.chunk_span(chunk)
    data = scratch2(record.chunk_bytes)[:length]
    source.read_logical(record, chunk, data, scratch(scratch_bytes(record.chunk_bytes)))
    copy_boxes(data, start // itemsize, piece, target, out, itemsize)
