"""The exact-fit fast path of the planner: a version whose records are exactly this rank's template.

Each record is read whole, chunk by chunk, straight into its destination: no chunk is copied out
of a buffer as in the general path (:mod:`tierckpt.restore.reshard`). New tensors of 1 MiB or more
get page-aligned memory of their own, so the disk writes straight into them; smaller ones are copied
from an aligned scratch buffer. A template's tensors are overwritten only after the whole version has
verified: from a disk, bytes are staged and copied into the template at the end (the one extra copy,
~0.1 s per GiB here; template memory is rarely page-aligned, so the disk could not write into it
directly anyway). A failed attempt therefore never leaves a half-restored model behind, and a caller
told that nothing verifies still holds the freshly initialised model it passed in. A snapshot in host
memory cannot fail half-way, so it is copied straight into the template.

Fresh destination pages (new tensors' own mappings, a fresh staging mapping) are faulted in by the
calling thread ahead of the tier's reader threads (:meth:`tierckpt.restore.plan.Plan.run`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tierckpt._buffers import align_up, tensor_bytes
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import TensorRecord
from tierckpt.format.source import VersionSource
from tierckpt.restore.landing import Target, Work, new_array, over, staging_area
from tierckpt.state import Leaf, numpy_dtype, skeleton_leaf_count, torch_dtype
from tierckpt.tiers.fsio import scratch
from tierckpt.tiers.fswrite import scratch_bytes
from tierckpt.tiers.memory import MemorySource

__all__ = ["land", "staging_bytes"]

def _check(record: TensorRecord, source: VersionSource) -> Any:
    """The record's dtype, after checking its length (nothing is written yet). The template already
    matches: this path is taken only when :func:`tierckpt.restore.plan.fits` said so."""
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
    """The size of the staging area :func:`land` lays out for loading ``source`` into ``templates``."""
    return sum(align_up(r.nbytes) for r in source.records if _staged(source, r, templates.get(r.key), stage_all))


def _targets(source: VersionSource, templates: dict[str, Leaf], lent: memoryview | None = None, stage_all: bool = False) -> list[Target]:
    """Destinations for every record, after every check: a mismatch raises before a byte moves.

    Staged records go to ``lent`` (memory already faulted in) when it is large enough, else to a
    fresh mapping.
    """
    dtypes = [_check(r, source) for r in source.records]
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
        arena, fresh = staging_area(lent, sum(align_up(t.record.nbytes) for t in to_stage))
        offset = 0
        for t in to_stage:
            t.out, t.fresh = arena[offset : offset + t.record.nbytes], fresh
            t.staged = over(arena, offset, t.record.nbytes, t.value.dtype, t.record.shape, t.record.kind)
            offset += align_up(t.record.nbytes)
    return targets


def land(
    source: VersionSource, templates: dict[str, Leaf], lent: memoryview | None = None, *, stage_all: bool = False
) -> tuple[list[Target], list[Work], list[tuple[int, memoryview]]]:
    """Every record of ``source`` into its destination: the targets, one chunk job per stored chunk
    (each reads, verifies and decodes the chunk straight into its destination), and the fresh
    destinations to fault in ahead of the jobs (job index, bytes). Nothing is read yet.

    ``lent``: page-aligned memory, already faulted in, to stage in when large enough (see
    :func:`_targets`); nothing uses it once :func:`~tierckpt.restore.landing.finish` returns.
    ``stage_all``: stage even what could be copied straight into the template (a template is then
    written only by :func:`~tierckpt.restore.landing.finish`).

    Raises:
        CorruptCheckpointError: the skeleton does not match the records, or a record's length its shape.
    """
    if skeleton_leaf_count(source.skeleton) != len(source.records):
        raise CorruptCheckpointError(
            f"step {source.step} on tier {source.tier!r}: the skeleton does not match the {len(source.records)} tensor records",
            tier=source.tier,
            step=source.step,
        )
    targets = _targets(source, templates, lent, stage_all)
    work: list[Work] = []
    ahead: list[tuple[int, memoryview]] = []
    for t in targets:
        for c in range(len(t.record.chunks)):
            start, length = t.record.chunk_span(c)
            out = t.out[start : start + length]
            work.append((_read_chunk, (t.record, c, out)))
            if t.fresh:
                ahead.append((len(work) - 1, out))
    return targets, work, ahead


def _read_chunk(source: VersionSource, record: TensorRecord, chunk: int, out: memoryview) -> None:
    source.read_logical(record, chunk, out, scratch(scratch_bytes(record.chunk_bytes)))
