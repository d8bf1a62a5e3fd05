"""Writing one version's data file from a :class:`VersionSource` (blocking; runs in tier threads).

Chunks are the unit of work: each writer thread reads a chunk from the source (a zero-copy view of a
host slot, or, promoting from a faster filesystem tier, an O_DIRECT read into the thread's aligned
scratch, verified there), re-encodes it only when the record's codec differs from the one this tier
gives it (a chunk that does not compress by ``min_ratio`` is stored raw, and says so), hashes the
stored bytes while they are hot in cache (or reuses the checksum just verified, when the codecs
match), and writes them with ``pwritev``. An uncompressed version keeps the slot's 4 KiB-aligned
layout, so host slot bytes and scratch bytes go to disk with O_DIRECT as they are; the chunks of a
compressed version are packed back to back. The file is allocated in one piece first and fsynced once
at the end. An I/O error (a full disk, a quota, EIO) is raised naming the data file, and what it was
doing: the first one stops the chunks not yet started; the caller removes the file.

Of a record shared by several ranks (``save(replicated=...)``), a rank writes only the chunks it owns
(:meth:`TensorRecord.owner`); its record holds None for the others, which their owners write.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from pathlib import Path

from tierckpt._buffers import align_up
from tierckpt.codecs import decoder
from tierckpt.format import ALIGN, Chunk, TensorRecord, checksum
from tierckpt.tiers.base import VersionSource
from tierckpt.tiers.encoding import VersionEncoding, element
from tierckpt.tiers.fsio import O_DIRECT, ChunkJobs, preallocate, pwrite_all, raise_named, scratch, scratch2

def scratch_bytes(chunk_bytes: int) -> int:
    """Room for one stored chunk: zstd's worst case grows a chunk by well under 1%."""
    return align_up(chunk_bytes + chunk_bytes // 64 + (1 << 16))


def write_data_file(
    source: VersionSource,
    path: Path,
    encoding: VersionEncoding,
    executor: concurrent.futures.Executor,
    *,
    direct: bool,
    threads: int = 2,
    rank: int = 0,
) -> tuple[TensorRecord, ...]:
    """Write every record of ``source`` into ``path`` and fsync it; returns the stored records.

    ``threads`` of ``executor`` and the calling thread write the chunks (see :class:`ChunkJobs`);
    ``rank`` is the writing rank: of a shared record, only its own chunks are written.
    """
    owned = [[c for c in range(len(r.chunks)) if r.owner(c) in (None, rank)] for r in source.records]
    codecs = [encoding.codec_for(r) for r in source.records]
    itemsizes = [element(r)[0] for r in source.records]
    raw_layout = encoding.raw_layout
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    direct_fd = None
    try:
        if direct and raw_layout:
            direct_fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | O_DIRECT)
        # Where each owned chunk goes in the slot's layout: a record's owned chunks back to back.
        raw_offsets: dict[tuple[int, int], int] = {}
        end = 0
        for ri, record in enumerate(source.records):
            for k, c in enumerate(owned[ri]):
                raw_offsets[(ri, c)] = end + k * record.chunk_bytes
            end += align_up(sum(record.chunk_span(c)[1] for c in owned[ri]), ALIGN)
        # A raw version keeps the slot's layout, [0, end), and packs only chunks of unaligned size
        # after it; a compressed version packs every chunk from 0 (else the file would start with a hole).
        packed = _Packer(start=end if raw_layout else 0)
        if raw_layout:
            try:
                preallocate(fd, end)
            except OSError as exc:
                raise_named(exc, path, f"fallocate of {end} bytes")

        def job(ri: int, c: int) -> Chunk:
            record, codec = source.records[ri], codecs[ri]
            _, length = record.chunk_span(c)
            stored = source.read_stored(record, c, scratch(scratch_bytes(record.chunk_bytes)))
            stored_codec = record.chunk_codec(c)
            if record.codec == codec:
                # Same codec on both tiers: the chunk moves as stored, raw fallbacks included.
                data, digest = stored, source.checksum_of(record, c)
                encoding.account(length, data.nbytes, compressed=stored_codec != "none")
            else:
                if stored_codec == "none":
                    logical = stored  # already the logical bytes: no copy before encoding
                else:
                    logical = scratch2(scratch_bytes(record.chunk_bytes))[:length]
                    decoder(stored_codec).decode_into(stored, logical)
                stored_codec, data = encoding.encode(codec, logical, itemsizes[ri])
                digest = None
            if digest is None:
                digest = checksum(data)
            try:
                if raw_layout and record.chunk_bytes % ALIGN == 0:
                    offset = raw_offsets[(ri, c)]
                    pwrite_all(data, offset, fd, direct_fd)
                else:
                    # Packed chunks go through the page cache: O_DIRECT would pad an unaligned tail to a
                    # full page of zeros, over the head of the next packed chunk (maybe already written).
                    offset = packed.reserve(data.nbytes)
                    pwrite_all(data, offset, fd, None)
            except OSError as exc:
                raise_named(exc, path, f"write of {data.nbytes} bytes at offset {offset}")
            return Chunk(offset, data.nbytes, digest, stored_codec if stored_codec != codec else None)

        keys = [(ri, c) for ri in range(len(source.records)) for c in owned[ri]]
        # Writes only while this thread waits: once join() returns (or raises), no job runs, and
        # the file may be closed.
        results = ChunkJobs([functools.partial(job, ri, c) for ri, c in keys], executor, threads).join()
        chunks = dict(zip(keys, results))
        try:
            os.fsync(fd)
        except OSError as exc:
            raise_named(exc, path, "fsync")
    finally:
        if direct_fd is not None:
            os.close(direct_fd)
        os.close(fd)
    return tuple(
        TensorRecord(
            index=r.index,
            key=r.key,
            kind=r.kind,
            dtype=r.dtype,
            shape=r.shape,
            nbytes=r.nbytes,
            file=path.name,
            codec=codecs[ri],
            chunk_bytes=r.chunk_bytes,
            chunks=tuple(chunks.get((ri, c)) for c in range(len(r.chunks))),
            shared=r.shared,
            region=r.region,
        )
        for ri, r in enumerate(source.records)
    )


class _Packer:
    """Hands out back-to-back file offsets for chunks whose size is known only after encoding."""

    def __init__(self, start: int) -> None:
        self._end = start
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> int:
        with self._lock:
            offset = self._end
            self._end += nbytes
            return offset
