"""Reading a captured snapshot in place, from its host slot: what a flush writes down and what a
restore from host memory copies out."""

from __future__ import annotations

from tierckpt.capture.pool import HostPool
from tierckpt.format import CHUNK_BYTES, TensorRecord
from tierckpt.snapshot import Snapshot
from tierckpt.tiers.base import VersionSource
from tierckpt.tiers.memory.shm import slot_records


class MemorySource(VersionSource):
    """A captured snapshot's slot, read in place (no copy until a destination asks for one)."""

    def __init__(self, tier: str, snapshot: Snapshot, pool: HostPool) -> None:
        self.tier = tier
        self.step = snapshot.step
        self.created = snapshot.created
        self.skeleton = snapshot.skeleton
        self.metadata = snapshot.metadata
        self._snapshot = snapshot
        self._pool = pool
        self._position = {e.index: i for i, e in enumerate(snapshot.entries)}
        # No checksums to check: a snapshot captured here is immutable in this process's memory, and
        # one a previous process left was verified whole when it was opened (MemoryTier.read).
        self.records = slot_records(snapshot.entries, offset=0, checksums=None, file="", shared=True)

    def read_stored(self, record: TensorRecord, chunk: int, scratch: memoryview) -> memoryview:
        c = record.chunk(chunk)
        return self._pool.view(self._snapshot.slot, c.offset, c.stored)

    def checksum_of(self, record: TensorRecord, chunk: int) -> int | None:
        # A snapshot persisted here was hashed already: a filesystem tier below need not hash it again.
        sums = self._snapshot.checksums
        if sums is None or record.chunk_bytes != CHUNK_BYTES:  # a shared record's chunks are cut otherwise
            return None
        return sums[self._position[record.index]][chunk]
