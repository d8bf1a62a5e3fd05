"""Reading a filesystem tier's versions: nothing a manifest says may lead a read out of the version
directory, or into an allocation that the files on disk do not back.

A manifest is untrusted even once its own checksum matches (another tool, a tampered file, a bug).
Before a byte of tensor data is allocated or read (:class:`FilesystemSource`, :func:`read_manifest`):

- the version directory and every file in it are opened without following symlinks (``O_NOFOLLOW``,
  files relative to the directory's descriptor) and must be a directory and regular files: a symlink
  is refused, never followed; a FIFO or a device is refused without blocking on it;
- data file names are plain names (:meth:`Manifest.decode` refuses ``..``, ``/``, absolute paths, NUL);
- the manifest file is at most :data:`~tierckpt.format.manifest.MAX_MANIFEST_BYTES`, checked on its
  size before it is read;
- every record (:func:`check_records`) has a dtype this release can create and a known codec, a shape
  whose element count times the item size is its logical length and whose strides fit 64 bits, and
  chunks of at most :data:`MAX_CHUNK_BYTES`; every chunk lies inside its data file, no two chunks
  overlap, a raw chunk's stored length is its logical length, and a compressed chunk's logical length
  is at most what zstd can expand its stored bytes into (:data:`ZSTD_MAX_EXPANSION`). So what restore
  allocates is backed by bytes on disk: the data file's size for raw versions, at most
  ``ZSTD_MAX_EXPANSION`` times it for compressed ones (a tensor of zeros legitimately compresses that
  far; only decoding could tell it from a bomb, and decoding fails on the first frame that lies).

Every failure is a :class:`CorruptCheckpointError` naming tier, step, the file and (for a record) its
key, so restore warns and moves on to the next candidate. Bytes no chunk covers (the zero padding
between 4 KiB-aligned tensors of an uncompressed version, a file's tail past its last chunk) are not
data: nothing reads them, so damage there changes nothing restored and is not reported.

A version several ranks saved (format v3) is read per rank: ``manifest.msgpack`` is the commit marker,
and rank r's manifest must match the checksum the marker records for it (:func:`read_manifest`). The
chunks of a shared record that other ranks stored are found in their manifests
(:func:`resolve_shared`) and read from their data files.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import stat
from pathlib import Path
from typing import Mapping, Sequence

from tierckpt.errors import CorruptCheckpointError, LayoutError
from tierckpt.format import CHUNK_BYTES, MANIFEST_FILE, CommitMarker, Manifest, TensorRecord, checksum, decode_document
from tierckpt.format.saved_layout import SavedLayout, home_rank
from tierckpt.format.manifest import MAX_MANIFEST_BYTES, where
from tierckpt.state import numpy_dtype, skeleton_leaf_count, torch_dtype
from tierckpt.tiers.base import VersionSource
from tierckpt.tiers.fsio import O_DIRECT, read_into, read_span
from tierckpt.tiers.fswrite import scratch_bytes

__all__ = [
    "MAX_CHUNK_BYTES", "ZSTD_MAX_EXPANSION", "FilesystemSource", "check_records", "open_source", "read_head",
    "read_manifest", "read_rank_manifest", "resolve_shared",
]

# Readers keep a scratch buffer of one stored chunk per thread; every writer uses CHUNK_BYTES.
MAX_CHUNK_BYTES = 4 * CHUNK_BYTES
# A zstd block decodes to at most 128 KiB and takes at least 4 stored bytes (3 of header and the byte
# of an RLE block); a byte-shuffle frame is zstd frames and raw planes. Nothing stored expands further.
ZSTD_MAX_EXPANSION = (128 << 10) // 4
_MAX_OFFSET = 2**63 - 1  # off_t, and torch's and numpy's strides
_NUMPY_MAX_DIMS = 64


def _open_at(dir_fd: int | None, name: str | Path, flags: int) -> tuple[int, os.stat_result]:
    """Open without following a symlink in the last component, and without blocking on a FIFO."""
    fd = os.open(name, flags | os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _refused(exc: OSError, what: str) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"{what} is missing"
    if exc.errno in (errno.ELOOP, errno.EMLINK):  # what O_NOFOLLOW gives for a symlink
        return f"{what} is a symlink (refused: it could lead out of the version directory)"
    if exc.errno == errno.ENOTDIR:
        return f"{what} is not a directory"
    return f"{what} cannot be opened ({exc.strerror or exc})"


def open_version(path: Path, *, tier: str | None, step: int | None) -> int:
    """A descriptor of the version directory ``path`` (a real directory, not a symlink to one)."""
    try:
        fd, _ = _open_at(None, path, os.O_DIRECTORY)
    except OSError as exc:
        if exc.errno == errno.ENOTDIR and os.path.islink(path):  # O_DIRECTORY | O_NOFOLLOW on a symlink
            exc = OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        raise CorruptCheckpointError(
            f"{where(tier, step)}: {_refused(exc, f'the version directory {path.name}')}", tier=tier, step=step
        ) from exc
    return fd


def open_file(dir_fd: int, name: str, *, tier: str | None, step: int | None, label: str | None = None) -> tuple[int, int]:
    """Open ``name`` in the version directory ``dir_fd``: a regular file. Returns (fd, size).

    ``label`` names it in messages (default ``"data file <name>"``).
    """
    label = label or f"data file {name}"
    try:
        fd, st = _open_at(dir_fd, name, 0)
    except OSError as exc:
        raise CorruptCheckpointError(f"{where(tier, step)}: {_refused(exc, label)}", tier=tier, step=step) from exc
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{where(tier, step)}: {label} is not a regular file", tier=tier, step=step)
    return fd, st.st_size


def read_manifest(path: Path, *, tier: str | None, step: int | None, rank: int = 0, world: int | None = None) -> Manifest:
    """Read and decode rank ``rank``'s manifest of the version directory ``path`` (blocking).

    ``world``: the number of ranks reading the version; None takes whatever saved it.

    Raises:
        CorruptCheckpointError: see the module docstring.
        LayoutError: the version was saved by another number of ranks than ``world``.
    """
    head = read_head(path, tier=tier, step=step)
    saved = head.world_size
    if world is not None and saved != world:
        raise LayoutError(
            f"{where(tier, step)} was saved by {saved} rank(s), and this job has {world}: "
            "no rank part is this rank's as it is (a restore reads the saved layout instead)",
            tier=tier,
            step=step,
        )
    if isinstance(head, Manifest):
        return head
    return read_rank_manifest(path, head, rank, tier=tier)


def read_head(path: Path, *, tier: str | None, step: int | None) -> Manifest | CommitMarker:
    """``manifest.msgpack`` of the version directory ``path``: a manifest, or several ranks' commit marker."""
    return decode_document(_read_small(path, MANIFEST_FILE, tier=tier, step=step), tier=tier, step=step)


def read_rank_manifest(path: Path, marker: CommitMarker, rank: int, *, tier: str | None) -> Manifest:
    """Rank ``rank``'s manifest of a version several ranks saved, checked against its commit marker."""
    step = marker.step
    name, digest, _ = marker.ranks[rank]
    data = _read_small(path, name, tier=tier, step=step)
    if checksum(data) != digest:
        raise CorruptCheckpointError(
            f"{where(tier, step)}: {name} does not match the checksum its commit marker records (rank {rank})",
            tier=tier,
            step=step,
        )
    manifest = Manifest.decode(data, tier=tier, step=step, name=name)
    if (manifest.rank, manifest.world_size) != (rank, marker.world_size):
        raise CorruptCheckpointError(
            f"{where(tier, step)}: {name} is rank {manifest.rank} of {manifest.world_size}, "
            f"not rank {rank} of {marker.world_size}",
            tier=tier,
            step=step,
        )
    return manifest


def resolve_shared(
    path: Path, marker: CommitMarker, manifest: Manifest, *, tier: str | None, manifests: Mapping[int, Manifest] | None = None
) -> Manifest:
    """``manifest`` with each chunk another rank stored filled in from that rank's manifest (blocking).

    ``manifests``: rank manifests already read (and checked), by rank; others are read here.

    Raises CorruptCheckpointError when the owner's manifest does not verify or does not hold the same
    value (key, dtype, shape, chunking) with that chunk.
    """
    needed = sorted({r.owner(i) for r in manifest.records for i, c in enumerate(r.chunks) if c is None})
    if not needed:
        return manifest
    step = manifest.step
    theirs: dict[int, dict[str, TensorRecord]] = {}
    for q in needed:
        if q is None or not 0 <= q < marker.world_size or q == manifest.rank:
            raise CorruptCheckpointError(f"{where(tier, step)}: a shared chunk names rank {q}", tier=tier, step=step)
        known = manifests.get(q) if manifests is not None else None
        theirs[q] = {r.key: r for r in (known or read_rank_manifest(path, marker, q, tier=tier)).records}
    records = []
    for r in manifest.records:
        if all(c is not None for c in r.chunks):
            records.append(r)
            continue
        chunks = list(r.chunks)
        for i, c in enumerate(r.chunks):
            if c is not None:
                continue
            q = r.owner(i)
            other = theirs[q].get(r.key)
            same = other is not None and (other.kind, other.dtype, other.shape, other.nbytes, other.chunk_bytes, other.shared) == (
                r.kind, r.dtype, r.shape, r.nbytes, r.chunk_bytes, r.shared
            )
            if not same or other.chunks[i] is None:
                raise CorruptCheckpointError(
                    f"{where(tier, step)}: {r.key} chunk {i} should be in rank {q}'s {marker.ranks[q][0]}, which does not hold it",
                    tier=tier,
                    step=step,
                    key=r.key,
                )
            chunks[i] = dataclasses.replace(other.chunks[i], file=other.file)
        records.append(dataclasses.replace(r, chunks=tuple(chunks)))
    return dataclasses.replace(manifest, records=tuple(records))


def _read_small(path: Path, name: str, *, tier: str | None, step: int | None) -> bytes:
    """A manifest-sized file of the version directory ``path``, read whole (at most MAX_MANIFEST_BYTES + 1)."""
    dir_fd = open_version(path, tier=tier, step=step)
    try:
        fd, size = open_file(dir_fd, name, tier=tier, step=step, label=name)
    finally:
        os.close(dir_fd)
    try:
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{where(tier, step)}: {name}: {size} bytes, "
                f"more than the {MAX_MANIFEST_BYTES} a manifest may have",
                tier=tier,
                step=step,
            )
        parts = []
        left = MAX_MANIFEST_BYTES + 1  # a file growing while it is read is cut here, and refused by decode
        while left > 0:
            part = os.read(fd, min(left, 1 << 20))
            if not part:
                break
            parts.append(part)
            left -= len(part)
    except OSError as exc:
        raise CorruptCheckpointError(
            f"{where(tier, step)}: {name} cannot be read ({exc.strerror or exc})", tier=tier, step=step
        ) from exc
    finally:
        os.close(fd)
    return b"".join(parts)


def check_records(records: tuple[TensorRecord, ...], sizes: dict[str, int], *, tier: str | None, step: int | None) -> None:
    """Check that ``records`` can be allocated and read from data files of these ``sizes`` (by name).

    Raises:
        CorruptCheckpointError: see the module docstring for what is checked; names the file and key.
    """
    extents: dict[str, list[tuple[int, int, str, int]]] = {}
    for r in records:

        def bad(why: str) -> CorruptCheckpointError:
            text = f"{where(tier, step)}: {MANIFEST_FILE}: {r.key}: {why}"
            return CorruptCheckpointError(text, tier=tier, step=step, key=r.key)

        try:
            itemsize = torch_dtype(r.dtype).itemsize if r.kind == "torch" else numpy_dtype(r.dtype).itemsize
        except CorruptCheckpointError as exc:
            raise bad(str(exc)) from None
        if r.kind == "numpy" and len(r.shape) > _NUMPY_MAX_DIMS:
            raise bad(f"{len(r.shape)} dimensions (numpy has at most {_NUMPY_MAX_DIMS})")
        span = max(itemsize, 1)
        for d in r.shape:
            span *= max(d, 1)
            if span > _MAX_OFFSET:
                raise bad(f"shape {_dims(r.shape)} does not fit 64-bit strides")
        if math.prod(r.shape) * itemsize != r.nbytes:
            raise bad(f"{r.nbytes} bytes cannot hold {r.dtype}{_dims(r.shape)}")
        if r.chunk_bytes > MAX_CHUNK_BYTES:
            raise bad(f"chunks of {r.chunk_bytes} bytes, more than the {MAX_CHUNK_BYTES} a reader takes")
        for i, c in enumerate(r.chunks):
            if c is None:  # stored by another rank: checked when resolved, by that rank's files
                continue
            file = r.chunk_file(i)
            size = sizes[file]
            _, length = r.chunk_span(i)
            if r.chunk_codec(i) == "none":
                if c.stored != length:
                    raise bad(f"chunk {i} is stored raw in {c.stored} bytes, but holds {length}")
            elif not 0 < c.stored <= scratch_bytes(r.chunk_bytes) or length > c.stored * ZSTD_MAX_EXPANSION:
                raise bad(f"chunk {i} cannot decode {c.stored} stored bytes into {length}")
            if c.offset + c.stored > size:
                raise CorruptCheckpointError(
                    f"{where(tier, step)}: {file}: {r.key} chunk {i} (bytes {c.offset}..{c.offset + c.stored}) lies past "
                    f"the end of the file ({size} bytes): truncated?",
                    tier=tier,
                    step=step,
                    key=r.key,
                )
            if c.stored:
                extents.setdefault(file, []).append((c.offset, c.offset + c.stored, r.key, i))
    for name, spans in extents.items():
        spans.sort()
        for (_, end, key, i), (start, _, other, j) in zip(spans, spans[1:]):
            if start < end:
                raise CorruptCheckpointError(
                    f"{where(tier, step)}: {MANIFEST_FILE}: {key} chunk {i} and {other} chunk {j} overlap in {name}",
                    tier=tier,
                    step=step,
                    key=other,
                )


def _dims(shape: tuple[int, ...]) -> str:
    text = str(list(shape))
    return text if len(text) <= 80 else text[:77] + "..."


class FilesystemSource(VersionSource):
    """A committed version's files, opened for reading; verifies every chunk it returns.

    Opening checks the records against the files (:func:`check_records`): a source that opened reads
    only inside its files and into what they back. With ``direct``, every file is also opened with
    O_DIRECT and bulk reads bypass the page cache: chunks land straight in page-aligned destinations,
    and a promotion to a slower tier reads into the writer thread's aligned scratch, which the next
    tier then writes with O_DIRECT as it is. Each chunk is hashed right after its read, in the reading
    thread, while it is still in cache. Every error names the tier, the step, the file and the key.
    """

    def __init__(self, tier: str | None, path: Path, manifest: Manifest, *, direct: bool = False) -> None:
        self.tier = tier
        self.step = manifest.step
        self.created = manifest.created
        self.skeleton = manifest.skeleton
        self.metadata = manifest.metadata
        self.records = manifest.records
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int] = {}
        try:
            dir_fd = open_version(path, tier=tier, step=self.step)
            try:
                sizes = {}
                files = {r.chunk_file(i) for r in manifest.records for i, c in enumerate(r.chunks) if c is not None}
                for name in sorted(files):
                    self._fds[name], sizes[name] = open_file(dir_fd, name, tier=tier, step=self.step)
                    if direct:
                        try:
                            self._direct_fds[name] = _open_at(dir_fd, name, O_DIRECT)[0]
                        except OSError as exc:
                            if exc.errno != errno.EINVAL:  # refused after all: read through the page cache
                                text = f"{where(tier, self.step)}: {_refused(exc, f'data file {name}')}"
                                raise CorruptCheckpointError(text, tier=tier, step=self.step) from exc
            finally:
                os.close(dir_fd)
            check_records(manifest.records, sizes, tier=tier, step=self.step)
        except BaseException:
            self.close()
            raise

    def _where(self, record: TensorRecord, chunk: int) -> str:
        return f"{where(self.tier, self.step)}: {record.chunk_file(chunk)}: {record.key} chunk {chunk}"

    def _corrupt(self, record: TensorRecord, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(message, tier=self.tier, step=self.step, key=record.key)

    def _verify(self, record: TensorRecord, chunk: int, data: memoryview) -> None:
        c = record.chunk(chunk)
        if checksum(data) != c.checksum:
            raise self._corrupt(
                record,
                f"{where(self.tier, self.step)}: {record.chunk_file(chunk)}: checksum mismatch in {record.key} "
                f"(chunk {chunk}) at bytes {c.offset}..{c.offset + c.stored}",
            )

    @property
    def direct(self) -> bool:
        """Whether bulk reads bypass the page cache (O_DIRECT)."""
        return bool(self._direct_fds)

    def read_stored(self, record: TensorRecord, chunk: int, scratch: memoryview) -> memoryview:
        c = record.chunk(chunk)
        what = self._where(record, chunk)
        file = record.chunk_file(chunk)
        fd, direct_fd = self._fds[file], self._direct_fds.get(file)
        try:
            out = read_span(c.offset, c.stored, scratch, fd, direct_fd, what=what)
        except CorruptCheckpointError as exc:
            raise self._corrupt(record, str(exc)) from None
        except OSError as exc:  # a copy that cannot be read is as good as a damaged one: restore moves on
            raise self._corrupt(record, f"{what}: read failed ({exc.strerror or exc})") from exc
        self._verify(record, chunk, out)
        return out

    def read_logical(self, record: TensorRecord, chunk: int, out: memoryview, scratch: memoryview) -> None:
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
        # Raw chunks land straight in the destination (DMA when both are page-aligned), and are
        # hashed right away while they are in cache: no bounce buffer, no second pass later.
        what = self._where(record, chunk)
        file = record.chunk_file(chunk)
        fd, direct_fd = self._fds[file], self._direct_fds.get(file)
        try:
            read_into(out, c.offset, fd, direct_fd, scratch, what=what)
        except CorruptCheckpointError as exc:
            raise self._corrupt(record, str(exc)) from None
        except OSError as exc:
            raise self._corrupt(record, f"{what}: read failed ({exc.strerror or exc})") from exc
        self._verify(record, chunk, out)

    def close(self) -> None:
        fds = [*self._fds.values(), *self._direct_fds.values()]
        self._fds, self._direct_fds = {}, {}
        for fd in fds:
            os.close(fd)


def open_source(tier: str | None, path: Path, manifest: Manifest, *, direct: bool = False) -> FilesystemSource:
    """The version at ``path`` opened for a restore or a promotion (blocking).

    Checks the skeleton first (it must be well formed and refer to exactly the records): a manifest
    with a damaged skeleton is refused here, naming its file, rather than half-way through a load or
    copied on to the next tier.
    """
    try:
        leaves = skeleton_leaf_count(manifest.skeleton)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{where(tier, manifest.step)}: {MANIFEST_FILE}: {exc}", tier=tier, step=manifest.step, key=exc.key
        ) from None
    if leaves != len(manifest.records):
        raise CorruptCheckpointError(
            f"{where(tier, manifest.step)}: {MANIFEST_FILE}: the skeleton refers to {leaves} arrays, "
            f"the manifest records {len(manifest.records)}",
            tier=tier,
            step=manifest.step,
        )
    return FilesystemSource(tier, path, manifest, direct=direct)


def filesystem_layout(tier: str, path: Path, rank: int, *, direct: bool) -> SavedLayout:
    """The layout of the committed version at ``path`` of a filesystem tier (blocking).

    Raises CorruptCheckpointError when a manifest does not verify or the pieces do not add up.
    """
    head = read_head(path, tier=tier, step=None)
    step = head.step
    if isinstance(head, Manifest):
        parts: dict[int, Manifest] = {0: head}
    else:
        parts = {q: read_rank_manifest(path, head, q, tier=tier) for q in range(head.world_size)}
        parts = {q: resolve_shared(path, head, m, tier=tier, manifests=parts) for q, m in parts.items()}
    home = home_rank(rank, len(parts))

    def open_pieces(records: Sequence[TensorRecord], shared: bool) -> VersionSource:
        manifest = Manifest(step, head.created, parts[home].skeleton, tuple(records), head.metadata)
        return FilesystemSource(tier, path, manifest, direct=direct and not shared)

    return SavedLayout(
        tier=tier,
        step=step,
        created=head.created,
        metadata=dict(head.metadata),
        world=len(parts),
        parts=parts,
        home=home,
        complete=True,
        open=open_pieces,
    )
