"""Reading a stored tier's committed versions: this rank's part, a whole version with every chunk this
rank restores (those other ranks stored included), and its saved layout, all through
:mod:`tierckpt.tiers.stored.read`, which trusts nothing a manifest says.

:class:`StoredReading` is a part of :class:`~tierckpt.tiers.stored.tier.StoredTier`, kept apart: what
it uses of the tier is declared at its top.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import CommitMarker, version_dirname
from tierckpt.format.saved_layout import SavedLayout
from tierckpt.tiers.base import VersionSource
from tierckpt.tiers.stored.layout import filesystem_layout
from tierckpt.tiers.stored.read import open_source, read_head, read_manifest, resolve_shared
from tierckpt.tiers.stored.source import StoredSource, StoreVersion

if TYPE_CHECKING:
    from tierckpt.ranks import RankGroup
    from tierckpt.storage.store import ByteStore

__all__ = ["StoredReading"]


class StoredReading:
    """Reading committed versions (see the module docstring)."""

    if TYPE_CHECKING:  # what it uses of the StoredTier it is part of
        name: str
        group: RankGroup | None
        rank: int
        store: ByteStore
        sharing: tuple[int, ...] | None

        @property
        def direct(self) -> bool: ...

        def _at(self, step: int) -> str: ...

    async def _files(self, step: int) -> StoreVersion:
        """Where committed ``step``'s objects are read from.

        Raises CorruptCheckpointError when they cannot even be found (an object store that fails to list)."""
        name = version_dirname(step)
        try:
            return StoreVersion(self.store, name, await self.store.contents(name))
        except OSError as exc:
            raise CorruptCheckpointError(f"step {step} on tier {self.name!r}: cannot be listed ({exc})", tier=self.name, step=step) from exc

    async def read(self, step: int) -> VersionSource:
        if self.sharing is not None:
            # A tier sharing values among some ranks only (a node-local tier: a node's) gives a flush
            # further down every chunk this rank saved, each value shared as it was saved, so that the
            # tier below shares it among every rank, as it does a version read from host memory.
            return await self.read_whole(step, as_saved=True)
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

