"""Where one committed version's objects are read from, and the source that reads its chunks there:
the interface the readers of :mod:`tierckpt.tiers.fsread` take (:class:`VersionFiles`), so that one
reading path (manifest checks, records checked against the objects, every chunk verified) serves a
directory and an object store's container alike, and what both open (:class:`StoredSource`).

The two live together, below :mod:`~tierckpt.tiers.fsread` and :mod:`~tierckpt.tiers.objread`: a
:class:`VersionFiles` opens a :class:`StoredSource`, and each store's reader subclasses it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from tierckpt._buffers import copy_pieces
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import Manifest, TensorRecord, checksum
from tierckpt.format.checksum import checksum_pieces
from tierckpt.format.layout import where
from tierckpt.storage.store import ObjectReader
from tierckpt.tiers.base import VersionSource

__all__ = ["StoredSource", "VersionFiles"]


class VersionFiles(Protocol):
    """Where one committed version's objects are read from: a directory (:class:`~tierckpt.tiers.fsread.LocalVersion`), or a
    container of an object store (:class:`~tierckpt.tiers.objread.ObjectVersion`). Blocking."""

    def read_small(self, name: str, *, tier: str | None, step: int | None) -> bytes:
        """A manifest-sized object, whole (refused past MAX_MANIFEST_BYTES): CorruptCheckpointError
        naming ``name`` when it is missing, too large or unreadable."""

    def open_source(self, tier: str | None, manifest: Manifest, *, direct: bool, every_chunk: bool = True) -> StoredSource:
        """The data objects ``manifest`` names, opened and checked against its records.

        ``every_chunk``: every chunk of the records will be read (a restore reads only the chunks it
        needs otherwise): an object store may then read each object in a few large windows."""


class StoredSource(VersionSource):
    """A committed version's data objects, open for reading through a store's readers (by file name);
    verifies every chunk it returns. Store-neutral: how the objects were opened is the subclass's.

    Each chunk is hashed right after its read, in the reading thread, while it is still in cache.
    Every error names the tier, the step, the file and the key; a chunk that cannot be read is
    reported as damaged (restore moves on to the next candidate).
    """

    def __init__(self, tier: str | None, manifest: Manifest) -> None:
        self.tier = tier  # None: a version read outside any tier (the CLI)
        self.step = manifest.step
        self.created = manifest.created
        self.skeleton = manifest.skeleton
        self.metadata = manifest.metadata
        self.records = manifest.records
        self.readers: dict[str, ObjectReader] = {}

    def _where(self, record: TensorRecord, chunk: int) -> str:
        return f"{where(self.tier, self.step)}: {record.chunk_file(chunk)}: {record.key} chunk {chunk}"

    def _corrupt(self, record: TensorRecord, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(message, tier=self.tier, step=self.step, key=record.key)

    def _verify(self, record: TensorRecord, chunk: int, data: memoryview | Sequence[memoryview]) -> None:
        """``data``: the chunk's stored bytes, or their consecutive pieces."""
        c = record.chunk(chunk)
        if (checksum(data) if isinstance(data, memoryview) else checksum_pieces(data)) != c.checksum:
            raise self._corrupt(
                record,
                f"{where(self.tier, self.step)}: {record.chunk_file(chunk)}: checksum mismatch in {record.key} "
                f"(chunk {chunk}) at bytes {c.offset}..{c.offset + c.stored}",
            )

    @property
    def direct(self) -> bool:
        """Whether bulk reads bypass the page cache (O_DIRECT)."""
        return any(reader.direct for reader in self.readers.values())

    @contextmanager
    def _reading(self, record: TensorRecord, chunk: int) -> Iterator[str]:
        """Around a read of the chunk (given what names it): its failures as a damaged chunk's."""
        what = self._where(record, chunk)
        try:
            yield what
        except CorruptCheckpointError as exc:
            raise self._corrupt(record, str(exc)) from None
        except OSError as exc:  # a copy that cannot be read is as good as a damaged one: restore moves on
            raise self._corrupt(record, f"{what}: read failed ({exc.strerror or exc})") from exc

    def read_stored(self, record: TensorRecord, chunk: int, scratch: memoryview) -> memoryview:
        c = record.chunk(chunk)
        with self._reading(record, chunk) as what:
            out = self.readers[record.chunk_file(chunk)].read_span(c.offset, c.stored, scratch, what=what)
        self._verify(record, chunk, out)
        return out

    def read_logical(self, record: TensorRecord, chunk: int, out: memoryview, scratch: memoryview, *, private: bool = True) -> None:
        c = record.chunk(chunk)
        codec = record.chunk_codec(chunk)
        if codec != "none":
            try:
                super().read_logical(record, chunk, out, scratch)
            except CorruptCheckpointError as exc:
                if exc.key is not None:
                    raise
                raise self._corrupt(record, f"{self._where(record, chunk)} does not decode ({exc})") from exc
            return
        if c.stored != out.nbytes:
            raise self._corrupt(record, f"{self._where(record, chunk)} has the wrong length")
        reader = self.readers[record.chunk_file(chunk)]
        if not private:
            # Into memory others see (a template): read into this thread's reused buffer, verify it
            # there, then copy. A damaged chunk never lands; and O_DIRECT into a reused buffer runs
            # at up to twice the speed of reads into a large destination, while the copy out of it
            # runs at memory speed beside the next read. A chunk an object store fetched in two
            # GETs is hashed and copied piece by piece, never joined first.
            with self._reading(record, chunk) as what:
                pieces = reader.read_pieces(c.offset, c.stored, scratch, what=what)
            self._verify(record, chunk, pieces)
            copy_pieces(out, pieces)
            return
        # Into private memory (new arrays, staging): straight in (DMA when both are page-aligned),
        # hashed right away while in cache. Fresh pages fill faster by DMA than by a copy.
        with self._reading(record, chunk) as what:
            reader.read_into(out, c.offset, scratch, what=what)
        self._verify(record, chunk, out)

    def close(self) -> None:
        readers, self.readers = list(self.readers.values()), {}
        for reader in readers:
            reader.close()
