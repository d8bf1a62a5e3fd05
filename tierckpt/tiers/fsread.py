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
- every record has a dtype, a shape and chunks that the data files back (:func:`check_records`, in
  :mod:`tierckpt.tiers.fscheck`), so what restore allocates is backed by bytes on disk.

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
import os
import stat
from pathlib import Path
from typing import Mapping, cast

from tierckpt.errors import CorruptCheckpointError, LayoutError
from tierckpt.format import MANIFEST_FILE, CommitMarker, Manifest, TensorRecord, checksum, decode_document
from tierckpt.format.layout import where
from tierckpt.format.manifest import MAX_MANIFEST_BYTES
from tierckpt.state import skeleton_leaf_count
from tierckpt.storage.local import LocalReader
from tierckpt.tiers.fscheck import MAX_CHUNK_BYTES, ZSTD_MAX_EXPANSION, check_records
from tierckpt.tiers.versionfiles import StoredSource, VersionFiles
from tierckpt.storage.posix import O_DIRECT

# MAX_CHUNK_BYTES, ZSTD_MAX_EXPANSION and check_records live in fscheck; imported from here too.
__all__ = [
    "MAX_CHUNK_BYTES", "ZSTD_MAX_EXPANSION", "FilesystemSource", "LocalVersion", "VersionFiles", "check_records",
    "open_source", "read_head", "read_manifest", "read_rank_manifest", "resolve_shared", "version_files",
]


class LocalVersion:
    """A version directory on a file system (see the module docstring for what a read refuses)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read_small(self, name: str, *, tier: str | None, step: int | None) -> bytes:
        return _read_small(self.path, name, tier=tier, step=step)

    def open_source(self, tier: str | None, manifest: Manifest, *, direct: bool, every_chunk: bool = True) -> StoredSource:
        return FilesystemSource(tier, self.path, manifest, direct=direct)


def version_files(where: Path | VersionFiles) -> VersionFiles:
    """``where`` as :class:`VersionFiles` (a path: its directory)."""
    return LocalVersion(where) if isinstance(where, Path) else where


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


def read_manifest(path: Path | VersionFiles, *, tier: str | None, step: int | None, rank: int = 0, world: int | None = None) -> Manifest:
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


def read_head(path: Path | VersionFiles, *, tier: str | None, step: int | None) -> Manifest | CommitMarker:
    """``manifest.msgpack`` of the version directory ``path``: a manifest, or several ranks' commit marker."""
    return decode_document(version_files(path).read_small(MANIFEST_FILE, tier=tier, step=step), tier=tier, step=step)


def read_rank_manifest(path: Path | VersionFiles, marker: CommitMarker, rank: int, *, tier: str | None) -> Manifest:
    """Rank ``rank``'s manifest of a version several ranks saved, checked against its commit marker."""
    step = marker.step
    name, digest, _ = marker.ranks[rank]
    data = version_files(path).read_small(name, tier=tier, step=step)
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
    path: Path | VersionFiles, marker: CommitMarker, manifest: Manifest, *, tier: str | None, manifests: Mapping[int, Manifest] | None = None
) -> Manifest:
    """``manifest`` with each chunk another rank stored filled in from that rank's manifest (blocking).

    ``manifests``: rank manifests already read (and checked), by rank; others are read here.

    Raises CorruptCheckpointError when the owner's manifest does not verify or does not hold the same
    value (key, dtype, shape, chunking) with that chunk.
    """
    step = manifest.step
    needed: set[int] = set()
    for r in manifest.records:
        for q in {r.owner(i) for i, c in enumerate(r.chunks) if c is None}:
            if q is None or not 0 <= q < marker.world_size or q == manifest.rank:
                raise CorruptCheckpointError(f"{where(tier, step)}: a shared chunk names rank {q}", tier=tier, step=step)
            needed.add(q)
    if not needed:
        return manifest
    theirs: dict[int, dict[str, TensorRecord]] = {}
    for q in sorted(needed):
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
            q = cast(int, r.owner(i))  # checked above: a rank of the version, not this one
            other = theirs[q].get(r.key)
            theirs_i = other.chunks[i] if other is not None else None
            same = other is not None and (other.kind, other.dtype, other.shape, other.nbytes, other.chunk_bytes, other.shared) == (
                r.kind, r.dtype, r.shape, r.nbytes, r.chunk_bytes, r.shared
            )
            if other is None or theirs_i is None or not same:
                raise CorruptCheckpointError(
                    f"{where(tier, step)}: {r.key} chunk {i} should be in rank {q}'s {marker.ranks[q][0]}, which does not hold it",
                    tier=tier,
                    step=step,
                    key=r.key,
                )
            chunks[i] = dataclasses.replace(theirs_i, file=other.file)
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


class FilesystemSource(StoredSource):
    """A committed version's files in the directory ``path``, opened for reading.

    Opening checks the records against the files (:func:`check_records`): a source that opened reads
    only inside its files and into what they back. With ``direct``, every file is also opened with
    O_DIRECT and bulk reads bypass the page cache: chunks land straight in page-aligned destinations,
    and a promotion to a slower tier reads into the writer thread's aligned scratch, which the next
    tier then writes with O_DIRECT as it is.
    """

    def __init__(self, tier: str | None, path: Path, manifest: Manifest, *, direct: bool = False) -> None:
        super().__init__(tier, manifest)
        try:
            dir_fd = open_version(path, tier=tier, step=self.step)
            try:
                sizes = {}
                files = {r.chunk_file(i) for r in manifest.records for i, c in enumerate(r.chunks) if c is not None}
                for name in sorted(files):
                    fd, sizes[name] = open_file(dir_fd, name, tier=tier, step=self.step)
                    self.readers[name] = reader = LocalReader(fd, sizes[name])
                    if direct:
                        try:
                            reader.direct_fd = _open_at(dir_fd, name, O_DIRECT)[0]
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


def open_source(tier: str | None, path: Path | VersionFiles, manifest: Manifest, *, direct: bool = False) -> StoredSource:
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
    return version_files(path).open_source(tier, manifest, direct=direct)
