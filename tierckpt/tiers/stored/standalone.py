"""A differential version's part made to stand alone, for a copy sent where its base is not.

A node-local part fetched by a rank on another node (:mod:`tierckpt.tiers.nodelocal.fetch`) lands in a
one-process version of its own, with no base beside it. :func:`standalone` gives that copy every
chunk stored against the base in a form that needs none:

- a reference (``ref``): the base chunk's bytes as the base stores them (its codec, its checksum),
  so a frozen value costs what it costs in the base;
- an XOR frame (``delta``): the chunk's decoded bytes, raw (``none``). Encoding them again would cost
  the serving rank a compression per chunk on the restore's path, for a transfer that happens only
  when a job comes back with its ranks on other nodes.

Every byte is verified as it is read (the base's chunks and the frames alike), as any stored read is.
"""

from __future__ import annotations

import dataclasses

from tierckpt.format import Chunk, TensorRecord
from tierckpt.format.source import VersionSource
from tierckpt.storage.scratch import scratch2, scratch_bytes
from tierckpt.tiers.stored.source import StoredSource

__all__ = ["standalone"]


def standalone(source: StoredSource) -> VersionSource:
    """``source`` itself when no chunk of it is stored against a base, else a source of the same
    state whose records name no base (see the module docstring). Closing it closes ``source``."""
    if source.base_step is None:
        return source
    return _Standalone(source)


def _unbased(record: TensorRecord) -> TensorRecord:
    chunks: list[Chunk | None] = []
    for i, c in enumerate(record.chunks):
        if c is None or c.base is None:
            chunks.append(c)
        elif record.chunk_codec(i) == "ref":
            chunks.append(Chunk(c.offset, c.base.stored, c.base.checksum, codec=c.base.codec, file=c.file))
        else:
            chunks.append(Chunk(c.offset, record.chunk_span(i)[1], -1, codec="none", file=c.file))
    return dataclasses.replace(record, chunks=tuple(chunks))


class _Standalone(VersionSource):
    def __init__(self, source: StoredSource) -> None:
        self._source = source
        self.tier, self.step, self.created = source.tier, source.step, source.created
        self.skeleton, self.metadata = source.skeleton, source.metadata
        self.records = tuple(_unbased(r) for r in source.records)
        self._as_stored = {r.index: r for r in source.records}

    def read_stored(self, record: TensorRecord, chunk: int, scratch: memoryview) -> memoryview:
        stored = self._as_stored[record.index]
        c = stored.chunk(chunk)
        if c.base is None:
            return self._source.read_stored(stored, chunk, scratch)
        if stored.chunk_codec(chunk) == "ref":
            return self._source.read_base_stored(stored, chunk, scratch)
        out = scratch[: record.chunk(chunk).stored]
        # Decoded into the caller's scratch, the base chunk and the frame read through this thread's second one.
        self._source.read_logical(stored, chunk, out, scratch2(scratch_bytes(stored.chunk_bytes)))
        return out

    def close(self) -> None:
        self._source.close()
