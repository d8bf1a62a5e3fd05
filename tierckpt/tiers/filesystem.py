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
sweeping it: the step keeps its old, committed content rather than vanishing (:mod:`~tierckpt.tiers.stored.sweep`;
the renames: :mod:`~tierckpt.tiers.stored.commit`).

This class decides what is stored and in which order it becomes durable and visible; every write,
rename and removal goes through :attr:`FilesystemTier.store`, a :class:`~tierckpt.storage.store.ByteStore`
(the local file system, :class:`~tierckpt.storage.local.LocalStore`): a rename into place is its
``publish``, a rename aside its ``withdraw``, an fsync of a directory its ``sync``, and reads go
through its read half (:class:`~tierckpt.storage.localread.LocalFiles`: no symlink is followed).

Reading (:mod:`tierckpt.tiers.stored.read`) trusts nothing a manifest says: files are opened without following
symlinks, and records are checked against the files before anything is allocated or read.

Any write, fsync, rename or removal may fail (a full disk, a quota, EIO, EACCES): see the comment above
:meth:`FilesystemTier.write` for what a failure leaves behind.

Several ranks (a :class:`~tierckpt.ranks.RankGroup`) share the tier's directory. Every rank writes its
data file and its rank manifest into one staging directory whose name the leader's decision fixes;
once every rank reported its part durable, the leader writes the commit marker there (:meth:`seal`)
and renames the directory into place (:meth:`commit`); the other ranks only index it (:meth:`adopt`).
Only the directory's *keeper* (rank 0; on a node-local tier, each node's first rank:
:mod:`~tierckpt.tiers.nodelocal.tier`) sweeps, locks, deletes and renames: another rank never removes
anything but its own files of a version that was abandoned.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiofiles.os

from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import (
    DATA_FILE,
    MANIFEST_FILE,
    RANK_MANIFEST_FILE,
    CommitMarker,
    Manifest,
    version_dirname,
)
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.base import Part, Staged, VersionInfo, VersionSource
from tierckpt.tiers.stored.read import read_head
from tierckpt.tiers.stored.source import StoreVersion
from tierckpt.tiers.stored.commit import Left, PlaceFailed, place, take_back
from tierckpt.tiers.stored.sweep import MEMBER, KeepAside, sweep
from tierckpt.tiers.stored.tier import StoredTier

log = logging.getLogger("tierckpt")

_read_head = aiofiles.os.wrap(read_head)
_lstat = aiofiles.os.wrap(os.lstat)

if TYPE_CHECKING:
    from tierckpt.ranks import RankGroup


class FilesystemTier(StoredTier):
    """Versions as directories under ``config.path`` (relative paths resolve against the working directory)."""

    keeps_replaced_bases = True

    def __init__(self, config: TierConfig, group: RankGroup | None = None) -> None:
        super().__init__(config, group)
        assert config.path is not None  # guaranteed by TierConfig validation
        self.root = Path(config.path).expanduser().absolute()
        self.executor = concurrent.futures.ThreadPoolExecutor(
            config.io_threads, thread_name_prefix=f"tierckpt-io-{config.name}"
        )
        self.store = LocalStore(self.root, self.executor, tier=config.name)
        self._leftovers: set[str] = set()  # containers a failed removal left: retried before each write
        self._bases_aside: dict[int, set[str]] = {}  # of a step saved again: its earlier versions kept aside
        # Of a value stored once between ranks: the ranks sharing its chunks here (None: as saved).
        self.sharing: tuple[int, ...] | None = None

    @property
    def direct(self) -> bool:
        """Whether data files are written and read with O_DIRECT (probed when the tier opens)."""
        return self.store.direct

    @property
    def location(self) -> str:
        return repr(str(self.root))

    @property
    def location_key(self) -> str:
        return f"tiers.{self.name}.path"

    async def _open_keeper(self) -> None:
        await self._open()
        if self.group is not None:  # its mark that the others check they see the same directory by
            await self.store.write_small(f"{MEMBER}{self.group.run}", b"")

    async def _open_other(self) -> None:
        assert self.group is not None  # only a group has other ranks
        if not await self.store.exists(f"{MEMBER}{self.group.run}"):
            raise ConfigError(
                f"tier {self.name!r}: {str(self.root)!r} is not the directory rank {self.keeper} opened: every rank must "
                "see the same directory (a shared file system, or one node's disk for all its ranks)",
                tier=self.name,
                key=f"tiers.{self.name}.path",
            )
        await self._open()

    async def _open(self) -> None:
        leader = self.keeps
        try:
            await self.store.open(exclusive=leader)
        except OSError as exc:
            raise ConfigError(
                f"tier {self.name!r}: cannot use {str(self.root)!r} as a checkpoint directory ({exc.strerror or exc})",
                tier=self.name,
                key=f"tiers.{self.name}.path",
            ) from exc
        if not self.direct:
            log.info("tier %r: %s refuses O_DIRECT; writing through the page cache", self.name, self.root)
        self._index.update(await sweep(self.store, self.name, leader=leader, describe=self._describe, keep_aside=self._keep_aside))
        if self._bases_aside:
            await self._drop_bases_aside()

    async def _describe(self, step: int, name: str) -> VersionInfo:
        path = self.root / name
        try:
            head = await _read_head(StoreVersion(self.store, name), tier=self.name, step=step)
            self._seen(step, head)
            return self._info(step, head.stored_bytes, head.created, str(path), head=head)
        except CorruptCheckpointError as exc:
            log.warning("tier %r: %s", self.name, exc)
            stat = await _lstat(path)  # it may be a symlink, refused: not followed here either
            return VersionInfo(self.name, step, 0, stat.st_mtime, str(path), valid=False)

    @property
    def _keep_aside(self) -> KeepAside | None:
        """See stored.sweep.sweep: an earlier base is kept aside while versions depend on it, whether or
        not ``delta`` is still set (a node-local tier keeps such copies for its own reason)."""
        return self._keep_base_aside

    def _seen(self, step: int, head: Manifest | CommitMarker) -> None:
        """A committed version found at open, its head verified (a hook for subclasses)."""

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
        tmp = staging or f".tmp-{version_dirname(source.step)}-{uuid.uuid4().hex[:12]}"
        ranked = self.group is not None
        data = f"{tmp}/{DATA_FILE.format(rank=self.rank)}"
        manifest_name = RANK_MANIFEST_FILE.format(rank=self.rank) if ranked else MANIFEST_FILE
        manifest_key = f"{tmp}/{manifest_name}"
        await self.store.stage(tmp, shared=ranked)
        try:
            manifest, encoded, choice = await self._write_part(source, data, self.store, threads=self.config.io_threads, shared_by=self.sharing)
            await self.store.write_small(manifest_key, encoded)
            await self.store.sync(tmp)
        except BaseException:
            if ranked:
                await self._discard_part(data, manifest_key)
            else:
                await self._discard(tmp)
            raise
        return self._staged(source, tmp, manifest, encoded, manifest_name, choice)

    async def seal(self, staged: Staged, parts: list[Part], metadata: dict[str, Any]) -> None:
        """The leader, once every rank's part is durable: write the commit marker into the staged version."""
        marker = self._marker(staged, parts, metadata)
        await self.store.write_small(f"{staged.location}/{MANIFEST_FILE}", marker.encode())
        await self.store.sync(staged.location)
        staged.nbytes = marker.stored_bytes

    async def adopt(self, staged: Staged, nbytes: int) -> VersionInfo:
        """A follower: the leader committed the version this rank staged a part of; index it."""
        info = self._info(staged.step, nbytes, staged.created, str(self.root / version_dirname(staged.step)), head=staged)
        self._index[staged.step] = info
        return info

    async def forget(self, step: int) -> None:
        """A follower: the leader deleted ``step``."""
        self._index.pop(step, None)

    async def _discard_part(self, *keys: str) -> None:
        """A follower's files of a version that will not be committed (the leader removes the directory)."""
        for key in keys:
            try:
                await self.store.remove_object(key)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("tier %r: could not remove %s (%s); the directory's keeper sweeps it", self.name, self.root / key, exc)

    async def commit(self, staged: Staged) -> VersionInfo:
        needed = self._written_against(staged.step)
        old = await self._place(staged)
        if old is not None:
            if needed:  # versions written against the version of this step just replaced: it stays aside for them
                self._bases_aside.setdefault(staged.step, set()).add(old)
            else:
                await self._discard(old)
        return self._indexed(staged)

    # -- the earlier version of a step saved again, kept aside for the versions written against it ---------
    #
    # A differential version names its base by step and by the checksum of the base's manifest. When the
    # base's step is saved again, the version moved aside under .replaced-step-… (stored.commit.place) is
    # kept while any version of this tier depends on that step (stored.read.find_base looks there), and
    # removed after the prune that ends the last of them, or at an open that finds none.

    def _written_against(self, step: int) -> bool:
        return any(v.base == step for v in self._index.values())

    def _written_against_earlier(self, step: int) -> bool:
        """Whether a version depends on an earlier version of ``step`` than the one in place: one saved
        before it (a version is written against a base only once that base is committed)."""
        now = self._index.get(step)
        return any(v.base == step and (now is None or v.created < now.created) for v in self._index.values())

    async def _keep_base_aside(self, step: int, name: str) -> bool:
        """At open, from the sweep: ``name`` (``step`` moved aside by a replacement) is kept for now; once
        the tier is indexed, :meth:`_drop_bases_aside` removes it unless a version depends on ``step``."""
        self._bases_aside.setdefault(step, set()).add(name)
        return True

    async def _drop_bases_aside(self) -> None:
        for step in [s for s in self._bases_aside if not self._written_against_earlier(s)]:
            for name in sorted(self._bases_aside.pop(step)):
                await self._discard(name)

    def _indexed(self, staged: Staged) -> VersionInfo:
        info = self._info(staged.step, staged.nbytes, staged.created, str(self.root / version_dirname(staged.step)), head=staged)
        self._index[staged.step] = info
        return info

    async def _place(self, staged: Staged) -> str | None:
        """Rename a staged version into place, durably; returns where an older version of its step was
        moved aside (None: there was none), for the caller to remove. Undone as far as the disk allows
        when it fails: see :func:`~tierckpt.tiers.stored.commit.take_back`."""
        try:
            return await place(self.store, staged.location, version_dirname(staged.step), tier=self.name)
        except PlaceFailed as exc:
            self._after_take_back(staged, exc.left)
            assert exc.__cause__ is not None
            raise exc.__cause__ from None

    async def _undo_commit(self, staged: Staged, old: str | None) -> None:
        """Take back a version :meth:`_place` put in place (its older copy ``old`` back in its place)."""
        self._after_take_back(staged, await take_back(self.store, staged.location, version_dirname(staged.step), old, moved=True, tier=self.name))

    def _after_take_back(self, staged: Staged, left: Left) -> None:
        if left.new_in_place:
            self._index[staged.step] = self._info(staged.step, staged.nbytes, staged.created, str(self.root / version_dirname(staged.step)), head=staged)
            if left.old_aside is not None and self._written_against(staged.step):
                self._bases_aside.setdefault(staged.step, set()).add(left.old_aside)  # versions depend on the old copy
            elif left.old_aside is not None:
                self._leftovers.add(left.old_aside)  # the step is in place: the old copy goes once the directory syncs
        elif left.old_aside is not None:
            self._index.pop(staged.step, None)  # put back when the tier next opens

    async def abort(self, staged: Staged) -> None:
        if not self.keeps:
            await self._discard_part(
                f"{staged.location}/{DATA_FILE.format(rank=self.rank)}", f"{staged.location}/{RANK_MANIFEST_FILE.format(rank=self.rank)}"
            )
            return
        await self._discard(staged.location)

    async def _discard(self, name: str) -> OSError | None:
        """Remove a temporary, trashed or moved-aside directory; what will not go is retried later.

        Never raises: returns the first error when part of ``name`` is left.
        """
        error = await self.store.remove(name)
        if error is None:
            self._leftovers.discard(name)
            return None
        self._leftovers.add(name)
        log.warning(
            "tier %r: could not remove all of %s (%s); retried before the next write, and swept when the tier next opens",
            self.name, name, error,
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
            await self.store.sync()
        except OSError as exc:
            log.warning("tier %r: leftovers not swept: %s", self.name, exc)
            return
        for name in sorted(self._leftovers):
            if await self.store.remove(name) is None:
                self._leftovers.discard(name)
                log.info("tier %r: swept %s, left by an earlier failure", self.name, name)

    async def _files(self, step: int) -> StoreVersion:
        return StoreVersion(self.store, version_dirname(step))

    def _at(self, step: int) -> str:
        return str(self.root / version_dirname(step))

    async def delete(self, step: int) -> None:
        self._check_deletable(step)
        info = self._index.pop(step, None)
        final = version_dirname(step)
        trash = f".trash-{final}-{uuid.uuid4().hex[:12]}"
        try:
            await self.store.withdraw(final, trash)
        except FileNotFoundError:
            return
        except BaseException:
            if info is not None:
                self._index[step] = info  # still whole, still in place: retention tries again next time
            raise
        # The version is gone from the tier now; a failure below only leaves its bytes under .trash-.
        try:
            await self.store.sync()
        except OSError:
            self._leftovers.add(trash)  # removed once the rename is durable, or at the next open
            raise
        error = await self._discard(trash)
        await self._drop_bases_aside()
        if error is not None:
            raise error

    async def close(self) -> None:
        if self.group is not None and self.keeps:
            try:
                await self.store.remove_object(f"{MEMBER}{self.group.run}")
            except OSError:
                pass  # swept at the next open
        self.executor.shutdown(wait=True)
        await self.store.close()
