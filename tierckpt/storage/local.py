"""The local file system as a byte store: a directory per version, O_DIRECT data files, renames.

Data objects are written the way :mod:`tierckpt.tiers.fsio` measured fastest here: the planned
extent reserved in one piece (fallocate), items at fixed 4 KiB-aligned offsets written with
O_DIRECT from the writer threads' aligned buffers as they are, packed items (known in size only once
encoded) through the page cache back to back, one ``fsync`` at the end. Small objects (manifests)
are created, written and fsynced; a directory is fsynced whenever names in it must be durable.
Publishing renames a staged directory into place, withdrawing renames it aside. Metadata calls go
through ``aiofiles.os`` on the engine loop, bulk bytes through ``os.pwritev`` in the tier's threads.

The system calls themselves are here too (:func:`probe_direct_io`, :func:`pwrite_all`,
:func:`preallocate`, :func:`fsync_dir`, :func:`makedirs_durable`, :func:`write_file`,
:func:`remove_tree`), for the other tiers that keep files (shm, the peer tier's replicas) as well;
:mod:`tierckpt.tiers.fsio` keeps the read side, and still answers to their old names.

Every ``os`` and ``aiofiles.os`` function is looked up at call time, never bound at import, so
:class:`tierckpt.testing.IOFaults` can make any of them fail; fallocate(2) goes through
``tierckpt.tiers.fsio._fallocate``, the hook those tests patch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import NoReturn

import aiofiles.os

from tierckpt.storage.plan import WriteItem, WritePlan
from tierckpt.storage.store import ByteStore, DataWriter, Entry, ObjectReader
from tierckpt._buffers import PAGE, aligned_buffer
from tierckpt.tiers import fsio
from tierckpt.tiers.fsio import O_DIRECT, _advance, _is_aligned, _tail_page, read_into, read_span
from tierckpt.tiers.lock import DirectoryLock

__all__ = [
    "LocalDataWriter", "LocalReader", "LocalStore", "fsync_dir", "makedirs_durable", "preallocate", "probe_direct_io",
    "pwrite_all", "raise_named", "remove_out_of_sight", "remove_tree", "write_file",
]

# -- the system calls -------------------------------------------------------------------------------

def probe_direct_io(directory: Path) -> bool:
    """Whether files in ``directory`` accept O_DIRECT writes of one aligned page."""
    if not O_DIRECT:
        return False
    probe = directory / f".direct-probe-{uuid.uuid4().hex}"
    buf = aligned_buffer(PAGE)
    try:
        # A file system without O_DIRECT (ramfs, some FUSE) may create the file and only then refuse
        # the open: the probe file is removed whichever way this goes.
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
        try:
            os.pwrite(fd, memoryview(buf), 0)
        finally:
            os.close(fd)
        return True
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return False
        raise
    finally:
        probe.unlink(missing_ok=True)
        buf.close()


def pwrite_all(data: memoryview, offset: int, fd: int, direct_fd: int | None) -> None:
    """Write all of ``data`` at ``offset``: aligned parts through ``direct_fd`` when given.

    With O_DIRECT, an unaligned tail is written as a zero-padded full page (one ``pwritev`` with the
    body); callers only do that where the bytes after the tail up to the next page boundary are
    theirs (4 KiB-aligned layouts).
    """
    data = data.cast("B") if data.format != "B" else data
    if direct_fd is not None and offset % PAGE == 0 and _is_aligned(data):
        body = data.nbytes // PAGE * PAGE
        tail = data.nbytes - body
        buffers = [data[:body]] if body else []
        if tail:
            page = _tail_page()
            page[:tail] = data[body:]
            page[tail:] = bytes(PAGE - tail)
            buffers.append(page)
        _write_loop(direct_fd, buffers, offset)
        return
    _write_loop(fd, [data], offset)


def _write_loop(fd: int, buffers: list[memoryview], offset: int) -> None:
    while buffers:
        n = os.pwritev(fd, buffers, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        buffers = _advance(buffers, n)
        offset += n


def preallocate(fd: int, nbytes: int) -> None:
    """Reserve ``nbytes`` for the file now, in one piece where the file system can.

    Writer threads finish their chunks out of order; allocated write by write, a 512 MiB data file
    here ended up in 13-17 extents, some out of order, against 5 when reserved first, and the flush
    took 0.32 s instead of 0.30 s. fallocate(2) is called directly: glibc's posix_fallocate would
    write zeros on file systems without it, doubling the write.
    """
    err = fsio._fallocate(fd, nbytes) if nbytes > 0 else 0
    if err and err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        raise OSError(err, os.strerror(err))


# -- errors that name their file, and metadata I/O --------------------------------------------------
#
# Calls on a file descriptor (pwritev, fsync, fallocate) raise an OSError without a file name; a flush
# failure must say which file, so the callers below re-raise such errors with the path. Every os
# function is looked up at call time (``os.fsync``, not a reference bound at import), so
# :class:`tierckpt.testing.IOFaults` can make any of them fail.


def raise_named(exc: OSError, path: Path | str, doing: str) -> NoReturn:
    """Raise ``exc`` again, as an OSError naming ``path`` (and ``doing``) when it names no file itself.

    Called in an ``except OSError as exc`` block; the new error is of the matching subclass
    (``PermissionError`` for EACCES, ...) and chained to ``exc``.
    """
    if exc.filename is not None or exc.errno is None:
        raise exc
    raise OSError(exc.errno, f"{exc.strerror or os.strerror(exc.errno)} ({doing})", str(path)) from exc


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (new, renamed and removed names)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise_named(exc, path, "fsync of the directory")
    finally:
        os.close(fd)


def makedirs_durable(path: Path) -> None:
    """``mkdir -p path``, each level it creates made durable in its parent (the parent fsynced).

    Without that, a power loss after the first commit may drop a new tier directory's own name, and
    every version in it with it: fsyncing a directory makes its entries durable, not its name.
    """
    missing = []
    level = path
    while not level.exists():
        missing.append(level)
        level = level.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            pass
        fsync_dir(directory.parent)


def write_file(path: Path, data: bytes) -> None:
    """Create ``path`` (which must not exist) holding ``data``, and fsync it: a manifest."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        try:
            while view.nbytes:
                view = view[os.write(fd, view) :]
        except OSError as exc:
            raise_named(exc, path, "write")
        try:
            os.fsync(fd)
        except OSError as exc:
            raise_named(exc, path, "fsync")
    finally:
        os.close(fd)


def remove_tree(path: Path) -> OSError | None:
    """Remove ``path`` and everything below it, going on past entries that fail.

    Returns None once ``path`` is gone (or was never there), else the first error met: what could not
    be removed is left for a later sweep, and everything else was removed anyway.
    """
    errors: list[OSError] = []

    def failed(_function: object, name: str, info: tuple[type, BaseException, object]) -> None:
        exc = info[1]
        if isinstance(exc, FileNotFoundError):
            return
        # rmtree's own error names the entry relative to its directory; ``name`` is the whole path.
        code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
        error = OSError(code, f"{os.strerror(code)} (removal)", name)
        error.__cause__ = exc
        errors.append(error)

    shutil.rmtree(path, onerror=failed)  # onerror: Python 3.11 has no onexc
    if not os.path.lexists(path):
        return None
    return errors[0] if errors else OSError(errno.ENOTEMPTY, f"{os.strerror(errno.ENOTEMPTY)} (removal)", str(path))


def remove_out_of_sight(root: Path, path: Path, name: str) -> None:
    """Remove directory ``path``: renamed to ``root/.trash-<name>-…`` first (a reader sees it whole or
    gone, and what a crash leaves behind is swept as trash), then its files. Gone already: nothing."""
    trash = root / f".trash-{name}-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


_fsync_dir = aiofiles.os.wrap(fsync_dir)
_remove_tree = aiofiles.os.wrap(remove_tree)
_write_file = aiofiles.os.wrap(write_file)


class LocalDataWriter(DataWriter):
    """A data file written from a plan by several threads: see the module docstring."""

    def __init__(self, path: Path, plan: WritePlan, *, direct: bool) -> None:
        self.path = path
        self._offsets = [item.offset or 0 for item in plan.items]
        self._end = plan.packed_start  # where the next packed item goes
        self._lock = threading.Lock()
        self._closed = False
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._direct_fd: int | None = None
        try:
            if direct and plan.raw_layout:
                self._direct_fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | O_DIRECT)
            if plan.raw_layout:
                try:
                    preallocate(self._fd, plan.fixed_bytes)
                except OSError as exc:
                    raise_named(exc, path, f"fallocate of {plan.fixed_bytes} bytes")
        except BaseException:
            self.close()
            raise

    def write(self, item: WriteItem, data: memoryview) -> None:
        offset = item.offset
        try:
            if offset is not None:
                pwrite_all(data, offset, self._fd, self._direct_fd)
            else:
                with self._lock:
                    offset, self._end = self._end, self._end + data.nbytes
                # Packed items go through the page cache: O_DIRECT would pad an unaligned tail to a
                # full page of zeros, over the head of the next packed item (maybe already written).
                pwrite_all(data, offset, self._fd, None)
        except OSError as exc:
            raise_named(exc, self.path, f"write of {data.nbytes} bytes at offset {offset}")
        self._offsets[item.index] = offset

    def finish(self) -> tuple[int, ...]:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise_named(exc, self.path, "fsync")
        return tuple(self._offsets)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._direct_fd is not None:
            os.close(self._direct_fd)
        os.close(self._fd)


class LocalReader(ObjectReader):
    """A file opened for reading: ``fd`` through the page cache, ``direct_fd`` (when given) with O_DIRECT.

    The reader owns both descriptors from then on.
    """

    def __init__(self, fd: int, size: int, direct_fd: int | None = None) -> None:
        self.fd = fd
        self.size = size
        self.direct_fd = direct_fd

    @property
    def direct(self) -> bool:
        return self.direct_fd is not None

    def read_span(self, offset: int, length: int, scratch: memoryview, *, what: str) -> memoryview:
        return read_span(offset, length, scratch, self.fd, self.direct_fd, what=what)

    def read_into(self, out: memoryview, offset: int, scratch: memoryview, *, what: str) -> None:
        read_into(out, offset, self.fd, self.direct_fd, scratch, what=what)

    def close(self) -> None:
        fds = [fd for fd in (self.direct_fd, self.fd) if fd is not None and fd >= 0]
        self.fd, self.direct_fd = -1, None
        for fd in fds:
            os.close(fd)


class LocalStore(ByteStore):
    """Versions as directories under ``root``; blocking setup work runs in ``executor``.

    ``tier`` names the tier in messages. With ``exclusive``, :meth:`open` takes the directory's lock
    (:class:`~tierckpt.tiers.lock.DirectoryLock`) before it looks at anything, and :meth:`close`
    drops it.
    """

    def __init__(self, root: Path, executor: concurrent.futures.Executor, *, tier: str) -> None:
        self.root = root
        self.executor = executor
        self.direct = False
        self._lock = DirectoryLock(root, tier)

    def path(self, key: str) -> Path:
        """The file or directory of ``key``."""
        return self.root / key if key else self.root

    async def _run(self, function: object, *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self.executor, function, *args)  # type: ignore[arg-type]

    async def open(self, *, exclusive: bool = False) -> None:
        """Create the root (each level made durable), lock it (``exclusive``), probe O_DIRECT."""
        await self._run(makedirs_durable, self.root)
        if exclusive:
            await self._run(self._lock.acquire)
        self.direct = bool(await self._run(probe_direct_io, self.root))

    async def list(self) -> list[Entry]:
        return [Entry(e.name, e.is_dir()) for e in await aiofiles.os.scandir(self.root)]

    async def exists(self, key: str) -> bool:
        return await aiofiles.os.path.exists(self.path(key))

    async def stage(self, name: str, *, shared: bool = False) -> None:
        if shared:
            await aiofiles.os.makedirs(self.path(name), exist_ok=True)
        else:
            await aiofiles.os.mkdir(self.path(name))

    def open_data(self, key: str, plan: WritePlan) -> LocalDataWriter:
        return LocalDataWriter(self.path(key), plan, direct=self.direct)

    async def write_small(self, key: str, data: bytes) -> None:
        await _write_file(self.path(key), data)

    async def sync(self, name: str = "") -> None:
        await _fsync_dir(self.path(name))

    async def publish(self, staging: str, final: str) -> None:
        await aiofiles.os.rename(self.path(staging), self.path(final))

    async def withdraw(self, final: str, aside: str) -> None:
        await aiofiles.os.rename(self.path(final), self.path(aside))

    async def remove(self, name: str) -> OSError | None:
        return await _remove_tree(self.path(name))

    async def remove_object(self, key: str) -> None:
        await aiofiles.os.remove(self.path(key))

    async def close(self) -> None:
        self._lock.release()
