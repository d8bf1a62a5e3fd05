"""One committed version's objects in a byte store, and the source that reads its chunks there.

A :class:`StoreVersion` is a container of any :class:`~tierckpt.storage.store.ReadableStore` (a
version directory, an object store's container): the readers of :mod:`tierckpt.tiers.stored.read`
take one, so that one reading path (manifest checks, records checked against the objects, every chunk
verified) serves every store. It turns what the store refuses into a damaged copy naming the tier,
the step and the object, and opens a :class:`StoredSource` over the store's ranged readers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from tierckpt._buffers import copy_pieces
from tierckpt.codecs import decoder
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import BaseChunk, Manifest, TensorRecord, checksum, version_dirname
from tierckpt.format.checksum import checksum_pieces
from tierckpt.format.layout import after_where, where
from tierckpt.format.manifest import MAX_MANIFEST_BYTES
from tierckpt.storage.store import RangeReader, ReadableStore, TooLarge, Unreadable
from tierckpt.tiers.base import VersionSource
from tierckpt.storage.scratch import scratch2, scratch_bytes
from tierckpt.tiers.stored.check import check_records
from tierckpt.xordelta import DeltaCodec

_DELTA = DeltaCodec()  # decoding only: its level and min_ratio do not matter there

__all__ = ["StoreVersion", "StoredSource"]


class StoreVersion:
    """Container ``container`` of ``store``: one committed version's objects (blocking reads).

    ``sizes``: the container's objects by name, when a listing gave them (an object store's). A name
    it lacks is then missing without a request: a name a manifest makes up reads nothing outside the
    container.
    """

    def __init__(self, store: ReadableStore, container: str, sizes: Mapping[str, int] | None = None) -> None:
        self.store, self.container = store, container
        self.sizes = dict(sizes) if sizes is not None else None

    def _damaged(self, exc: OSError, name: str, label: str, *, tier: str | None, step: int | None) -> CorruptCheckpointError:
        """What the store said of object ``name`` (``label`` names it in the message), or of the
        container, as a damaged copy."""
        key = f"{self.container}/{name}"
        if exc.filename == self.container:  # the container itself was refused or is not there
            label, key = f"the version directory {self.container}", self.container
        if isinstance(exc, TooLarge):  # only manifests are read whole
            text = f"{label}: {exc.size} bytes, more than the {exc.limit} a manifest may have"
        elif isinstance(exc, FileNotFoundError):
            url = self.store.url_of(key)
            text = f"{label} is missing" + (f" ({url})" if url else "")
        elif isinstance(exc, Unreadable):
            text = f"{label} {exc.why}"
        else:
            text = f"{label} cannot be read ({exc.strerror or exc})"
        return CorruptCheckpointError(f"{where(tier, step)}: {text}", tier=tier, step=step)

    def _listed(self, name: str) -> int | None:
        """Object ``name``'s size from the listing (None: no listing); FileNotFoundError when the
        listing lacks it, without a request."""
        if self.sizes is None:
            return None
        if name not in self.sizes:
            raise FileNotFoundError(name)
        return self.sizes[name]

    def read_small(self, name: str, *, tier: str | None, step: int | None) -> bytes:
        """A manifest-sized object, whole: CorruptCheckpointError naming ``name`` when it is missing,
        larger than MAX_MANIFEST_BYTES (refused before it is read) or unreadable."""
        try:
            size = self._listed(name)
            if size is not None and size > MAX_MANIFEST_BYTES:
                raise TooLarge(size, MAX_MANIFEST_BYTES)
            return self.store.read_small(f"{self.container}/{name}", MAX_MANIFEST_BYTES)
        except OSError as exc:
            raise self._damaged(exc, name, name, tier=tier, step=step) from exc

    def open_source(
        self, tier: str | None, manifest: Manifest, *, direct: bool, every_chunk: bool = True, base: StoreVersion | None = None
    ) -> StoredSource:
        """The data objects ``manifest`` names, opened and checked against its records (blocking).

        ``direct``: bypass the page cache where the store can. ``every_chunk``: every chunk of the
        records will be read (a restore reads only the chunks it needs otherwise): an object store
        then reads each object in a few large windows. ``base``: where a differential version's
        base is (found by :func:`~tierckpt.tiers.stored.read.find_base`); None: its step beside this one.
        """
        step = manifest.step
        spans: dict[str, list[tuple[int, int]]] = {}
        base_spans: dict[str, list[tuple[int, int]]] = {}
        for r in manifest.records:
            for i, c in enumerate(r.chunks):
                if c is None:
                    continue
                if c.stored:
                    spans.setdefault(r.chunk_file(i), []).append((c.offset, c.stored))
                if c.base is not None:
                    base_spans.setdefault(c.base.file, []).append((c.base.offset, c.base.stored))
        source = StoredSource(tier, manifest)
        try:
            for name in sorted(spans):
                source.readers[name] = self._reader(name, spans[name], tier=tier, step=step, every_chunk=every_chunk, direct=direct)
            check_records(manifest.records, {n: r.size for n, r in source.readers.items()}, tier=tier, step=step)
            if base_spans:
                if manifest.base is None:
                    raise CorruptCheckpointError(f"{where(tier, step)}: chunks stored against a base, in a version that names none", tier=tier, step=step)
                base = base or self.base_of(manifest)
                source.base_step = manifest.base[0]
                for name in sorted(base_spans):
                    try:
                        reader = base._reader(name, base_spans[name], tier=tier, step=step, every_chunk=every_chunk, direct=direct)
                    except CorruptCheckpointError as exc:
                        raise CorruptCheckpointError(f"{where(tier, step)}: its base, step {manifest.base[0]}: {after_where(exc, tier, step)}", tier=tier, step=step) from exc
                    source.base_readers[name] = reader
                    end = max(offset + stored for offset, stored in base_spans[name])
                    if end > reader.size:
                        raise CorruptCheckpointError(
                            f"{where(tier, step)}: its base, step {manifest.base[0]}: {name} holds {reader.size} bytes, and a chunk "
                            f"stored against it lies at up to {end}: not the base this version was written against",
                            tier=tier,
                            step=step,
                        )
        except BaseException:
            source.close()
            raise
        return source

    def base_of(self, manifest: Manifest) -> StoreVersion:
        """The container of ``manifest``'s base version, beside this one in the same store."""
        assert manifest.base is not None
        return StoreVersion(self.store, version_dirname(manifest.base[0]))

    def _reader(self, name: str, spans: list[tuple[int, int]], *, tier: str | None, step: int, every_chunk: bool, direct: bool) -> RangeReader:
        try:
            return self.store.open_reader(f"{self.container}/{name}", size=self._listed(name), spans=spans, every_chunk=every_chunk, direct=direct)
        except OSError as exc:
            raise self._damaged(exc, name, f"data {self.store.noun} {name}", tier=tier, step=step) from exc


class StoredSource(VersionSource):
    """A committed version's data objects, open for reading through a store's readers (by file name,
    opened by :meth:`StoreVersion.open_source`); verifies every chunk it returns.

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
        self.readers: dict[str, RangeReader] = {}
        # A differential version: its base's step, and readers of the base's data objects that hold
        # the chunks this version's are stored against (by file name).
        self.base_step: int | None = None
        self.base_readers: dict[str, RangeReader] = {}

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

    def read_base_stored(self, record: TensorRecord, chunk: int, scratch: memoryview) -> memoryview:
        """The base chunk that chunk ``chunk`` is stored against, as the base stores it (in its codec,
        ``record.chunk(chunk).base.codec``), verified; a view of ``scratch``."""
        with self._reading_base(record, chunk) as (what, b):
            stored = self.base_readers[b.file].read_span(b.offset, b.stored, scratch, what=what)
            if checksum(stored) != b.checksum:
                raise CorruptCheckpointError(f"{what}: checksum mismatch at bytes {b.offset}..{b.offset + b.stored}")
        return stored

    @contextmanager
    def _reading_base(self, record: TensorRecord, chunk: int) -> Iterator[tuple[str, BaseChunk]]:
        """Around a read of the base chunk under chunk ``chunk`` (given what names it, and where it is):
        its failures as a damaged chunk of this version's, naming the base."""
        b = record.chunk(chunk).base
        assert b is not None
        what = f"{where(self.tier, self.step)}: its base, step {self.base_step}: {b.file}: {record.key} chunk {chunk}"
        try:
            yield what, b
        except CorruptCheckpointError as exc:
            raise self._corrupt(record, str(exc) if str(exc).startswith(what) else f"{what}: {exc}") from None
        except OSError as exc:
            raise self._corrupt(record, f"{what}: read failed ({exc.strerror or exc})") from exc

    def _read_base(self, record: TensorRecord, chunk: int, out: memoryview, scratch: memoryview) -> None:
        """The logical bytes of the base chunk that chunk ``chunk`` is stored against, into ``out``, verified."""
        stored = self.read_base_stored(record, chunk, scratch)
        with self._reading_base(record, chunk) as (_, b):
            decoder(b.codec).decode_into(stored, out)

    def _read_against_base(self, record: TensorRecord, chunk: int, out: memoryview, scratch: memoryview) -> None:
        """A chunk stored against its base (``ref``, ``delta``), decoded into ``out``."""
        self._read_base(record, chunk, out, scratch)
        if record.chunk_codec(chunk) == "ref":
            return
        frame = self.read_stored(record, chunk, scratch)
        try:
            _DELTA.apply(frame, out)
        except CorruptCheckpointError as exc:
            raise self._corrupt(record, f"{self._where(record, chunk)} does not decode ({exc})") from exc

    def read_logical(self, record: TensorRecord, chunk: int, out: memoryview, scratch: memoryview, *, private: bool = True) -> None:
        c = record.chunk(chunk)
        codec = record.chunk_codec(chunk)
        if c.base is not None:
            if private:
                self._read_against_base(record, chunk, out, scratch)
            else:  # into a template: the whole chunk verified before a byte lands
                whole = scratch2(scratch_bytes(record.chunk_bytes))[: out.nbytes]
                self._read_against_base(record, chunk, whole, scratch)
                copy_pieces(out, [whole])
            return
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
        readers, self.readers = list(self.readers.values()) + list(self.base_readers.values()), {}
        self.base_readers = {}
        for reader in readers:
            reader.close()
