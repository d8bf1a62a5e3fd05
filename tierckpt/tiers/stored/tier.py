"""What a filesystem tier and an object tier share: one container a version in a store (format v2),
read back through the same checks, and one keeper among the ranks that share the store.

A :class:`StoredTier` keeps an index of the committed versions, and reads a version (this rank's
part, a whole version with every chunk this rank restores, or its saved layout) from that version's
files, a directory or an object store's container (:meth:`StoredTier._files`), through
:mod:`tierckpt.tiers.stored.read`, which trusts nothing a manifest says. Of several ranks sharing the
store, its *keeper* (rank 0; on a node-local tier, each node's first rank) opens it first (locks,
sweeps what a crash left, indexes) and tells the others how that went before they index what it
left; only the keeper deletes.

How a version is written and made visible still differs between the stores: a rename into place
and a directory fsync (:mod:`tierckpt.tiers.filesystem`), or the commit object written last
(:mod:`tierckpt.tiers.object.tier`).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError, CorruptCheckpointError, LayoutError
from tierckpt.format import MANIFEST_FILE, CommitMarker, Manifest, checksum
from tierckpt.format.saved_layout import SavedLayout
from tierckpt.storage.store import DataStore
from tierckpt.tiers.base import GroupTier, Part, Staged, VersionInfo, VersionSource
from tierckpt.tiers.stored.delta import BaseChoice, BaseUnreadable, DeltaBase, choose_base, needed_by
from tierckpt.tiers.stored.encoding import TierEncoding
from tierckpt.tiers.stored.layout import filesystem_layout
from tierckpt.tiers.stored.read import open_source, read_head, read_manifest, resolve_shared
from tierckpt.tiers.stored.write import write_data_file
from tierckpt.tiers.stored.source import StoredSource, StoreVersion
from tierckpt.xordelta import DeltaCodec

if TYPE_CHECKING:
    from tierckpt.ranks import RankGroup

log = logging.getLogger("tierckpt")

__all__ = ["StoredTier"]


class StoredTier(GroupTier):
    """Versions in a store, one container each (see the module docstring); its subclasses write and
    commit them."""

    def __init__(self, config: TierConfig, group: RankGroup | None = None) -> None:
        super().__init__(config)
        self.group = group
        self.rank = group.rank if group else 0
        self.encoding = TierEncoding(config.compression, config.name)
        self._index: dict[int, VersionInfo] = {}
        self.keeper = 0  # the rank (group position) opening, sweeping, committing, deleting here

    @property
    def keeps(self) -> bool:
        """Whether this rank is the store's keeper (a single process is)."""
        return self.group is None or self.rank == self.keeper

    @property
    def direct(self) -> bool:
        """Whether data is read with O_DIRECT (a file system that takes it)."""
        return False

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """The store, for messages: a directory, a bucket's URL."""

    @property
    @abc.abstractmethod
    def location_key(self) -> str:
        """The config key that names the store (``tiers.<name>.path``, ``tiers.<name>.url``)."""

    _open_key = property(lambda self: f"open/{self.name}")  # the keeper's word that it opened

    def versions(self) -> list[VersionInfo]:
        infos = [self._index[s] for s in sorted(self._index)]
        if self.config.delta is None and all(i.base is None for i in infos):
            return infos
        needs = needed_by(infos)
        return [dataclasses.replace(i, needed_by=needs[i.step]) if i.step in needs else i for i in infos]

    def _info(self, step: int, nbytes: int, created: float, at: str | None, *, head: Manifest | CommitMarker | Staged) -> VersionInfo:
        """A committed version's index entry, with the base it depends on as ``head`` names it."""
        base = head.base if isinstance(head, Staged) else head.base_step
        return VersionInfo(self.name, step, nbytes, created, at, base=base, chain=head.chain if base is not None else 0)

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

    @abc.abstractmethod
    async def _open_keeper(self) -> None:
        """The keeper (or a single process): take the store, sweep what a crash left, index the rest."""

    @abc.abstractmethod
    async def _open_other(self) -> None:
        """Any other rank, once the keeper opened the store: index what it left."""

    def _check_deletable(self, step: int) -> None:
        if not self.keeps:
            raise RuntimeError(f"tier {self.name!r}: only rank {self.keeper} deletes versions in {self.location}")
        if self.leased(step):
            raise RuntimeError(f"tier {self.name!r}: step {step} is leased and cannot be deleted")

    # -- writing ------------------------------------------------------------------------------------------

    async def _write_part(
        self, source: VersionSource, data: str, store: DataStore, *, threads: int, shared_by: tuple[int, ...] | None = None
    ) -> tuple[Manifest, bytes, BaseChoice | None]:
        """Write this rank's data object of ``source`` at key ``data`` of ``store`` (the tier's codec,
        ``threads`` of its executor), and make its manifest; returns it and its bytes, not stored yet,
        and the base the version depends on (a tier with ``delta``; None: a whole version)."""
        choice = choose_base(self.versions(), source.step, self.config.delta.full_every) if self.config.delta else None
        lease = self.lease(choice.step) if choice is not None else None  # the base stays while it is read
        named: tuple[int, int, int] | None = None  # the base a part written whole still names
        try:
            base = await self._open_base(choice) if choice is not None else None
            while True:
                encoding = self.encoding.begin(digests=self.config.delta is not None, delta=base)
                started = time.perf_counter()
                try:
                    records = await asyncio.to_thread(
                        write_data_file, source, data, encoding, self.executor, threads=threads, rank=self.rank, store=store, shared_by=shared_by
                    )
                    break
                except BaseUnreadable as exc:
                    assert base is not None and choice is not None
                    log.warning("tier %r: writing step %d again, whole: its base is damaged (%s)", self.name, source.step, exc)
                    if self.group is None and choice.step in self._index:  # no later version is written against it
                        self._index[choice.step] = dataclasses.replace(self._index[choice.step], valid=False)
                    # Of several ranks, this part still names the base (its manifest verified): the other
                    # ranks' chunks this part's readers resolve are stored against it. Every rank's index
                    # stays the same, so that every rank picks the same base next time.
                    named = (base.step, base.checksum, base.chain) if self.group is not None else None
                    base.close()
                    base = None
                finally:
                    if base is not None:
                        base.close()
        finally:
            if lease is not None:
                lease.release()
        self.encoding.finish(encoding, time.perf_counter() - started)
        world = self.group.world if self.group else 1
        if base is not None:
            named = (base.step, base.checksum, base.chain)
        manifest = Manifest(
            source.step, source.created, source.skeleton, records, source.metadata, world_size=world, rank=self.rank,
            base=named[:2] if named is not None else None, chain=named[2] if named is not None else 0,
        )
        return manifest, manifest.encode(), choice

    async def _open_base(self, choice: BaseChoice) -> DeltaBase | None:
        """This rank's part of base ``choice.step``, open for the writer; None when it cannot be read
        (the part is then written whole, and a warning says why)."""
        assert self.config.delta is not None
        world = self.group.world if self.group else 1
        delta = self.config.delta
        level = self.config.compression.level

        def opened(files: StoreVersion) -> DeltaBase | None:
            manifest = read_manifest(files, tier=self.name, step=choice.step, rank=self.rank, world=world)
            if world > 1:  # its marker records this rank's manifest's checksum, and resolves the shared chunks
                head = read_head(files, tier=self.name, step=choice.step)
                assert isinstance(head, CommitMarker)  # read_manifest checked the world
                identity = head.ranks[self.rank][1]
                manifest = resolve_shared(files, head, manifest, tier=self.name)
            else:
                identity = checksum(files.read_small(MANIFEST_FILE, tier=self.name, step=choice.step))
            if not any(c is not None and c.digest is not None for r in manifest.records for c in r.chunks):
                return None  # written before delta was set: no digests to refer to, nothing to write against
            source = open_source(self.name, files, manifest, direct=self.direct)
            return DeltaBase(choice.step, choice.chain, identity, source, DeltaCodec(level, delta.min_ratio))

        try:
            if choice.step not in self._index:
                raise CorruptCheckpointError(f"{self._at(choice.step)} is gone", tier=self.name, step=choice.step)
            return await asyncio.to_thread(opened, await self._files(choice.step))
        except (CorruptCheckpointError, LayoutError) as exc:
            log.warning("tier %r: writing this version whole: its base, step %d, cannot be read (%s)", self.name, choice.step, exc)
            return None

    def _staged(
        self, source: VersionSource, location: Any, manifest: Manifest, encoded: bytes, manifest_name: str, choice: BaseChoice | None = None
    ) -> Staged:
        """What :meth:`write` returns: where the version is staged, and, of several ranks, this rank's
        :class:`Part` (its manifest's name and checksum) for the leader's commit marker; ``choice``:
        the base the tier chose for it (every rank's the same, whether or not this part used it)."""
        part = Part(manifest_name, checksum(encoded), manifest.stored_bytes) if self.group is not None else None
        if choice is None or (self.group is None and manifest.base is None):
            return Staged(source.step, location, manifest.stored_bytes, source.created, part)
        return Staged(source.step, location, manifest.stored_bytes, source.created, part, base=choice.step, chain=choice.chain)

    def _marker(self, staged: Staged, parts: Sequence[Part], metadata: dict[str, Any]) -> CommitMarker:
        """The leader's commit marker of a staged version: every rank's part, in rank order."""
        return CommitMarker(
            step=staged.step, created=staged.created, world_size=len(parts), ranks=tuple(parts), metadata=metadata,
            base=staged.base, chain=staged.chain,
        )

    # -- reading ------------------------------------------------------------------------------------------

    @abc.abstractmethod
    async def _files(self, step: int) -> StoreVersion:
        """Where committed ``step``'s files are read from.

        Raises CorruptCheckpointError when they cannot even be found (an object store that fails to list)."""

    @abc.abstractmethod
    def _at(self, step: int) -> str:
        """Where committed ``step`` is, for messages."""

    async def read(self, step: int) -> VersionSource:
        files = await self._files(step)
        world = self.group.world if self.group else 1

        def opened() -> StoredSource:
            # The manifest is opened without following a symlink and sized before it is read.
            manifest = read_manifest(files, tier=self.name, step=step, rank=self.rank, world=world)
            return open_source(self.name, files, manifest, direct=self.direct)

        return await asyncio.to_thread(opened)

    async def read_whole(self, step: int, *, as_saved: bool = False) -> VersionSource:
        # as_saved: each value shared as it was saved (TensorRecord.as_saved), for a flush further down.
        if self.group is None:
            return await self.read(step)  # one process's version holds every chunk it restores
        files = await self._files(step)
        world = self.group.world

        def whole() -> StoredSource:
            manifest = read_manifest(files, tier=self.name, step=step, rank=self.rank, world=world)
            head = read_head(files, tier=self.name, step=step)
            resolved = resolve_shared(files, head, manifest, tier=self.name) if isinstance(head, CommitMarker) else manifest
            if as_saved:
                resolved = dataclasses.replace(resolved, records=tuple(r.as_saved() for r in resolved.records))
            return open_source(self.name, files, resolved, direct=self.direct)

        return await asyncio.to_thread(whole)

    async def read_layout(self, step: int, rank: int) -> SavedLayout:
        files = await self._files(step)
        layout = await asyncio.to_thread(filesystem_layout, self.name, files, rank, direct=self.direct)
        if layout.step != step:
            raise CorruptCheckpointError(f"{self._at(step)}: its manifest records step {layout.step}", tier=self.name, step=step)
        return layout
