"""The stored tier: versions in a :class:`~tierckpt.storage.store.ByteStore`, one container each
(format v2), written, committed, read back and deleted the same way over any store.

A :class:`StoredTier` holds the commit protocol once, over the store's operations:

1. :meth:`~StoredTier.write`: this rank's data object and manifest into a staging container
   (``.tmp-step-…-<write>``: a name of its own, or the one the ranks' leader chose), durable;
2. :meth:`~StoredTier.seal`, several ranks: the leader's commit marker, naming every rank's part;
3. :meth:`~StoredTier.commit`: the store's one commit primitive, ``publish``
   (:mod:`~tierckpt.tiers.stored.commit`): a rename into place and a directory fsync on a file
   system, the commit object put last on an object store; the earlier version of a step saved again
   goes once nothing reads it (:mod:`~tierckpt.tiers.stored.leftovers`);
4. :meth:`~StoredTier.delete`: ``withdraw`` (the version invisible at once), then ``remove``.

Opening sweeps what a crash left (:mod:`~tierckpt.tiers.stored.sweep`) and indexes the committed
versions; reading goes through :mod:`tierckpt.tiers.stored.read`, which trusts nothing a manifest
says. Of several ranks sharing the store, its *keeper* (rank 0; on a node-local tier, each node's
first rank) opens it first (locks, sweeps, indexes) and tells the others how that went before they
index what it left; only the keeper commits, removes and deletes: another rank removes only its own
objects of a version that was abandoned.

Any write, sync, publish or removal may fail (a full disk, a quota, EIO, EACCES, a store that does
not answer). Whatever fails, every committed version stays whole (in place; for a delete, in place or
aside), the index keeps saying what the store holds, the space of a failed write is given back (what
cannot be removed is retried before the next write, and swept at the next open), and the error names
the object.

The concrete tiers only make the store: :mod:`tierckpt.tiers.filesystem` (a directory),
:mod:`tierckpt.tiers.object.tier` (a bucket prefix); :mod:`tierckpt.tiers.nodelocal.tier` adds the
commit across nodes.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import uuid
from typing import TYPE_CHECKING, Any

from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format.lineage import lineage_of
from tierckpt.format import DATA_FILE, MANIFEST_FILE, RANK_MANIFEST_FILE, CommitMarker, Manifest, version_dirname
from tierckpt.storage.store import ByteStore
from tierckpt.tiers.base import GroupTier, Part, Staged, VersionInfo, VersionSource
from tierckpt.tiers.stored.commit import Left, PlaceFailed, place, take_back
from tierckpt.tiers.stored.delta import needed_by
from tierckpt.tiers.stored.encoding import TierEncoding
from tierckpt.tiers.stored.leftovers import Leftovers
from tierckpt.tiers.stored.part import PartWriting
from tierckpt.tiers.stored.read import read_head
from tierckpt.tiers.stored.reading import StoredReading
from tierckpt.tiers.stored.source import StoreVersion
from tierckpt.tiers.stored.sweep import MEMBER, sweep

if TYPE_CHECKING:
    from tierckpt.ranks import RankGroup

log = logging.getLogger("tierckpt")

__all__ = ["StoredTier"]


class StoredTier(StoredReading, PartWriting, GroupTier):
    """Versions in ``store``, one container each (see the module docstring); a subclass makes the store
    and says where it is."""

    # What a rank that finds another store than its keeper's is told every rank must see.
    shared_as = "the same store"
    located_by = "path"  # the tier's config key naming its store

    def __init__(self, config: TierConfig, group: RankGroup | None, store: ByteStore) -> None:
        super().__init__(config)
        self.group = group
        self.rank = group.rank if group else 0
        self.store = store
        self.encoding = TierEncoding(config.compression, config.name)
        self.keeps_replaced_bases = True  # see Tier: both stores keep an earlier write readable aside
        self.leftovers = Leftovers(store, config.name)
        self._index: dict[int, VersionInfo] = {}
        self.keeper = 0  # the rank (group position) opening, sweeping, committing, deleting here
        # Of a value stored once between ranks: the ranks sharing its chunks here (None: as saved), and
        # the node whose ranks they are (a node-local tier's).
        self.sharing: tuple[int, ...] | None = None
        self.node_name: str | None = None

    @property
    def keeps(self) -> bool:
        """Whether this rank is the store's keeper (a single process is)."""
        return self.group is None or self.rank == self.keeper

    @property
    def direct(self) -> bool:
        """Whether data objects are written and read with O_DIRECT (a file system that takes it)."""
        return self.store.direct

    @property
    def location(self) -> str:
        """The store, for messages: a directory, a bucket's URL."""
        return self.store.where("")

    @property
    def location_key(self) -> str:
        """The config key that names the store (``tiers.<name>.path``, ``tiers.<name>.url``)."""
        return f"tiers.{self.name}.{self.located_by}"

    @property
    @abc.abstractmethod
    def write_threads(self) -> int:
        """Threads of :attr:`executor` that encode and write a data object."""

    def _unusable(self, exc: OSError) -> ConfigError:
        """The store cannot be opened or listed."""
        return ConfigError(f"tier {self.name!r}: cannot use {self.location} ({exc})", tier=self.name, key=self.location_key)

    _open_key = property(lambda self: f"open/{self.name}")  # the keeper's word that it opened

    def versions(self) -> list[VersionInfo]:
        infos = [self._index[s] for s in sorted(self._index)]
        if self.config.delta is None and all(i.base is None for i in infos):
            return infos
        needs = needed_by(infos)
        return [dataclasses.replace(i, needed_by=needs[i.step]) if i.step in needs else i for i in infos]

    def _info(self, step: int, nbytes: int, created: float, *, head: Manifest | CommitMarker | Staged) -> VersionInfo:
        """A committed version's index entry, with the base it depends on as ``head`` names it."""
        base = head.base if isinstance(head, Staged) else head.base_step
        lineage = head.lineage if isinstance(head, Staged) else lineage_of(head.metadata)
        return VersionInfo(self.name, step, nbytes, created, self._at(step), base=base, chain=head.chain if base is not None else 0, lineage=lineage)

    def _at(self, step: int) -> str:
        """Where committed ``step`` is, for messages."""
        return self.store.where(version_dirname(step))

    # -- opening: the keeper first ------------------------------------------------------------------------

    async def open(self) -> None:
        if self.group is None:
            await self._open_keeper()
            return
        key = self._open_key
        if self.keeps:
            try:
                await self._open_keeper()
            except BaseException as exc:
                await self.group.put(key, f"{type(exc).__name__}: {exc}")
                raise
            await self.group.put(key, "")
            return
        if not await self.group.wait_for([key], self.group.timeout_s):
            raise ConfigError(f"tier {self.name!r}: rank {self.keeper} did not open {self.location} within {self.group.timeout_s:g} s", tier=self.name)
        problem = await self.group.get(key)
        if problem:
            raise ConfigError(f"tier {self.name!r}: rank {self.keeper} could not open it: {problem}", tier=self.name, key=self.location_key)
        await self._open_other()

    async def _open_keeper(self) -> None:
        """The keeper (or a single process): take the store, sweep what a crash left, index the rest."""
        await self._open()
        if self.group is not None:  # its mark that the others check they see the same store by
            await self.store.write_small(f"{MEMBER}{self.group.run}", b"")

    async def _open_other(self) -> None:
        """Any other rank, once the keeper opened the store: index what it left."""
        assert self.group is not None  # only a group has other ranks
        if not await self.store.exists(f"{MEMBER}{self.group.run}"):
            raise ConfigError(
                f"tier {self.name!r}: {self.location} is not what rank {self.keeper} opened: every rank must see {self.shared_as}",
                tier=self.name,
                key=self.location_key,
            )
        await self._open()

    async def _open(self) -> None:
        try:
            await self.store.open(exclusive=self.keeps)
        except OSError as exc:
            raise self._unusable(exc) from exc
        try:
            self._index.update(await sweep(self.store, self.name, leader=self.keeps, describe=self._describe, keep_aside=self._keep_aside))
        except OSError as exc:
            await self.store.close()
            raise self._unusable(exc) from exc
        except BaseException:
            await self.store.close()
            raise
        await self._drop_earlier()

    async def _describe(self, step: int, name: str) -> VersionInfo:
        """The index entry of committed ``step``, found at open under ``name``, its head verified."""
        try:
            head = await asyncio.to_thread(read_head, StoreVersion(self.store, name), tier=self.name, step=step)
            self._seen(step, head)
            return self._info(step, head.stored_bytes, head.created, head=head)
        except CorruptCheckpointError as exc:
            log.warning("%s; the version is kept, not deleted, and restores skip it", exc)  # exc names the tier and step
            return VersionInfo(self.name, step, 0, await self.store.mtime(name), self.store.where(name), valid=False)

    def _seen(self, step: int, head: Manifest | CommitMarker) -> None:
        """A committed version found at open, its head verified (a hook for subclasses)."""

    async def _keep_aside(self, step: int, name: str) -> bool:
        """At open, from the sweep: ``name``, ``step`` moved aside by a replacement, is kept for now; once
        the tier is indexed, :meth:`_drop_earlier` removes it unless a version depends on ``step``."""
        self.leftovers.keep(step, name)
        return True

    def _check_deletable(self, step: int) -> None:
        if not self.keeps:
            raise RuntimeError(f"tier {self.name!r}: only rank {self.keeper} deletes versions in {self.location}")
        if self.leased(step):
            raise RuntimeError(f"tier {self.name!r}: step {step} is leased and cannot be deleted")
        if dependents := sorted(v.step for v in self._index.values() if v.base == step and v.step != step):
            raise RuntimeError(f"tier {self.name!r}: step {step} is the base of step(s) {dependents}, which are kept: it cannot be deleted before them")

    # -- writing and committing -----------------------------------------------------------------------------

    async def write(self, source: VersionSource, staging: str | None = None) -> Staged:
        """Write this rank's part of ``source`` into a staging container, durably: ``staging`` when
        several ranks share it (each writes its own objects there), else a name of its own."""
        await self.leftovers.retry()
        await self._drop_earlier()
        tmp = staging or f".tmp-{version_dirname(source.step)}-{uuid.uuid4().hex[:12]}"
        ranked = self.group is not None
        data = f"{tmp}/{self.store.named(tmp, DATA_FILE.format(rank=self.rank))}"
        manifest_name = self.store.named(tmp, RANK_MANIFEST_FILE.format(rank=self.rank)) if ranked else MANIFEST_FILE
        await self.store.stage(tmp, shared=ranked)
        try:
            manifest, encoded, choice = await self._write_part(source, data, shared_by=self.sharing)
            await self.store.write_small(f"{tmp}/{manifest_name}", encoded)
            await self.store.sync(tmp)
        except BaseException:
            if ranked:
                await self._discard_part(data, f"{tmp}/{manifest_name}")
            else:
                await self.leftovers.discard(tmp)
            raise
        return self._staged(source, tmp, manifest, encoded, manifest_name, choice)

    async def seal(self, staged: Staged, parts: list[Part], metadata: dict[str, Any]) -> None:
        """The leader, once every rank's part is durable: write the commit marker into the staged version."""
        marker = self._marker(staged, parts, metadata)
        await self.store.write_small(f"{staged.location}/{MANIFEST_FILE}", marker.encode())
        await self.store.sync(staged.location)
        staged.nbytes = marker.stored_bytes

    async def commit(self, staged: Staged) -> VersionInfo:
        old = await self._place(staged)
        if old is not None:
            await self._set_aside(staged.step, old)
        return self._indexed(staged)

    async def _set_aside(self, step: int, old: str) -> None:
        """The earlier copy of ``step`` that committing it again moved aside (``old``): kept while it
        is still read (a restore, a flush) or written against, else removed."""
        if self.leased(step) or (self.keeps_replaced_bases and self._written_against(step)):
            self.leftovers.keep(step, old)
        else:
            await self.leftovers.discard(old)

    def _indexed(self, staged: Staged) -> VersionInfo:
        info = self._info(staged.step, staged.nbytes, staged.created, head=staged)
        self._index[staged.step] = info
        return info

    async def adopt(self, staged: Staged, nbytes: int) -> VersionInfo:
        """A follower: the leader committed the version this rank staged a part of; index it."""
        staged.nbytes = nbytes
        return self._indexed(staged)

    async def forget(self, step: int) -> None:
        """A follower: the leader deleted ``step``."""
        self._index.pop(step, None)

    async def _place(self, staged: Staged) -> str | None:
        """Publish a staged version, durably; returns where an older version of its step waits (None:
        there was none), for the caller to remove. Undone as far as the store allows when it fails:
        see :func:`~tierckpt.tiers.stored.commit.take_back`."""
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
            self._indexed(staged)
            if left.old_aside is not None and self._written_against(staged.step):
                self.leftovers.keep(staged.step, left.old_aside)  # versions depend on the old copy
            elif left.old_aside is not None:
                self.leftovers.failed.add(left.old_aside)  # the step is in place: the old copy goes once the store syncs
        elif left.old_aside is not None:
            self._index.pop(staged.step, None)  # put back when the tier next opens

    async def abort(self, staged: Staged) -> None:
        if self.keeps:
            await self.leftovers.discard(staged.location)
            return
        tmp = staged.location
        await self._discard_part(
            f"{tmp}/{self.store.named(tmp, DATA_FILE.format(rank=self.rank))}", f"{tmp}/{self.store.named(tmp, RANK_MANIFEST_FILE.format(rank=self.rank))}"
        )

    async def _discard_part(self, *keys: str) -> None:
        """A follower's objects of a version that will not be committed (the keeper removes the rest)."""
        for key in keys:
            try:
                await self.store.remove_object(key)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("tier %r: could not remove %s (%s); the store's keeper sweeps it", self.name, self.store.where(key), exc)

    # -- the earlier version of a step saved again ----------------------------------------------------------
    #
    # It stays while a restore or a flush reads the step, and, on a store that can keep it readable
    # (keeps_replaced_bases: a file system's .replaced-step-…, a bucket's older write with its commit
    # object copied aside; found by stored.read.find_base), while
    # differential versions written against it are kept; removed by the first write, delete, open or
    # close after that.

    def _written_against(self, step: int) -> bool:
        return any(v.base == step for v in self._index.values())

    def _needs_earlier(self, step: int) -> bool:
        """Whether the earlier copies of ``step`` are still read, or depended on: a version is written
        against an earlier version of ``step`` than the one in place (one committed before it)."""
        if self.leased(step):
            return True
        now = self._index.get(step)
        return self.keeps_replaced_bases and any(v.base == step and (now is None or v.created < now.created) for v in self._index.values())

    async def _drop_earlier(self) -> None:
        await self.leftovers.drop(self._needs_earlier)

    # -- deleting, closing -----------------------------------------------------------------------------------

    async def delete(self, step: int) -> None:
        self._check_deletable(step)
        info = self._index.pop(step, None)
        # Earlier copies of the step kept aside go first: with the step gone from its place, the next
        # open would take such a copy for a replacement a crash interrupted, and put it back. Those of
        # other steps (a base of this one, say) go only once it is gone.
        await self.leftovers.drop(lambda s: s != step or self._needs_earlier(s))
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
        # The version is gone from the tier now; a failure below only leaves its bytes aside.
        try:
            await self.store.sync()
        except OSError:
            self.leftovers.failed.add(trash)  # removed once the withdrawal is durable, or at the next open
            raise
        error = await self.leftovers.discard(trash)
        await self._drop_earlier()
        if error is not None:
            raise error

    async def close(self) -> None:
        try:
            if self.keeps:
                await self._drop_earlier()
            if self.group is not None and self.keeps:
                try:
                    await self.store.remove_object(f"{MEMBER}{self.group.run}")
                except OSError:
                    pass  # swept at the next open
        finally:
            self.executor.shutdown(wait=True)
            await self.store.close()
