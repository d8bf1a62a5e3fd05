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

Reading (:mod:`tierckpt.tiers.fsread`) trusts nothing a manifest says: files are opened without following
symlinks, and records are checked against the files before anything is allocated or read.

Any write, fsync, rename or removal may fail (a full disk, a quota, EIO, EACCES): see the comment above
:meth:`FilesystemTier.write` for what a failure leaves behind.

Several ranks (a :class:`~tierckpt.ranks.RankGroup`) share the tier's directory. Every rank writes its
data file and its rank manifest into one staging directory whose name the leader's decision fixes;
once every rank reported its part durable, the leader writes the commit marker there (:meth:`seal`)
and renames the directory into place (:meth:`commit`); the other ranks only index it (:meth:`adopt`).
Only the leader sweeps, locks, deletes and renames: a follower never removes anything but its own
files of a version that was abandoned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import aiofiles
import aiofiles.os

from typing import TYPE_CHECKING, Any

from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import (
    DATA_FILE,
    MANIFEST_FILE,
    RANK_MANIFEST_FILE,
    CommitMarker,
    Manifest,
    checksum,
    parse_version_dirname,
    version_dirname,
)
from tierckpt.tiers.base import GroupTier, Part, Staged, VersionInfo, VersionSource
from tierckpt.tiers.encoding import TierEncoding
from tierckpt.tiers.fsio import fsync_dir, makedirs_durable, probe_direct_io, remove_tree, write_file
from tierckpt.format.saved_layout import SavedLayout
from tierckpt.tiers.fsread import FilesystemSource, filesystem_layout, open_source, read_head, read_manifest, resolve_shared  # noqa: F401 - FilesystemSource lived here
from tierckpt.tiers.fswrite import write_data_file
from tierckpt.tiers.lock import DirectoryLock

log = logging.getLogger("tierckpt")

_fsync_dir = aiofiles.os.wrap(fsync_dir)
_rmtree = aiofiles.os.wrap(shutil.rmtree)
_remove_tree = aiofiles.os.wrap(remove_tree)
_write_file = aiofiles.os.wrap(write_file)
_read_manifest = aiofiles.os.wrap(read_manifest)
_read_head = aiofiles.os.wrap(read_head)
_lstat = aiofiles.os.wrap(os.lstat)
_REPLACED = ".replaced-"  # + the step directory's name + "-<random>": a committed version being replaced
_MEMBER = ".member-"  # + run id: the leader's sign that a follower sees the directory the leader sees

if TYPE_CHECKING:
    from tierckpt.ranks import RankGroup


class FilesystemTier(GroupTier):
    """Versions as directories under ``config.path`` (relative paths resolve against the working directory)."""

    def __init__(self, config: TierConfig, group: RankGroup | None = None) -> None:
        super().__init__(config)
        self.group = group
        self.rank = group.rank if group else 0
        assert config.path is not None  # guaranteed by TierConfig validation
        self.root = Path(config.path).expanduser().absolute()
        self.encoding = TierEncoding(config.compression, config.name)
        self.executor = concurrent.futures.ThreadPoolExecutor(
            config.io_threads, thread_name_prefix=f"tierckpt-io-{config.name}"
        )
        self.direct = False
        self._index: dict[int, VersionInfo] = {}
        self._leftovers: set[Path] = set()  # directories a failed removal left: retried before each write
        self._lock = DirectoryLock(self.root, config.name)

    async def open(self) -> None:
        if self.group is None:
            await self._open()
            return
        # The leader opens (locks, sweeps, indexes) first; the others only index what it left, and
        # check that they see the same directory.
        key, member = f"open/{self.name}", self.root / f"{_MEMBER}{self.group.run}"
        if self.group.leader:
            try:
                await self._open()
                await _write_file(member, b"")
            except BaseException as exc:
                await self.group.put(key, f"{type(exc).__name__}: {exc}")
                raise
            await self.group.put(key, "")
            return
        if not await self.group.wait_for([key], self.group.timeout_s):
            raise ConfigError(f"tier {self.name!r}: rank 0 did not open {str(self.root)!r} within {self.group.timeout_s:g} s", tier=self.name)
        problem = await self.group.get(key)
        if problem:
            raise ConfigError(f"tier {self.name!r}: rank 0 could not open it: {problem}", tier=self.name, key=f"tiers.{self.name}.path")
        if not await aiofiles.os.path.exists(member):
            raise ConfigError(
                f"tier {self.name!r}: {str(self.root)!r} is not the directory rank 0 opened: every rank must "
                "see the same directory (a shared file system, or one node's disk for all its ranks)",
                tier=self.name,
                key=f"tiers.{self.name}.path",
            )
        await self._open()

    async def _open(self) -> None:
        leader = self.group is None or self.group.leader
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, makedirs_durable, self.root)
            # Before anything is swept: the .tmp- directories of a job still writing here are not leftovers.
            if leader:
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
            if not leader:
                step = parse_version_dirname(entry.name)
                if step is not None and entry.is_dir() and await aiofiles.os.path.exists(Path(entry.path) / MANIFEST_FILE):
                    self._index[step] = await self._describe(step, Path(entry.path))
                continue
            if entry.name.startswith(_MEMBER) and entry.is_file():
                await aiofiles.os.remove(entry.path)  # left by an earlier run's leader
                continue
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
            head = await _read_head(path, tier=self.name, step=step)
            return VersionInfo(self.name, step, head.stored_bytes, head.created, str(path))
        except CorruptCheckpointError as exc:
            log.warning("tier %r: %s", self.name, exc)
            stat = await _lstat(path)  # it may be a symlink, refused: not followed here either
            return VersionInfo(self.name, step, 0, stat.st_mtime, str(path), valid=False)

    async def _manifest(self, step: int, path: Path) -> Manifest:
        """This rank's manifest of a version (raises LayoutError when another number of ranks saved it)."""
        # Not aiofiles.open: the file is opened without following a symlink and sized before it is read.
        world = self.group.world if self.group else 1
        return await _read_manifest(path, tier=self.name, step=step, rank=self.rank, world=world)

    def versions(self) -> list[VersionInfo]:
        return [self._index[s] for s in sorted(self._index)]

    # -- writing, committing, deleting ------------------------------------------------------------------
    #
    # Any call below can fail: a full disk (ENOSPC), a quota (EDQUOT), EIO, EACCES. Whatever fails, every
    # committed version stays whole (in place; for a delete, in place or under .trash-), the index keeps
    # saying what the directory holds, the space of a failed write is given back (what cannot be removed
    # is retried before the next write, and swept at the next open), and the OSError names its path.

    async def write(self, source: VersionSource, staging: str | None = None) -> Staged:
        """Write ``source`` under a temporary name: ``staging`` when several ranks share it (each writes
        its own files there; see the module docstring), else a name of its own."""
        await self._sweep()
        tmp = self.root / (staging or f".tmp-{version_dirname(source.step)}-{uuid.uuid4().hex[:12]}")
        ranked = self.group is not None
        data = tmp / DATA_FILE.format(rank=self.rank)
        manifest_path = tmp / (RANK_MANIFEST_FILE.format(rank=self.rank) if ranked else MANIFEST_FILE)
        if ranked:
            await aiofiles.os.makedirs(tmp, exist_ok=True)
        else:
            await aiofiles.os.mkdir(tmp)
        try:
            encoding = self.encoding.begin()
            started = time.perf_counter()
            records = await asyncio.to_thread(
                write_data_file,
                source,
                data,
                encoding,
                self.executor,
                direct=self.direct,
                threads=self.config.io_threads,
                rank=self.rank,
            )
            self.encoding.finish(encoding, time.perf_counter() - started)
            manifest = Manifest(
                step=source.step,
                created=source.created,
                skeleton=source.skeleton,
                records=records,
                metadata=source.metadata,
                world_size=self.group.world if self.group else 1,
                rank=self.rank,
            )
            encoded = manifest.encode()
            await _write_file(manifest_path, encoded)
            await _fsync_dir(tmp)
        except BaseException:
            if ranked:
                await self._discard_part(data, manifest_path)
            else:
                await self._discard(tmp)
            raise
        part = Part(manifest_path.name, checksum(encoded), manifest.stored_bytes) if ranked else None
        return Staged(source.step, tmp, manifest.stored_bytes, source.created, part)

    async def seal(self, staged: Staged, parts: list[Part], metadata: dict[str, Any]) -> None:
        """The leader, once every rank's part is durable: write the commit marker into the staged version."""
        marker = CommitMarker(step=staged.step, created=staged.created, world_size=len(parts), ranks=tuple(parts), metadata=metadata)
        await _write_file(staged.location / MANIFEST_FILE, marker.encode())
        await _fsync_dir(staged.location)
        staged.nbytes = marker.stored_bytes

    async def adopt(self, staged: Staged, nbytes: int) -> VersionInfo:
        """A follower: the leader committed the version this rank staged a part of; index it."""
        info = VersionInfo(self.name, staged.step, nbytes, staged.created, str(self.root / version_dirname(staged.step)))
        self._index[staged.step] = info
        return info

    async def forget(self, step: int) -> None:
        """A follower: the leader deleted ``step``."""
        self._index.pop(step, None)

    async def _discard_part(self, *files: Path) -> None:
        """A follower's files of a version that will not be committed (the leader removes the directory)."""
        for path in files:
            try:
                await aiofiles.os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("tier %r: could not remove %s (%s); the leader sweeps it", self.name, path, exc)

    async def commit(self, staged: Staged) -> VersionInfo:
        final = self.root / version_dirname(staged.step)
        old = None
        if await aiofiles.os.path.exists(final):
            old = self.root / f"{_REPLACED}{final.name}-{uuid.uuid4().hex[:12]}"
            await aiofiles.os.rename(final, old)  # if this fails, nothing moved
        moved = False
        try:
            await aiofiles.os.rename(staged.location, final)
            moved = True
            await _fsync_dir(self.root)
        except BaseException:
            await self._undo_commit(staged, final, old, moved=moved)
            raise
        if old is not None:
            await self._discard(old)
        info = VersionInfo(self.name, staged.step, staged.nbytes, staged.created, str(final))
        self._index[staged.step] = info
        return info

    async def _undo_commit(self, staged: Staged, final: Path, old: Path | None, *, moved: bool) -> None:
        """Put the directory back as it was before a commit that failed part way, as far as the disk allows.

        A failed commit leaves the step as it was. If the disk refuses even that, nothing committed is
        removed: the new version stays in place (whole and fsynced; only its rename is unconfirmed) and
        is indexed, or the old one waits under ``.replaced-`` for the next open to put back.
        """
        try:
            if moved:
                await aiofiles.os.rename(final, staged.location)
                moved = False
            if old is not None:
                await aiofiles.os.rename(old, final)
                old = None
            await _fsync_dir(self.root)
        except OSError as exc:
            if moved:
                self._index[staged.step] = VersionInfo(self.name, staged.step, staged.nbytes, staged.created, str(final))
                if old is not None:
                    self._leftovers.add(old)  # the step is in place: the old copy goes once the directory syncs
                log.error(
                    "tier %r: step %d could not be taken back after its commit failed (%s); it stays in place",
                    self.name, staged.step, exc,
                )
            elif old is not None:
                self._index.pop(staged.step, None)
                log.error(
                    "tier %r: step %d's committed version could not be put back from %s (%s); "
                    "the tier puts it back when it next opens",
                    self.name, staged.step, old.name, exc,
                )
            else:
                log.warning("tier %r: fsync of %s failed after a commit was taken back: %s", self.name, self.root, exc)

    async def abort(self, staged: Staged) -> None:
        if self.group is not None and not self.group.leader:
            await self._discard_part(staged.location / DATA_FILE.format(rank=self.rank), staged.location / RANK_MANIFEST_FILE.format(rank=self.rank))
            return
        await self._discard(staged.location)

    async def _discard(self, path: Path) -> OSError | None:
        """Remove a temporary, trashed or moved-aside directory; what will not go is retried later.

        Never raises: returns the first error when part of ``path`` is left.
        """
        error = await _remove_tree(path)
        if error is None:
            self._leftovers.discard(path)
            return None
        self._leftovers.add(path)
        log.warning(
            "tier %r: could not remove all of %s (%s); retried before the next write, and swept when the tier next opens",
            self.name, path.name, error,
        )
        return error

    async def _sweep(self) -> None:
        """Retry removing what earlier failures left: a full disk is often freed between two writes.

        The parent directory is fsynced first: a ``.trash-`` rename that never became durable must not
        have its files removed under a name a crash could bring back.
        """
        if not self._leftovers:
            return
        try:
            await _fsync_dir(self.root)
        except OSError as exc:
            log.warning("tier %r: leftovers not swept: %s", self.name, exc)
            return
        for path in sorted(self._leftovers):
            if await _remove_tree(path) is None:
                self._leftovers.discard(path)
                log.info("tier %r: swept %s, left by an earlier failure", self.name, path.name)

    async def read(self, step: int) -> VersionSource:
        path = self.root / version_dirname(step)
        manifest = await self._manifest(step, path)
        return await asyncio.to_thread(open_source, self.name, path, manifest, direct=self.direct)

    async def read_whole(self, step: int) -> VersionSource:
        if self.group is None:
            return await self.read(step)  # one process's version holds every chunk it restores
        path = self.root / version_dirname(step)
        manifest = await self._manifest(step, path)

        def whole() -> FilesystemSource:
            head = read_head(path, tier=self.name, step=step)
            resolved = resolve_shared(path, head, manifest, tier=self.name) if isinstance(head, CommitMarker) else manifest
            return open_source(self.name, path, resolved, direct=self.direct)

        return await asyncio.to_thread(whole)

    async def read_layout(self, step: int, rank: int) -> SavedLayout:
        path = self.root / version_dirname(step)
        layout = await asyncio.to_thread(filesystem_layout, self.name, path, rank, direct=self.direct)
        if layout.step != step:
            raise CorruptCheckpointError(f"{path}: its manifest records step {layout.step}", tier=self.name, step=step)
        return layout

    async def delete(self, step: int) -> None:
        if self.group is not None and not self.group.leader:
            raise RuntimeError(f"tier {self.name!r}: only rank 0 deletes versions of a shared directory")
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
                self._index[step] = info  # still whole, still in place: retention tries again next time
            raise
        # The version is gone from the tier now; a failure below only leaves its bytes under .trash-.
        try:
            await _fsync_dir(self.root)
        except OSError:
            self._leftovers.add(trash)  # removed once the rename is durable, or at the next open
            raise
        error = await self._discard(trash)
        if error is not None:
            raise error

    async def close(self) -> None:
        if self.group is not None and self.group.leader:
            try:
                await aiofiles.os.remove(self.root / f"{_MEMBER}{self.group.run}")
            except OSError:
                pass  # swept at the next open
        self.executor.shutdown(wait=True)
        self._lock.release()

