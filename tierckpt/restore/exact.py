"""The exact-fit fast path of the planner: a version whose records are exactly this rank's template.

Each record is read whole, chunk by chunk, straight into its destination: no chunk is copied out
of a buffer as in the general path (:mod:`tierckpt.restore.reshard`).

- **Into a template** (the default): each chunk is read into the reading thread's reused, aligned
  buffer (O_DIRECT where the tier allows), verified there, and copied into the template's own memory;
  a chunk bound for a GPU goes through a ring of pinned buffers instead (:mod:`tierckpt.restore.device`).
  A damaged chunk never lands, but a version that fails half-way has written its chunks that
  verified: the caller (:mod:`tierckpt.restore.choose`) tracks which template keys a failed attempt
  touched (:attr:`Plan.touched <tierckpt.restore.plan.Plan.touched>`) and says so. Reads into a
  reused buffer run up to twice as fast here as reads into a state-sized destination, and the copy
  out of it runs beside the next read: no pass over the state is left for the end.
- **With** ``verify_first``, a template is written only after the whole version verified: its bytes
  are staged (in free host slots, else a fresh mapping) and copied into the template at the end (the
  one extra pass, measured in benchmarks/RESULTS.md). A caller told that nothing verifies then still
  holds the template it passed in. A snapshot in host memory cannot fail half-way, so it is copied
  straight into the template either way; with ``stage_all`` (ranks that agree before any writes) it
  is staged too. A template whose memory cannot take chunks directly (a non-contiguous view) is
  always staged.
- **New tensors** of 1 MiB or more get page-aligned memory of their own, so the disk writes straight
  into them (DMA into fresh pages beat faulting them by a copy here); smaller ones are copied from
  the aligned buffer. Fresh destination pages (new tensors' own mappings, a fresh staging mapping)
  are faulted in by the calling thread ahead of the tier's reader threads
  (:meth:`tierckpt.restore.plan.Plan.run`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tierckpt._buffers import align_up, tensor_bytes
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import TensorRecord
from tierckpt.format.source import VersionSource
from tierckpt.restore.device import DeviceRing, device_bytes
from tierckpt.restore.landing import Target, Work, new_array, over, staging_area
from tierckpt.state import Leaf, numpy_dtype, skeleton_leaf_count, torch_dtype
from tierckpt.storage.scratch import scratch, scratch_bytes
from tierckpt.tiers.memory.tier import MemorySource

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


def _template_bytes(value: Any) -> memoryview | None:
    """The template's own bytes, when chunks can land in them directly: a contiguous CPU tensor (not a
    lazily conjugated or negated view) or a writable C-contiguous array; else None (staged)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.is_contiguous() and not value.is_conj() and not value.is_neg():
            return tensor_bytes(value)
        return None
    if value.flags.c_contiguous and value.flags.writeable:
        return memoryview(value.reshape(-1).view("uint8"))
    return None


def _cannot_fail(source: VersionSource, record: TensorRecord) -> bool:
    """A snapshot in host memory without checksums or a codec: once the template check passed,
    nothing can stop its copy half-way, so it never needs staging to keep the template whole."""
    if not isinstance(source, MemorySource) or record.codec != "none":
        return False
    return not any(c.checksum >= 0 for c in record.all_chunks())


def _staged(source: VersionSource, record: TensorRecord, template: Leaf | None, verify_first: bool, stage_all: bool = False) -> bool:
    """Whether the record goes to a template through the staging area: with ``stage_all``, every one;
    with ``verify_first``, every one that could fail half-way; always, a template whose own bytes
    cannot take the chunks (on a GPU, not contiguous)."""
    if template is None or record.nbytes == 0:
        return False
    if stage_all or not _lands_directly(template.value):
        return True
    return verify_first and not _cannot_fail(source, record)


def _lands_directly(value: Any) -> bool:
    return _template_bytes(value) is not None or (isinstance(value, torch.Tensor) and device_bytes(value) is not None)


def staging_bytes(source: VersionSource, templates: dict[str, Leaf], *, verify_first: bool, stage_all: bool = False) -> int:
    """The size of the staging area :func:`land` lays out for loading ``source`` into ``templates``."""
    return sum(align_up(r.nbytes) for r in source.records if _staged(source, r, templates.get(r.key), verify_first, stage_all))


def _targets(
    source: VersionSource, templates: dict[str, Leaf], lent: memoryview | None, verify_first: bool, stage_all: bool
) -> list[Target]:
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
        staged = _staged(source, record, template, verify_first, stage_all)
        own = None if staged else _template_bytes(template.value)
        cuda = None if staged or own is not None else device_bytes(template.value)
        out = own if own is not None else memoryview(b"")
        targets.append(Target(record, template.value, out, False, dtensor=template.dtensor, template=True, cuda_bytes=cuda))
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
    source: VersionSource, templates: dict[str, Leaf], lent: memoryview | None = None, *, verify_first: bool = True, stage_all: bool = False,
    owner: int | None = None,
) -> tuple[list[Target], list[Work], list[tuple[int, memoryview]], DeviceRing | None, list[Work]]:
    """Every record of ``source`` into its destination: the targets, one chunk job per stored chunk
    (each reads, verifies and decodes the chunk into its destination), the fresh destinations to
    fault in ahead of the jobs (job index, bytes), the ring of pinned buffers that the chunks for
    CUDA templates go through (None without any), and the jobs deferred. Nothing is read yet.

    ``lent``: page-aligned memory, already faulted in, to stage in when large enough (see
    :func:`_targets`); nothing uses it once :func:`~tierckpt.restore.landing.finish` returns.
    ``stage_all``: stage even what could be copied straight into the template (a template is then
    written only by :func:`~tierckpt.restore.landing.finish`). ``owner``: this rank, when the chunks of
    replicated values that other ranks store come from those ranks (:mod:`tierckpt.restore.replicas`):
    their jobs are deferred, run only if those ranks cannot send them.

    Raises:
        CorruptCheckpointError: the skeleton does not match the records, or a record's length its shape.
    """
    if skeleton_leaf_count(source.skeleton) != len(source.records):
        raise CorruptCheckpointError(
            f"step {source.step} on tier {source.tier!r}: the skeleton does not match the {len(source.records)} tensor records",
            tier=source.tier,
            step=source.step,
        )
    targets = _targets(source, templates, lent, verify_first, stage_all)
    work: list[Work] = []
    deferred: list[Work] = []
    ahead: list[tuple[int, memoryview]] = []
    to_devices = [t for t in targets if t.cuda_bytes is not None]
    ring = None
    if to_devices:
        chunk = max(t.record.chunk_bytes for t in to_devices)
        ring = DeviceRing(scratch_bytes(chunk), {t.cuda_bytes.device for t in to_devices})
    for t in targets:
        for c in range(len(t.record.chunks)):
            start, length = t.record.chunk_span(c)
            shared = t.record.shared
            jobs = deferred if owner is not None and shared is not None and owner in shared and t.record.owner(c) != owner else work
            if t.cuda_bytes is not None:
                assert ring is not None  # made above for every target with CUDA bytes
                jobs.append((ring.land, (t.record, c, t.cuda_bytes[start : start + length])))
                continue
            out = t.out[start : start + length]
            jobs.append((_read_chunk, (t.record, c, out, not (t.template and t.staged is None))))
            if t.fresh and jobs is work:
                ahead.append((len(work) - 1, out))
    return targets, work, ahead, ring, deferred


def _read_chunk(source: VersionSource, record: TensorRecord, chunk: int, out: memoryview, private: bool) -> None:
    source.read_logical(record, chunk, out, scratch(scratch_bytes(record.chunk_bytes)), private=private)
