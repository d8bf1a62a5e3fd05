"""Writing one version's data file from a :class:`VersionSource` (blocking; runs in tier threads).

What is written where is decided first, without I/O (:func:`tierckpt.storage.plan.plan_write`: the
chunks this rank owns, the codec per record, the raw layout's aligned offsets or packing); this module
executes the plan's items, and a byte store's :class:`~tierckpt.storage.store.DataWriter` moves the
bytes (:class:`~tierckpt.storage.local.LocalDataWriter`: O_DIRECT, ``pwritev``, one preallocation
and one fsync per file).

Chunks are the unit of work: each writer thread reads a chunk from the source (a zero-copy view of a
host slot, or, promoting from a faster filesystem tier, an O_DIRECT read into the thread's aligned
scratch, verified there), re-encodes it only when the record's codec differs from the one this tier
gives it (a chunk that does not compress by ``min_ratio`` is stored raw, and says so), hashes the
stored bytes while they are hot in cache (or reuses the checksum just verified, when the codecs
match), and hands them to the writer. An I/O error (a full disk, a quota, EIO) is raised naming the
data file, and what it was doing: the first one stops the chunks not yet started; the caller removes
the file.

On a tier with ``delta`` every chunk goes through its logical bytes: a whole version records each
chunk's digest; a differential one (``encoding.delta``, its base open) stores a chunk whose digest is
its base chunk's as a reference (nothing written), a changed floating-point chunk as its XOR frame
when that pays (not tried for a value whose frames did not pay lately:
:class:`~tierckpt.xordelta.XorHistory`), and any other chunk as the tier's codec stores it
(:mod:`tierckpt.tiers.stored.delta`).

Of a record shared by several ranks (``save(replicated=...)``), a rank writes only the chunks it owns
(:meth:`TensorRecord.owner`); its record holds None for the others, which their owners write.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from tierckpt.format import DELTA_CODECS, BaseChunk, Chunk, TensorRecord, checksum
from tierckpt.storage.local import LocalDataWriter
from tierckpt.storage.plan import WriteItem, WritePlan, plan_write
from tierckpt.storage.store import ByteStore, DataWriter
from tierckpt.tiers.base import VersionSource
from tierckpt.tiers.stored.encoding import VersionEncoding, element
from tierckpt.storage.scratch import ChunkJobs, scratch, scratch2, scratch_bytes
from tierckpt.xordelta import digest as logical_digest

_EMPTY = memoryview(b"")


def write_data_file(
    source: VersionSource,
    path: Path | str,
    encoding: VersionEncoding,
    executor: concurrent.futures.Executor,
    *,
    direct: bool = False,
    threads: int = 2,
    rank: int = 0,
    store: ByteStore | None = None,
    shared_by: Sequence[int] | None = None,
) -> tuple[TensorRecord, ...]:
    """Write every record of ``source`` into data object ``path`` and make it durable; returns the
    stored records.

    ``store``: where ``path`` (then a key) lives, written as the store writes (its own ``direct``);
    None: ``path`` is a local file, written with O_DIRECT when ``direct``. ``threads`` of ``executor`` and the calling thread write the chunks (see
    :class:`ChunkJobs`); ``rank`` is the writing rank: of a shared record, only its own chunks are written.
    ``shared_by``: the ranks that share values on this tier (a node-local tier: the node's ranks), a
    shared record's other ranks left out; None: as the source says.
    """
    records = source.records if shared_by is None else tuple(narrow(r, shared_by) for r in source.records)
    codecs = [encoding.codec_for(r) for r in records]
    plan = plan_write(records, codecs, rank=rank, raw_layout=encoding.raw_layout)
    if store is None:
        writer: DataWriter = LocalDataWriter(Path(path), plan, direct=direct)
    else:
        writer = store.open_data(str(path), plan)
    try:
        results = execute_plan(plan, source, writer, encoding, executor, threads)
        offsets = writer.finish()
    finally:
        writer.close()
    chunks = {(item.record, item.chunk): (offsets[item.index], result) for item, result in zip(plan.items, results)}
    name = Path(path).name
    return tuple(
        dataclasses.replace(
            r,
            file=name,
            codec=plan.codecs[ri],
            chunks=tuple(_chunk(chunks.get((ri, c)), plan.codecs[ri]) for c in range(len(r.chunks))),
        )
        for ri, r in enumerate(records)
    )


def narrow(record: TensorRecord, ranks: Sequence[int]) -> TensorRecord:
    """``record`` shared only by those of its ranks in ``ranks``, in the same turn order (every rank
    of them computes the same); a record left with one rank is that rank's own."""
    if record.shared is None:
        return record
    kept = tuple(q for q in record.shared if q in ranks)
    if kept == record.shared:
        return record
    # As saved, for a flush from this tier to one that shares among every rank again.
    return dataclasses.replace(record, shared=kept if len(kept) > 1 else None, saved_shared=record.shared)


class Written(NamedTuple):
    """What one item became: its stored bytes, their checksum and codec; against what base chunk
    (codec ``ref`` or ``delta``); its logical digest (a whole version of a tier with ``delta``)."""

    stored: int
    checksum: int
    codec: str
    base: BaseChunk | None = None
    digest: bytes | None = None


def _chunk(placed: tuple[int, Written] | None, codec: str) -> Chunk | None:
    if placed is None:
        return None  # another rank's chunk of a shared record
    offset, w = placed
    return Chunk(offset, w.stored, w.checksum, w.codec if w.codec != codec else None, base=w.base, digest=w.digest)


def execute_plan(
    plan: WritePlan,
    source: VersionSource,
    writer: DataWriter,
    encoding: VersionEncoding,
    executor: concurrent.futures.Executor,
    threads: int,
) -> list[Written]:
    """Read, encode, hash and write every item of ``plan``; returns what each item became."""
    elements = [element(r) for r in source.records]
    delta = encoding.delta

    def job(item: WriteItem) -> Written:
        record, codec = source.records[item.record], item.codec
        c = item.chunk
        _, length = record.chunk_span(c)
        stored_codec = record.chunk_codec(c)
        if record.codec == codec and not encoding.digests and stored_codec not in DELTA_CODECS:
            # Same codec on both tiers: the chunk moves as stored, raw fallbacks included.
            data = source.read_stored(record, c, scratch(scratch_bytes(record.chunk_bytes)))
            known = source.checksum_of(record, c)
            encoding.account(length, data.nbytes, compressed=stored_codec != "none")
            return _write(item, data, stored_codec, known)
        if stored_codec == "none":
            logical = source.read_stored(record, c, scratch(scratch_bytes(record.chunk_bytes)))  # no copy
        else:
            logical = scratch2(scratch_bytes(record.chunk_bytes))[:length]
            source.read_logical(record, c, logical, scratch(scratch_bytes(record.chunk_bytes)))
        itemsize, floating = elements[item.record]
        if not encoding.digests:
            stored_codec, data = encoding.encode(codec, logical, itemsize)
            return _write(item, data, stored_codec)
        mine = logical_digest(logical)
        against = delta.chunk(record, c) if delta is not None else None
        if against is None:
            stored_codec, data = encoding.encode(codec, logical, itemsize)
            return _write(item, data, stored_codec, kept=None if delta is not None else mine)
        assert delta is not None
        b, bc = against
        base = BaseChunk(b.chunk_file(c), bc.offset, bc.stored, bc.checksum, b.chunk_codec(c))
        if bc.digest == mine:
            encoding.account_reference(length)
            return Written(0, checksum(_EMPTY), "ref", base)  # nothing written: the base's bytes are these
        if floating and itemsize >= 2 and encoding.try_xor(record.key):
            against_bytes = delta.read(b, c, length)
            started = time.perf_counter()
            # Against what the chunk would take whole: its base chunk's stored size, on this tier.
            frame = delta.codec.encode(logical, against_bytes, itemsize, ceiling=bc.stored)
            encoding.account_encoding(length, time.perf_counter() - started)
            encoding.xor_tried(record.key, frame is not None)
            if frame is not None:
                encoding.account_delta(length, frame.nbytes)
                written = _write(item, frame, "delta")
                return written._replace(base=base)
        stored_codec, data = encoding.encode(codec, logical, itemsize)
        return _write(item, data, stored_codec)

    def _write(item: WriteItem, data: memoryview, codec: str, known: int | None = None, *, kept: bytes | None = None) -> Written:
        """``known``: the stored bytes' checksum, when the source has it; ``kept``: the logical digest a whole version keeps."""
        digest = checksum(data) if known is None else known  # hashed while the bytes are hot in cache
        writer.write(item, data)
        return Written(data.nbytes, digest, codec, digest=kept)

    # Writes only while this thread waits: once join() returns (or raises), no job runs, and the
    # writer may be closed.
    results = ChunkJobs([functools.partial(job, item) for item in plan.items], executor, threads).join()
    done = [r for r in results if r is not None]
    assert len(done) == len(plan.items)  # join() raises if any job failed: one result per item, in order
    return done
