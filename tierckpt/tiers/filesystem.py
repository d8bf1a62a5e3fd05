"""A filesystem tier: local NVMe or a parallel file system, one directory per committed version.

Layout (format v2): ``<path>/step-<12 digits>/{manifest.msgpack, data-r00000.bin}``. A version is
written under ``.tmp-step-...`` in the same parent, its files fsynced, renamed into place, and the
parent fsynced: a reader sees a whole version or none. Deletion renames to ``.trash-...`` first, so a
crash mid-delete never leaves a half-removed version that looks committed. ``.tmp-``/``.trash-``
leftovers and step directories without a manifest are swept on open; a step directory whose manifest
is damaged is kept (never delete what may be someone's only copy) and fails verification on restore.

Replacing a committed version of the same step takes two renames (a non-empty directory cannot be
renamed over): the old one goes to ``.replaced-step-...``, then the new one into place. A crash between
the two leaves no ``step-...`` directory, so open renames the ``.replaced-`` copy back instead of
sweeping it: the step keeps its old, committed content rather than vanishing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import aiofiles
import aiofiles.os

from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import (
    DATA_FILE,
    MANIFEST_FILE,
    Manifest,
    TensorRecord,
    checksum,
    parse_version_dirname,
    version_dirname,
)
from tierckpt.tiers.base import Staged, Tier, VersionInfo, VersionSource
from tierckpt.tiers.encoding import TierEncoding
from tierckpt.tiers.fsio import O_DIRECT, fsync_dir, probe_direct_io, read_into, read_span
from tierckpt.tiers.fswrite import write_data_file
from tierckpt.tiers.lock import DirectoryLock

log = logging.getLogger("tierckpt")

_fsync = aiofiles.os.wrap(os.fsync)
_fsync_dir = aiofiles.os.wrap(fsync_dir)
_rmtree = aiofiles.os.wrap(shutil.rmtree)
_REPLACED = ".replaced-"  # + the step directory's name + "-<random>": a committed version being replaced


class FilesystemTier(Tier):
    """Versions as directories under ``config.path`` (relative paths resolve against the working directory)."""

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        assert config.path is not None  # guaranteed by TierConfig validation
        self.root = Path(config.path).expanduser().absolute()
        self.encoding = TierEncoding(config.compression, config.name, config.io_threads)
        self.executor = concurrent.futures.ThreadPoolExecutor(
            config.io_threads, thread_name_prefix=f"tierckpt-io-{config.name}"
        )
        self.direct = False
        self._index: dict[int, VersionInfo] = {}
        self._lock = DirectoryLock(self.root, config.name)

    async def open(self) -> None:
        try:
            await aiofiles.os.makedirs(self.root, exist_ok=True)
            # Before anything is swept: the .tmp- directories of a job still writing here are not leftovers.
            await asyncio.get_running_loop().run_in_executor(self.executor, self._lock.acquire)
            self.direct = await asyncio.get_running_loop().run_in_executor(self.executor, probe_direct_io, self.root)
        except OSError as exc:
            raise ConfigError(
                f"tier {self.name!r}: cannot use {str(self.root)!r} as a checkpoint directory ({exc.strerror or exc})",
                tier=self.name,
                key=f"tiers.{self.name}.path",
            ) from exc
        if not self.direct:
            log.info("tier %r: %s refuses O_DIRECT; writing through the page cache", self.name, self.root)
        replaced = []
        for entry in await aiofiles.os.scandir(self.root):
            if entry.name.startswith(_REPLACED):
                replaced.append(entry)
                continue
            if entry.name.startswith(".direct-probe-") and entry.is_file():
                await aiofiles.os.remove(entry.path)  # a probe file from a crash mid-probe
                continue
            if entry.name.startswith((".tmp-", ".trash-")):
                log.info("tier %r: sweeping %s left by an interrupted write or delete", self.name, entry.name)
                await _rmtree(entry.path, ignore_errors=True)
                continue
            step = parse_version_dirname(entry.name)
            if step is None or not entry.is_dir():
                continue
            manifest_path = Path(entry.path) / MANIFEST_FILE
            if not await aiofiles.os.path.exists(manifest_path):
                log.warning("tier %r: sweeping %s: no manifest, so it was never committed", self.name, entry.name)
                await _rmtree(entry.path, ignore_errors=True)
                continue
            self._index[step] = await self._describe(step, Path(entry.path))
        for entry in replaced:
            await self._recover_replaced(Path(entry.path))

    async def _recover_replaced(self, path: Path) -> None:
        """A committed version moved aside by an interrupted replacement: put it back if it is the only copy."""
        step = parse_version_dirname(path.name[len(_REPLACED) :].rsplit("-", 1)[0])
        final = self.root / version_dirname(step if step is not None else 0)
        if (
            step is not None
            and step not in self._index
            and not await aiofiles.os.path.exists(final)
            and await aiofiles.os.path.exists(path / MANIFEST_FILE)
        ):
            log.warning("tier %r: restoring %s: its replacement was interrupted before it was committed", self.name, final.name)
            await aiofiles.os.rename(path, final)
            await _fsync_dir(self.root)
            self._index[step] = await self._describe(step, final)
            return
        log.info("tier %r: sweeping %s left by an interrupted replacement", self.name, path.name)
        await _rmtree(path, ignore_errors=True)

    async def _describe(self, step: int, path: Path) -> VersionInfo:
        try:
            manifest = await self._manifest(step, path)
            return VersionInfo(self.name, step, manifest.stored_bytes, manifest.created, str(path))
        except CorruptCheckpointError as exc:
            log.warning("tier %r: %s", self.name, exc)
            stat = await aiofiles.os.stat(path)
            return VersionInfo(self.name, step, 0, stat.st_mtime, str(path), valid=False)

    async def _manifest(self, step: int, path: Path) -> Manifest:
        try:
            async with aiofiles.open(path / MANIFEST_FILE, "rb") as f:
                data = await f.read()
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(
                f"step {step} on tier {self.name!r}: {MANIFEST_FILE} is missing", tier=self.name, step=step
            ) from exc
        return Manifest.decode(data, tier=self.name, step=step)

    def versions(self) -> list[VersionInfo]:
        return [self._index[s] for s in sorted(self._index)]

    async def write(self, source: VersionSource) -> Staged:
        tmp = self.root / f".tmp-{version_dirname(source.step)}-{uuid.uuid4().hex[:12]}"
        await aiofiles.os.mkdir(tmp)
        try:
            encoding = self.encoding.begin()
            started = time.perf_counter()
            records = await asyncio.to_thread(
                write_data_file,
                source,
                tmp / DATA_FILE.format(rank=0),
                encoding,
                self.executor,
                direct=self.direct,
                threads=self.config.io_threads,
            )
            self.encoding.finish(encoding, time.perf_counter() - started)
            manifest = Manifest(
                step=source.step,
                created=source.created,
                skeleton=source.skeleton,
                records=records,
                metadata=source.metadata,
            )
            async with aiofiles.open(tmp / MANIFEST_FILE, "wb") as f:
                await f.write(manifest.encode())
                await f.flush()
                await _fsync(f.fileno())
            await _fsync_dir(tmp)
        except BaseException:
            await _rmtree(tmp, ignore_errors=True)
            raise
        return Staged(source.step, tmp, manifest.stored_bytes, source.created)

    async def commit(self, staged: Staged) -> VersionInfo:
        final = self.root / version_dirname(staged.step)
        old = None
        if await aiofiles.os.path.exists(final):
            old = self.root / f"{_REPLACED}{final.name}-{uuid.uuid4().hex[:12]}"
            await aiofiles.os.rename(final, old)
        try:
            await aiofiles.os.rename(staged.location, final)
        except BaseException:
            if old is not None:
                await aiofiles.os.rename(old, final)
            raise
        await _fsync_dir(self.root)
        if old is not None:
            await _rmtree(old, ignore_errors=True)
        info = VersionInfo(self.name, staged.step, staged.nbytes, staged.created, str(final))
        self._index[staged.step] = info
        return info

    async def abort(self, staged: Staged) -> None:
        await _rmtree(staged.location, ignore_errors=True)

    async def read(self, step: int) -> VersionSource:
        path = self.root / version_dirname(step)
        manifest = await self._manifest(step, path)
        return await asyncio.to_thread(FilesystemSource, self.name, path, manifest, direct=self.direct)

    async def delete(self, step: int) -> None:
        if self.leased(step):
            raise RuntimeError(f"tier {self.name!r}: step {step} is leased and cannot be deleted")
        info = self._index.pop(step, None)
        final = self.root / version_dirname(step)
        trash = self.root / f".trash-{final.name}-{uuid.uuid4().hex[:12]}"
        try:
            await aiofiles.os.rename(final, trash)
        except FileNotFoundError:
            return
        except BaseException:
            if info is not None:
                self._index[step] = info
            raise
        await _fsync_dir(self.root)
        await _rmtree(trash, ignore_errors=True)

    async def close(self) -> None:
        self.executor.shutdown(wait=True)
        self._lock.release()


class FilesystemSource(VersionSource):
    """A committed version's files, opened for reading; verifies every chunk it returns.

    With ``direct``, every file is also opened with O_DIRECT and bulk reads bypass the page cache:
    chunks land straight in page-aligned destinations, and a promotion to a slower tier reads into
    the writer thread's aligned scratch, which the next tier then writes with O_DIRECT as it is.
    Each chunk is hashed right after its read, in the reading thread, while it is still in cache.
    """

    def __init__(self, tier: str, path: Path, manifest: Manifest, *, direct: bool = False) -> None:
        self.tier = tier
        self.step = manifest.step
        self.created = manifest.created
        self.skeleton = manifest.skeleton
        self.metadata = manifest.metadata
        self.records = manifest.records
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int] = {}
        try:
            for name in sorted({r.file for r in manifest.records}):
                try:
                    self._fds[name] = os.open(path / name, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError as exc:
                    raise CorruptCheckpointError(
                        f"step {self.step} on tier {tier!r}: data file {name} is missing", tier=tier, step=self.step
                    ) from exc
                if direct:
                    try:
                        self._direct_fds[name] = os.open(path / name, os.O_RDONLY | os.O_CLOEXEC | O_DIRECT)
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:  # refused after all: read through the page cache
                            raise
        except BaseException:
            self.close()
            raise

    def _verify(self, record: TensorRecord, chunk: int, data: memoryview) -> None:
        if checksum(data) != record.chunks[chunk].checksum:
            raise CorruptCheckpointError(
                f"step {self.step} on tier {self.tier!r}: checksum mismatch in {record.key} (chunk {chunk})",
                tier=self.tier,
                step=self.step,
                key=record.key,
            )

    @property
    def direct(self) -> bool:
        """Whether bulk reads bypass the page cache (O_DIRECT)."""
        return bool(self._direct_fds)

    def _corrupt(self, record: TensorRecord, exc: CorruptCheckpointError) -> CorruptCheckpointError:
        return CorruptCheckpointError(str(exc), tier=self.tier, step=self.step, key=record.key)

    def read_stored(self, record: TensorRecord, chunk: int, scratch: memoryview) -> memoryview:
        c = record.chunks[chunk]
        what = f"step {self.step} on tier {self.tier!r}, {record.key}"
        fd, direct_fd = self._fds[record.file], self._direct_fds.get(record.file)
        try:
            out = read_span(c.offset, c.stored, scratch, fd, direct_fd, what=what)
        except CorruptCheckpointError as exc:
            raise self._corrupt(record, exc) from None
        self._verify(record, chunk, out)
        return out

    def read_logical(self, record: TensorRecord, chunk: int, out: memoryview, scratch: memoryview) -> None:
        c = record.chunks[chunk]
        codec = record.chunk_codec(chunk)
        if codec != "none":
            try:
                super().read_logical(record, chunk, out, scratch)
            except CorruptCheckpointError as exc:
                if exc.key is not None:
                    raise
                raise CorruptCheckpointError(
                    f"step {self.step} on tier {self.tier!r}: {record.key} chunk {chunk} does not decode ({exc})",
                    tier=self.tier,
                    step=self.step,
                    key=record.key,
                ) from exc
            return
        if c.stored != out.nbytes:
            raise CorruptCheckpointError(
                f"step {self.step} on tier {self.tier!r}: {record.key} chunk {chunk} has the wrong length",
                tier=self.tier,
                step=self.step,
                key=record.key,
            )
        # Raw chunks land straight in the destination (DMA when both are page-aligned), and are
        # hashed right away while they are in cache: no bounce buffer, no second pass later.
        what = f"step {self.step} on tier {self.tier!r}, {record.key}"
        fd, direct_fd = self._fds[record.file], self._direct_fds.get(record.file)
        try:
            read_into(out, c.offset, fd, direct_fd, scratch, what=what)
        except CorruptCheckpointError as exc:
            raise self._corrupt(record, exc) from None
        self._verify(record, chunk, out)

    def close(self) -> None:
        fds = [*self._fds.values(), *self._direct_fds.values()]
        self._fds, self._direct_fds = {}, {}
        for fd in fds:
            os.close(fd)
