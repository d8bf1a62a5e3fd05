"""The version source: read access to one stored version's bytes, whatever tier holds it.

Every flush and every restore reads a version through one. It describes a stored version (its
records, skeleton, metadata) and reads its chunks, so it belongs with the format, below the tiers that
implement it (:mod:`tierckpt.tiers`) and the restore that reads it (:mod:`tierckpt.restore`).
"""

from __future__ import annotations

import abc
from typing import Any

from tierckpt.codecs import decoder
from tierckpt.format.records import TensorRecord

__all__ = ["VersionSource"]


class VersionSource(abc.ABC):
    """Read access to one version's bytes, for a flusher writing it further down or a restore.

    ``read_stored`` and ``read_logical`` block and are called from worker threads, concurrently for
    different chunks. ``close`` is called once by whoever opened the source.
    """

    tier: str | None  # None for a directory read outside any configured tier (the CLI, an export)
    step: int
    created: float
    skeleton: Any
    metadata: dict[str, Any]
    records: tuple[TensorRecord, ...]

    @abc.abstractmethod
    def read_stored(self, record: TensorRecord, chunk: int, scratch: memoryview) -> memoryview:
        """Chunk ``chunk`` of ``record`` as stored (encoded), verified against its checksum if it has one.

        May return a view of ``scratch`` (large enough for one stored chunk) or of memory the source owns.
        """

    def checksum_of(self, record: TensorRecord, chunk: int) -> int | None:
        """The verified checksum of a stored chunk, when the source has one (saves hashing it again)."""
        value = record.chunk(chunk).checksum
        return value if value >= 0 else None

    def read_logical(self, record: TensorRecord, chunk: int, out: memoryview, scratch: memoryview, *, private: bool = True) -> None:
        """Decode chunk ``chunk`` of ``record`` into ``out`` (exactly its logical length), verified.

        ``private``: ``out`` is memory nobody else sees yet (a new array, staging), where a chunk may
        land before it verified; else (a template's own memory) a chunk is verified before a byte of
        it lands. Both raise the same error for a damaged chunk.
        """
        decoder(record.chunk_codec(chunk)).decode_into(self.read_stored(record, chunk, scratch), out)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files or leases the source holds."""
