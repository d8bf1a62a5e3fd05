"""This rank's part of a version on a stored tier: its data object written through the tier's codecs
(against a base, on a tier with ``delta``), its manifest, and what the leader's commit marker names.

:class:`PartWriting` is a part of :class:`~tierckpt.tiers.stored.tier.StoredTier`, kept apart: what it
uses of the tier is declared at its top. A base that cannot be read makes the part whole; a base chunk
found damaged while the part is written makes the tier write the part again, whole
(:mod:`~tierckpt.tiers.stored.delta`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

from tierckpt.errors import CorruptCheckpointError, LayoutError
from tierckpt.format import CommitMarker, Manifest, checksum
from tierckpt.format.lineage import lineage_of
from tierckpt.tiers.base import Lease, Part, Staged, VersionInfo, VersionSource
from tierckpt.tiers.stored.delta import BaseChoice, BaseUnreadable, DeltaBase, choose_base, open_base
from tierckpt.tiers.stored.write import write_data_file
from tierckpt.xordelta import DeltaCodec

if TYPE_CHECKING:
    from tierckpt.config import TierConfig
    from tierckpt.ranks import RankGroup
    from tierckpt.storage.store import ByteStore
    from tierckpt.tiers.stored.encoding import TierEncoding
    from tierckpt.tiers.stored.source import StoreVersion

log = logging.getLogger("tierckpt")

__all__ = ["PartWriting"]


class PartWriting:
    """Writing this rank's part of a version (see the module docstring)."""

    if TYPE_CHECKING:  # what it uses of the StoredTier it is part of
        config: TierConfig
        name: str
        group: RankGroup | None
        rank: int
        store: ByteStore
        sharing: tuple[int, ...] | None
        node_name: str | None
        encoding: TierEncoding
        executor: concurrent.futures.Executor
        _index: dict[int, VersionInfo]

        @property
        def direct(self) -> bool: ...

        @property
        def write_threads(self) -> int: ...

        def versions(self) -> list[VersionInfo]: ...

        def lease(self, step: int) -> Lease: ...

        def _at(self, step: int) -> str: ...

        async def _files(self, step: int) -> StoreVersion: ...

    async def _write_part(
        self, source: VersionSource, data: str, *, shared_by: tuple[int, ...] | None = None
    ) -> tuple[Manifest, bytes, BaseChoice | None]:
        """Write this rank's data object of ``source`` at key ``data`` of the store (the tier's codec,
        :attr:`write_threads` of its executor), and make its manifest; returns it and its bytes, not
        stored yet, and the base the version depends on (a tier with ``delta``; None: a whole version)."""
        choice = self._choose_base(source.step) if self.config.delta else None
        lease = self.lease(choice.step) if choice is not None else None  # the base stays while it is read
        named: tuple[int, int, int] | None = None  # the base a part written whole still names
        try:
            base = await self._open_base(choice) if choice is not None else None
            while True:
                encoding = self.encoding.begin(digests=self.config.delta is not None, delta=base)
                started = time.perf_counter()
                try:
                    records = await asyncio.to_thread(
                        write_data_file, source, data, encoding, self.executor, threads=self.write_threads, rank=self.rank, store=self.store,
                        shared_by=shared_by,
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

    def _choose_base(self, step: int) -> BaseChoice | None:
        """The base of the version of ``step`` about to be written (the same on every rank), or None."""
        assert self.config.delta is not None
        return choose_base(self.versions(), step, self.config.delta.full_every)

    async def _open_base(self, choice: BaseChoice) -> DeltaBase | None:
        """This rank's part of base ``choice.step``, open for the writer; None when it cannot be read
        (the part is then written whole, and a warning says why)."""
        assert self.config.delta is not None
        codec = DeltaCodec(self.config.compression.level, self.config.delta.min_ratio)
        world = self.group.world if self.group else 1
        try:
            if choice.step not in self._index:
                raise CorruptCheckpointError(f"{self._at(choice.step)} is gone", tier=self.name, step=choice.step)
            files = await self._files(choice.step)
            # Read through the page cache, not O_DIRECT: every version of a cycle reads the same base
            # chunks, and from the second on they come from memory (measured, full_every 10: a delta
            # version of a 95 MB state durable in 0.20-0.21 s instead of 0.25-0.27 s). The kernel takes
            # the memory back under pressure.
            return await asyncio.to_thread(open_base, files, choice, codec, tier=self.name, rank=self.rank, world=world, direct=False)
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
        lineage = lineage_of(source.metadata)
        if choice is None or (self.group is None and manifest.base is None):
            return Staged(source.step, location, manifest.stored_bytes, source.created, part, lineage=lineage)
        return Staged(source.step, location, manifest.stored_bytes, source.created, part, base=choice.step, chain=choice.chain, lineage=lineage)

    def _marker(self, staged: Staged, parts: Sequence[Part], metadata: dict[str, Any]) -> CommitMarker:
        """The leader's commit marker of a staged version: every rank's part, in rank order (a
        node-local tier's also names the ranks whose parts its directory holds, and its node)."""
        return CommitMarker(
            step=staged.step, created=staged.created, world_size=len(parts), ranks=tuple(parts), metadata=metadata,
            base=staged.base, chain=staged.chain, holds=self.sharing, node=self.node_name if self.sharing is not None else None,
        )

