"""The byte store under a tier: where a version's objects live and how their bytes move.

The stored tier decides *what* it stores (the format, the write plan, codecs, checksums, the commit
protocol, retention and the sweep: :mod:`tierckpt.tiers.stored.tier`, :mod:`~tierckpt.tiers.stored.write`,
:mod:`~tierckpt.tiers.stored.read`); a :class:`ByteStore` does *how* bytes get there. Two stores run
under that same tier code: the local file system (:class:`tierckpt.storage.local.LocalStore`:
O_DIRECT, ``pwritev``, ``fsync``, renames; a node-local tier's directory too) and an S3 bucket
(:class:`tierckpt.storage.s3store.BucketStore`: multipart uploads, ranged GETs, the commit object).

Names are ``/``-separated keys relative to the store's root: a *container* per version (``step-…``,
or a staging name such as ``.tmp-step-…``) holding *objects* (``step-…/manifest.msgpack``, data files).

A version's lifecycle, and the contract of each operation (in call order):

1. :meth:`ByteStore.open` once: create the root durably, learn what the medium can do.
2. :meth:`ByteStore.stage` a container under a temporary name, invisible to readers; several ranks
   may stage into one (``shared=True``).
3. :meth:`ByteStore.open_data` per data object: a :class:`DataWriter` executing a
   :class:`~tierckpt.storage.plan.WritePlan`'s items from several threads at once (large, positioned
   writes or parts); :meth:`DataWriter.finish` makes the object durable (one fsync; completing the
   multipart upload).
4. :meth:`ByteStore.write_small` a manifest: created new, durable when it returns.
5. :meth:`ByteStore.sync` a container: names created, renamed or removed in it are durable (an fsync
   of the directory; nothing to do where each write is durable on its own).
6. :meth:`ByteStore.publish` the staged container under its final name, atomically: a reader sees the
   whole version or none. This is the store's one commit primitive: a rename on a file system; on an
   object store, which has no rename, the container's commit object (its ``manifest.msgpack``, held
   back by :meth:`~ByteStore.write_small`) put last under the final name, over an older version's
   (:attr:`ByteStore.replaces_in_place`). :meth:`ByteStore.withdraw` is the reverse: the version stops
   being visible atomically (a rename aside; the commit object deleted first).
7. :meth:`ByteStore.remove` a container and all of it (after a withdraw, or a staged one never
   published), going on past failures; :meth:`ByteStore.list` names what is there, committed
   versions and leftovers alike, for the tier's sweep.

Object names: the tier names a data object or a rank's manifest through :meth:`ByteStore.named`, the
name it keeps once published, which manifests record. On a file system that is the name itself; an
object store, where the objects of two writes of one step lie side by side under the final name,
adds the write's id (``data-r00000.<write>.bin``).

Reading a committed version is the read half every store has (:class:`ReadableStore`, also for a
store only read, such as a version directory the CLI is handed): :meth:`ReadableStore.read_small` an
object whole (a manifest, refused past a limit before it is read), and :meth:`ReadableStore.open_reader`
a :class:`RangeReader`, byte ranges of one object into a caller's buffer. What is refused is the
store's to say: a symlink on a file system (it could lead out of the container), anything but a
regular file (:class:`Unreadable`); the tier's reader (:class:`~tierckpt.tiers.stored.source.StoreVersion`)
turns each failure into a damaged copy naming the tier, step and object.

Blocking methods (the reads, ``open_data`` and the writer's, the reader's) run in worker threads, never
on the engine loop; the ``async`` ones run on the engine loop and move no bulk bytes.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from tierckpt.storage.plan import WriteItem, WritePlan

__all__ = ["ByteStore", "DataWriter", "RangeReader", "ReadableStore", "RootEntry", "TooLarge", "Unreadable"]


@dataclass(frozen=True)
class RootEntry:
    """A name at the store's root: a container (a version, a staging area) or a single object."""

    name: str
    container: bool
    # Of a container: whether it holds its commit object, where the listing tells (None: ask the store).
    committed: bool | None = None


class DataWriter(abc.ABC):
    """One data object being written from a plan; :meth:`write` is called from several threads at once.

    Call order: :meth:`write` once per item of the plan (any order, concurrently), :meth:`finish`
    once they all returned, :meth:`close` always (also after a failure; the caller then removes the
    staged container). Every OSError names the object and what was being done.
    """

    @abc.abstractmethod
    def write(self, item: WriteItem, data: memoryview) -> None:
        """Store ``data`` (the item's stored bytes): at ``item.offset``, or packed when it has none."""

    @abc.abstractmethod
    def finish(self) -> tuple[int, ...]:
        """Make the object durable; returns where each item landed, by ``item.index``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the writer holds (descriptors, an unfinished upload)."""


class RangeReader(abc.ABC):
    """Byte ranges of one object, read from several threads at once (blocking); from
    :meth:`ReadableStore.open_reader`: on a file system, a descriptor opened relative to the container's
    (with O_DIRECT too where asked and taken); on an object store, ranged GETs, a few large ones where
    every chunk is read (:mod:`tierckpt.storage.coalesce`).
    """

    size: int

    @property
    @abc.abstractmethod
    def direct(self) -> bool:
        """Whether reads bypass a cache (O_DIRECT): aligned destinations are filled without a copy."""

    @abc.abstractmethod
    def read_span(self, offset: int, length: int, scratch: memoryview, *, what: str) -> memoryview:
        """Bytes ``[offset, offset + length)``, as a view of ``scratch`` (or of a new buffer if it is
        too small). Raises CorruptCheckpointError naming ``what`` when the object ends early."""

    def read_pieces(self, offset: int, length: int, scratch: memoryview, *, what: str) -> Sequence[memoryview]:
        """:meth:`read_span`'s bytes as consecutive pieces: a reader that fetched them in several
        buffers returns those rather than join them (see :mod:`~tierckpt.storage.coalesce`)."""
        return [self.read_span(offset, length, scratch, what=what)]

    @abc.abstractmethod
    def read_into(self, out: memoryview, offset: int, scratch: memoryview, *, what: str) -> None:
        """Fill ``out`` with the bytes at ``offset`` (``scratch``: room for a bounce when needed)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the object."""


class TooLarge(OSError):
    """An object larger than a whole read of it may be (known before a byte of it is read)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes, more than the {limit} allowed")
        self.size, self.limit = size, limit


class Unreadable(OSError):
    """What is at a key is not read: ``why`` says what it is (``"is a symlink (refused: ...)"``).

    ``filename``: the part of the key that was refused, the container or the object's name.
    """

    def __init__(self, why: str, filename: str) -> None:
        super().__init__(why)
        self.why, self.filename = why, filename


class ReadableStore(abc.ABC):
    """What reading committed versions needs of a store (blocking: from worker threads).

    Keys are ``<container>/<name>``. Errors: FileNotFoundError (``filename``: the container or the
    name that is not there), :class:`TooLarge`, :class:`Unreadable`, other OSErrors.
    """

    #: What its objects are called in messages ("data file", "data object").
    noun: str = "file"

    def url_of(self, key: str) -> str | None:
        """Where ``key`` is, for messages that the tier's name and step do not place (an object's URL)."""
        return None

    def containers_named(self, prefix: str) -> list[str]:
        """The containers whose names start with ``prefix``, sorted (blocking); a store that cannot
        list them from a reading thread has none to offer (the default)."""
        return []

    @abc.abstractmethod
    def read_small(self, key: str, limit: int) -> bytes:
        """Object ``key`` whole: refused (:class:`TooLarge`) before it is read when it has more than
        ``limit`` bytes; at most ``limit + 1`` bytes of an object growing meanwhile."""

    @abc.abstractmethod
    def open_reader(
        self, key: str, *, size: int | None = None, spans: Sequence[tuple[int, int]] = (), every_chunk: bool = True, direct: bool = False
    ) -> RangeReader:
        """A reader of object ``key``.

        ``size``: its size, when a listing gave it (an object store then sends no HEAD). ``spans``:
        the (offset, length) ranges that will be read, ``every_chunk``: all of them, in order
        (an object store fetches them in few large GETs). ``direct``: bypass the cache where the
        medium takes it (O_DIRECT; :attr:`RangeReader.direct` says whether it did).
        """


class ByteStore(ReadableStore):
    """Where a tier's objects live; see the module docstring for the operations' order and contract."""

    #: Whether data objects are written and read bypassing a cache (known after :meth:`open`).
    direct: bool = False
    #: Whether :meth:`publish` puts a version over the one of the same name at once (an object store's
    #: commit object); otherwise the older one must be withdrawn first, and ``final`` must not exist.
    replaces_in_place: bool = False

    def named(self, staging: str, name: str) -> str:
        """The name object ``name``, written into staging container ``staging``, keeps once published
        (see the module docstring): ``name`` itself unless the store tells writes apart by name."""
        return name

    def where(self, name: str) -> str:
        """Container ``name`` for messages and listings: a path, a URL."""
        return name

    async def contents(self, name: str) -> dict[str, int] | None:
        """Committed container ``name``'s objects and their sizes, where a listing saves a request per
        object read (an object store); None: readers ask the store for each."""
        return None

    async def mtime(self, name: str) -> float:
        """When container ``name`` was last changed (0.0: the store does not say)."""
        return 0.0

    @abc.abstractmethod
    async def open(self, *, exclusive: bool = False) -> None:
        """Create the root durably (its own name included) and learn the medium's capabilities.

        ``exclusive``: hold the root against other jobs until :meth:`close` (before anything is swept,
        so a job still writing here keeps its staged versions). Raises OSError when the root cannot
        be used, ConfigError when another job holds it.
        """

    @abc.abstractmethod
    async def list(self) -> list[RootEntry]:
        """What the root holds: committed versions and leftovers of interrupted writes alike."""

    @abc.abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether ``key`` (a container or an object) is there."""

    @abc.abstractmethod
    async def stage(self, name: str, *, shared: bool = False) -> None:
        """Create the staging container ``name``; ``shared``: other ranks may have created it already.

        Raises FileExistsError when it exists and is not ``shared``. Its name is the tier's
        (``.tmp-<final>-<write id>``): an object store, with no containers to make, takes the write id
        from it.
        """

    @abc.abstractmethod
    def open_data(self, key: str, plan: WritePlan) -> DataWriter:
        """Start writing data object ``key`` (new, or replacing a partial one) for ``plan`` (blocking)."""

    @abc.abstractmethod
    async def write_small(self, key: str, data: bytes) -> None:
        """Create object ``key`` (it must not exist) holding ``data``; durable when this returns.

        A staged container's commit object (``<staging>/manifest.msgpack``) on a store that
        :attr:`replaces_in_place` is held back instead, and put by :meth:`publish`."""

    @abc.abstractmethod
    async def sync(self, name: str = "") -> None:
        """Make the names in container ``name`` (the root: ``""``) durable."""

    @abc.abstractmethod
    async def publish(self, staging: str, final: str) -> str | None:
        """Make the staged container visible as ``final`` at once (``final`` must not exist, unless the
        store :attr:`replaces_in_place`).

        Durable after :meth:`sync` of the root. Returns the container under which the objects of the
        version it replaced wait for :meth:`remove` (None: it replaced none). Nothing moved if it
        raises, unless the store could not tell (an object store's request without an answer): the
        staged container is then kept through :meth:`remove`, for the next open to judge.
        """

    @abc.abstractmethod
    async def withdraw(self, final: str, aside: str) -> None:
        """Make the version ``final`` invisible at once, its objects kept under ``aside`` until removed.

        Raises FileNotFoundError when there is no ``final``; nothing moved if it raises.
        """

    @abc.abstractmethod
    async def remove(self, name: str) -> OSError | None:
        """Remove container ``name`` and everything in it, going on past entries that fail.

        Never raises: returns None once it is gone (or was never there), else the first error met.
        """

    @abc.abstractmethod
    async def remove_object(self, key: str) -> None:
        """Remove one object; raises FileNotFoundError when it is not there."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the store holds."""
