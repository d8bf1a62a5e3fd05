"""Writing one version's data file from a :class:`VersionSource` (blocking; runs in tier threads).

Chunks are the unit of work: each writer thread reads a chunk from the source (a zero-copy view of a
host slot, or, promoting from a faster filesystem tier, an O_DIRECT read into the thread's aligned
scratch, verified there), re-encodes it only when the codecs differ, hashes the stored bytes while
they are hot in cache (or reuses the checksum just verified, when the codecs match), and writes them
with ``pwritev``. Uncompressed records keep the slot's 4 KiB-aligned layout, so host slot bytes and
scratch bytes go to disk with O_DIRECT as they are; compressed chunks are packed back to back. The
file is allocated in one piece first and fsynced once at the end.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from pathlib import Path

from tierckpt._buffers import align_up
from tierckpt.codecs import Codec, decoder
from tierckpt.format import ALIGN, Chunk, TensorRecord, checksum
from tierckpt.tiers.base import VersionSource
from tierckpt.tiers.fsio import O_DIRECT, ChunkJobs, preallocate, pwrite_all, scratch, scratch2

def scratch_bytes(chunk_bytes: int) -> int:
    """Room for one stored chunk: zstd's worst case grows a chunk by well under 1%."""
    return align_up(chunk_bytes + chunk_bytes // 64 + (1 << 16))


def write_data_file(
    source: VersionSource,
    path: Path,
    codec: Codec,
    executor: concurrent.futures.Executor,
    *,
    direct: bool,
    threads: int = 2,
) -> tuple[TensorRecord, ...]:
    """Write every record of ``source`` into ``path`` and fsync it; returns the stored records.

    ``threads`` of ``executor`` and the calling thread write the chunks (see :class:`ChunkJobs`).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    direct_fd = None
    try:
        if direct and codec.name == "none":
            direct_fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | O_DIRECT)
        raw_offsets = []
        end = 0
        for record in source.records:
            raw_offsets.append(end)
            end += align_up(record.nbytes, ALIGN)
        # Raw records keep the slot's layout, [0, end); encoded chunks are packed after it, or from 0
        # when no record is stored raw (a compressed file would otherwise start with a hole).
        packed = _Packer(start=end if codec.name == "none" else 0)
        if codec.name == "none":
            preallocate(fd, end)

        def job(ri: int, c: int) -> Chunk:
            record = source.records[ri]
            start, length = record.chunk_span(c)
            stored = source.read_stored(record, c, scratch(scratch_bytes(record.chunk_bytes)))
            if record.codec == codec.name:
                data, digest = stored, source.checksum_of(record, c)
            else:
                if record.codec == "none":
                    logical = stored  # already the logical bytes: no copy before encoding
                else:
                    logical = scratch2(scratch_bytes(record.chunk_bytes))[:length]
                    decoder(record.codec).decode_into(stored, logical)
                data, digest = memoryview(codec.encode(logical)), None
            if digest is None:
                digest = checksum(data)
            if codec.name == "none" and record.chunk_bytes % ALIGN == 0:
                offset = raw_offsets[ri] + start
                pwrite_all(data, offset, fd, direct_fd)
            else:
                # Packed chunks go through the page cache: O_DIRECT would pad an unaligned tail to a
                # full page of zeros, over the head of the next packed chunk (maybe already written).
                offset = packed.reserve(data.nbytes)
                pwrite_all(data, offset, fd, None)
            return Chunk(offset, data.nbytes, digest)

        keys = [(ri, c) for ri, record in enumerate(source.records) for c in range(len(record.chunks))]
        # Writes only while this thread waits: once join() returns (or raises), no job runs, and
        # the file may be closed.
        results = ChunkJobs([functools.partial(job, ri, c) for ri, c in keys], executor, threads).join()
        chunks = dict(zip(keys, results))
        os.fsync(fd)
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
            codec=codec.name,
            chunk_bytes=r.chunk_bytes,
            chunks=tuple(chunks[(ri, c)] for c in range(len(r.chunks))),
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
