"""Where one committed version's objects are read from: the interface the readers of
:mod:`tierckpt.tiers.fsread` take, so that one reading path (manifest checks, records checked against
the objects, every chunk verified) serves a directory and an object store's container alike."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tierckpt.format import Manifest
    from tierckpt.tiers.fsread import StoredSource

__all__ = ["VersionFiles"]


class VersionFiles(Protocol):
    """Where one committed version's objects are read from: a directory (:class:`~tierckpt.tiers.fsread.LocalVersion`), or a
    container of an object store (:class:`~tierckpt.tiers.objread.ObjectVersion`). Blocking."""

    def read_small(self, name: str, *, tier: str | None, step: int | None) -> bytes:
        """A manifest-sized object, whole (refused past MAX_MANIFEST_BYTES): CorruptCheckpointError
        naming ``name`` when it is missing, too large or unreadable."""

    def open_source(self, tier: str | None, manifest: Manifest, *, direct: bool, every_chunk: bool = True) -> StoredSource:
        """The data objects ``manifest`` names, opened and checked against its records.

        ``every_chunk``: every chunk of the records will be read (a restore reads only the chunks it
        needs otherwise): an object store may then read each object in a few large windows."""
