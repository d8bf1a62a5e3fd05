"""The local file system as a byte store: a directory per version, O_DIRECT data files, renames.

Data objects are written the way measured fastest here: the planned extent reserved in one piece
(fallocate), items at fixed 4 KiB-aligned offsets written with O_DIRECT from the writer threads'
aligned buffers as they are, packed items (known in size only once encoded) through the page cache
back to back, one ``fsync`` at the end. Small objects (manifests) are created, written and fsynced; a
directory is fsynced whenever names in it must be durable. Publishing renames a staged directory into
place, withdrawing renames it aside. Reading is :class:`~tierckpt.storage.localread.LocalFiles`'s,
which this store extends. Metadata calls go through ``aiofiles.os`` on the engine loop,
bulk bytes through the system calls of :mod:`tierckpt.storage.posix` in the tier's threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from pathlib import Path

import aiofiles.os

from tierckpt.storage.lock import DirectoryLock
from tierckpt.storage.plan import WriteItem, WritePlan
from tierckpt.storage.posix import (
    O_DIRECT,
    fsync_dir,
    fsync_named,
    makedirs_durable,
    preallocate,
    probe_direct_io,
    pwrite_all,
    raise_named,
    remove_tree,
    write_file,
)
from tierckpt.storage.localread import LocalFiles
from tierckpt.storage.store import ByteStore, DataWriter, RootEntry

__all__ = ["LocalDataWriter", "LocalStore"]

log = logging.getLogger("tierckpt")

_fsync_dir = aiofiles.os.wrap(fsync_dir)
_remove_tree = aiofiles.os.wrap(remove_tree)
_write_file = aiofiles.os.wrap(write_file)
_lstat = aiofiles.os.wrap(os.lstat)


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
        fsync_named(self._fd, self.path)
        return tuple(self._offsets)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._direct_fd is not None:
            os.close(self._direct_fd)
        os.close(self._fd)


class LocalStore(ByteStore, LocalFiles):
    """Versions as directories under ``root``; blocking setup work runs in ``executor``.

    ``tier`` names the tier in messages. With ``exclusive``, :meth:`open` takes the directory's lock
    (:class:`~tierckpt.storage.lock.DirectoryLock`) before it looks at anything, and :meth:`close`
    drops it.
    """

    def __init__(self, root: Path, executor: concurrent.futures.Executor, *, tier: str) -> None:
        super().__init__(root)
        self.executor = executor
        self.direct = False
        self.tier = tier
        self._lock = DirectoryLock(root, tier)

    def path(self, key: str) -> Path:
        """The file or directory of ``key``."""
        return self.root / key  # "" (the root itself) adds nothing

    async def _run(self, function: object, *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self.executor, function, *args)  # type: ignore[arg-type]

    async def open(self, *, exclusive: bool = False) -> None:
        """Create the root (each level made durable), lock it (``exclusive``), probe O_DIRECT."""
        await self._run(makedirs_durable, self.root)
        if exclusive:
            await self._run(self._lock.acquire)
        self.direct = bool(await self._run(probe_direct_io, self.root))
        if not self.direct:
            log.info("tier %r: %s refuses O_DIRECT; writing through the page cache", self.tier, self.root)

    async def list(self) -> list[RootEntry]:
        return [RootEntry(e.name, e.is_dir()) for e in await aiofiles.os.scandir(self.root)]

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

    def where(self, name: str) -> str:
        return str(self.path(name))

    async def mtime(self, name: str) -> float:
        return (await _lstat(self.path(name))).st_mtime  # a symlink is refused, not followed, here too

    async def withdraw(self, final: str, aside: str) -> None:
        await aiofiles.os.rename(self.path(final), self.path(aside))

    async def remove(self, name: str) -> OSError | None:
        return await _remove_tree(self.path(name))

    async def remove_object(self, key: str) -> None:
        await aiofiles.os.remove(self.path(key))

    async def close(self) -> None:
        self._lock.release()
