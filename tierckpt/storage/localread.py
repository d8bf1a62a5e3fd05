"""Reading objects under a local directory: the read half of the local byte store.

A key ``<container>/<name>`` is read relative to the container's descriptor, and neither is followed
if it is a symlink (``O_NOFOLLOW``): a symlink could lead a read out of the version directory. The
container must be a directory and the object a regular file, opened without blocking so that a FIFO
or a device is refused rather than waited on. With ``direct``, an object is also opened with
O_DIRECT, where the file system takes it. What is refused is an :class:`~tierckpt.storage.store.Unreadable`
whose ``filename`` says which part of the key it was; a missing part is a FileNotFoundError with the
same ``filename``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from tierckpt.storage.posix import O_DIRECT, read_into, read_span
from tierckpt.storage.store import RangeReader, ReadableStore, TooLarge, Unreadable

__all__ = ["LocalFiles", "LocalReader"]

_SYMLINK = "is a symlink (refused: it could lead out of the version directory)"


class LocalReader(RangeReader):
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


def _open_at(dir_fd: int | None, name: str | Path, flags: int, part: str) -> tuple[int, os.stat_result]:
    """Open without following a symlink in the last component, and without blocking on a FIFO; an
    error names ``part`` (its ``filename``)."""
    try:
        fd = os.open(name, flags | os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # what O_NOFOLLOW gives for a symlink
            raise Unreadable(_SYMLINK, part) from None
        if exc.errno == errno.ENOTDIR:  # O_DIRECTORY | O_NOFOLLOW on a symlink, or not a directory
            symlink = dir_fd is None and os.path.islink(name)
            raise Unreadable(_SYMLINK if symlink else "is not a directory", part) from None
        exc.filename = part
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class LocalFiles(ReadableStore):
    """The objects under directory ``root``, read as the module docstring says (blocking)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def containers_named(self, prefix: str) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False))
        except OSError:
            return []

    def _open(self, key: str) -> tuple[int, int, int]:
        """(the container's descriptor, the object's, its size), both to be closed by the caller."""
        container, _, name = key.rpartition("/")
        dir_fd, _ = _open_at(None, self.root / container, os.O_DIRECTORY, container)
        try:
            fd, st = _open_at(dir_fd, name, 0, name)
        except BaseException:
            os.close(dir_fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            os.close(dir_fd)
            raise Unreadable("is not a regular file", name)
        return dir_fd, fd, st.st_size

    def read_small(self, key: str, limit: int) -> bytes:
        dir_fd, fd, size = self._open(key)
        os.close(dir_fd)
        try:
            if size > limit:
                raise TooLarge(size, limit)
            parts = []
            left = limit + 1  # a file growing while it is read is cut here, and refused by its decoder
            while left > 0:
                part = os.read(fd, min(left, 1 << 20))
                if not part:
                    break
                parts.append(part)
                left -= len(part)
            return b"".join(parts)
        finally:
            os.close(fd)

    def open_reader(
        self, key: str, *, size: int | None = None, spans: Sequence[tuple[int, int]] = (), every_chunk: bool = True, direct: bool = False
    ) -> LocalReader:
        dir_fd, fd, found = self._open(key)
        reader = LocalReader(fd, found)
        try:
            if direct:
                name = key.rpartition("/")[2]
                try:
                    reader.direct_fd = _open_at(dir_fd, name, O_DIRECT, name)[0]
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # EINVAL: O_DIRECT not taken here; read through the page cache
                        raise
        except BaseException:
            reader.close()
            raise
        finally:
            os.close(dir_fd)
        return reader
