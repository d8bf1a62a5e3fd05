"""An S3-compatible bucket as a :class:`~tierckpt.storage.store.ByteStore`: the commit object put last,
over the older one, and staging containers that exist only in names.

A bucket has no directories and no rename. A version's container ``step-…`` is a key prefix, and a
tier's staging container ``.tmp-step-…-<write>`` is *the same prefix*: what is written into it is
stored under its final key at once, told apart from another write of the same step by the write id
in its name (:meth:`BucketStore.named`: ``data-r00000.<write>.bin``, ``manifest-r00000.<write>.msgpack``).
Nothing of a write is visible until its commit object is: ``write_small`` of
``<staging>/manifest.msgpack`` is held back, and :meth:`BucketStore.publish` puts it under
``step-…/manifest.msgpack`` in one request, atomic, over the older write's (a reader finds the old
version or the new one, never half of one). The older write's objects then wait under a name of
their own, ``.replaced-step-…-<write>``, for :meth:`BucketStore.remove`; its commit object, copied
to ``head.<write>.msgpack`` just before the new one is put, is that name's ``manifest.msgpack``. The
older write stays a readable version there, as a file system's copy moved aside does, for as long as
the tier keeps it (versions written against it: :mod:`tierckpt.tiers.stored.delta`). A replacement
killed between the copy and the put leaves a copy of the commit object still in place: one small
object of that write, removed with it.

:meth:`BucketStore.list` shows the tier's sweep (:mod:`tierckpt.tiers.stored.sweep`) what a file
system would: a container holding a commit object as ``step-…``; each write its commit object does
not name as ``.replaced-step-…-<write>`` when its commit object was copied aside (an older write not
yet removed), else as a leftover ``.tmp-step-…-<write>`` (a crash before its commit); a container with
no commit object as ``step-…`` without one (swept whole).
Which writes a commit object names is the format's to say: the ``writes_of`` function the store is
given reads them (an unreadable commit object keeps every write: never delete what may be someone's
only copy).

Withdrawing deletes the commit object first (from then on it is not a version); :meth:`remove` then
takes the rest. A commit whose request got no answer is looked up before it is called failed: found
stored, it succeeded; not known, its staged objects stay (:meth:`remove` leaves them) for the next
open to judge by the commit object it finds.

Opening with ``exclusive`` takes the prefix's writer lease (:mod:`tierckpt.storage.s3lease`, the
bucket's counterpart of a directory lock), then aborts the multipart uploads a killed writer left
(invisible, yet stored and billed).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
from collections.abc import Callable, Sequence

from tierckpt.config import TierConfig
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.layout import MANIFEST_FILE, parse_version_dirname
from tierckpt.format.manifest import MAX_MANIFEST_BYTES
from tierckpt.storage.plan import WritePlan
from tierckpt.storage.s3 import Bucket, S3DataWriter
from tierckpt.storage.s3lease import LEASE_KEY, WriterLease
from tierckpt.storage.store import ByteStore, RangeReader, RootEntry

log = logging.getLogger("tierckpt")

__all__ = ["BucketStore", "write_of"]

# A container name of the tier's other than a version's: what it is, the version's container, the write.
_VIRTUAL = re.compile(r"^\.(tmp|replaced|trash)-(step-\d{12})-(.*)$")
_WRITE = re.compile(r"^(?:(?:data|manifest)-r\d{5}|head)\.([A-Za-z0-9_-]+)\.(?:bin|msgpack)$")
_ASIDE = "head.{write}.msgpack"  # a replaced write's commit object, copied aside
_REPLACED_OF = re.compile(r"^\.replaced-(step-\d{12})-$")
_NAMED = re.compile(r"^((?:data|manifest)-r\d{5})\.(bin|msgpack)$")


def write_of(name: str) -> str | None:
    """The write id in an object's name (None: the commit object, or a name of no write)."""
    match = _WRITE.match(name)
    return match.group(1) if match else None


class BucketStore(ByteStore, Bucket):
    """The bucket prefix of ``config.url`` as a tier's byte store (see the module docstring).

    ``writes_of``: the write ids a commit object's bytes name (raises CorruptCheckpointError when they
    cannot be decoded); ``tier`` names the tier in messages.
    """

    replaces_in_place = True

    def __init__(self, config: TierConfig, writes_of: Callable[[bytes], set[str]], *, tier: str) -> None:
        Bucket.__init__(self, config)
        self.tier = tier
        self.timeout_s = config.timeout_s
        self._writes_of = writes_of
        self._lease = WriterLease(self, tier)
        self._held_back: dict[str, bytes] = {}  # staging container -> its commit object, put by publish
        self._committed: dict[str, set[str]] = {}  # version container -> the writes its commit object names
        self._unknown: set[str] = set()  # staging containers whose commit may be stored: kept
        self._heads: dict[str, bytes] = {}  # commit objects list() read, for the reads of the same open

    # -- names ------------------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        """The bucket key (under the prefix) of ``key``, whose container may be a staging name (a
        replaced write's ``manifest.msgpack``: its commit object copied aside)."""
        container, sep, name = key.partition("/")
        match = _VIRTUAL.match(container)
        if match is None:
            return key
        if match.group(1) == "replaced" and name == MANIFEST_FILE:
            name = _ASIDE.format(write=match.group(3))
        return f"{match.group(2)}{sep}{name}"

    def named(self, staging: str, name: str) -> str:
        match, named = _VIRTUAL.match(staging), _NAMED.match(name)
        stored = f"{named.group(1)}.{match.group(3)}.{named.group(2)}" if match and named else ""
        if not _WRITE.match(stored):
            raise ValueError(f"{staging}/{name}: not a staged data object or rank manifest")
        return stored

    def where(self, name: str) -> str:
        return self.url_of(self._key(name))

    # -- opening and listing ----------------------------------------------------------------------------

    async def open(self, *, exclusive: bool = False) -> None:
        await self.listing(LEASE_KEY)  # the bucket, the credentials, the endpoint: one request
        if not exclusive:
            return
        await self._lease.acquire()
        try:
            aborted = await asyncio.to_thread(self.abort_uploads, "step-", self.timeout_s)
        except OSError as exc:
            log.warning("tier %r: incomplete uploads under %s not aborted (%s); the bucket's lifecycle rule expires them", self.tier, self.url, exc)
            return
        if aborted:
            log.info("tier %r: aborted %d incomplete upload(s) under %s left by a killed writer", self.tier, aborted, self.url)

    def containers_named(self, prefix: str) -> list[str]:
        """Of ``.replaced-step-…-``: the earlier writes of that step whose commit object waits aside."""
        match = _REPLACED_OF.match(prefix)
        if match is None:
            return []
        container = match.group(1)
        try:
            keys = self.keys_under(f"{container}/")
        except OSError as exc:  # a reader then finds no earlier copy, and says the base is gone
            log.warning("tier %r: could not list %s (%s)", self.tier, self.url_of(f"{container}/"), exc)
            return []
        asides = {write_of(k.rpartition("/")[2]) for k in keys if k.rpartition("/")[2].startswith("head.")}
        return sorted(f"{prefix}{w}" for w in asides if w)

    async def list(self) -> list[RootEntry]:
        entries = []
        containers: dict[str, dict[str, int]] = {}
        for key, size in (await self.listing()).items():
            container, _, name = key.partition("/")
            if not name:
                entries.append(RootEntry(key, False))  # the lease, a leader's member mark
            elif "/" not in name:  # deeper keys are no version's
                containers.setdefault(container, {})[name] = size
        for container, names in sorted(containers.items()):
            if parse_version_dirname(container) is None or MANIFEST_FILE not in names:
                entries.append(RootEntry(container, True, committed=False))
                continue
            entries.append(RootEntry(container, True, committed=True))
            writes = await self._read_writes(container)
            if writes is None:
                continue  # an unreadable commit object: every write is kept with it
            self._committed[container] = writes
            stray = {write_of(n) or "" for n in names if n != MANIFEST_FILE} - writes
            for w in sorted(stray):
                kind = "replaced" if _ASIDE.format(write=w) in names else "tmp"
                entries.append(RootEntry(f".{kind}-{container}-{w}", True))
        return entries

    async def _read_writes(self, container: str) -> set[str] | None:
        key = f"{container}/{MANIFEST_FILE}"
        try:
            head = await self.get(key, MAX_MANIFEST_BYTES)
        except OSError:
            return None  # the tier's own read of it says why
        self._heads[key] = head
        try:
            return self._writes_of(head)
        except CorruptCheckpointError:
            return None

    async def exists(self, key: str) -> bool:
        match = _VIRTUAL.match(key.partition("/")[0])
        container, _, name = self._key(key).partition("/")
        if name or (match is None and parse_version_dirname(container) is None):  # an object
            try:
                await self.head(self._key(key))
            except FileNotFoundError:
                return False
            return True
        names = await self.listing(f"{container}/")
        return any(write_of(k.rpartition("/")[2]) == match.group(3) for k in names) if match else bool(names)

    async def contents(self, name: str) -> dict[str, int] | None:
        return {k.rpartition("/")[2]: size for k, size in (await self.listing(f"{self._key(name)}/")).items()}

    # -- writing and committing -------------------------------------------------------------------------

    async def stage(self, name: str, *, shared: bool = False) -> None:
        if not name.startswith(".tmp-") or _VIRTUAL.match(name) is None:
            raise ValueError(f"{name!r} is not a staging container's name (.tmp-step-<12 digits>-<write>)")

    def open_data(self, key: str, plan: WritePlan) -> S3DataWriter:
        return S3DataWriter(self, self._key(key), plan)

    async def write_small(self, key: str, data: bytes) -> None:
        container, _, name = key.partition("/")
        if name == MANIFEST_FILE and container.startswith(".tmp-"):
            self._held_back[container] = data  # the commit: put by publish
            return
        await self.put(self._key(key), data)

    async def sync(self, name: str = "") -> None:
        pass  # each request is durable on its own

    async def publish(self, staging: str, final: str) -> str | None:
        match = _VIRTUAL.match(staging)
        assert match is not None and match.group(2) == final, f"{staging} is not a staging container of {final}"
        write = match.group(3)
        key = f"{final}/{MANIFEST_FILE}"
        if match.group(1) == "replaced":  # an earlier write put back (the sweep): its commit object, kept aside
            head: bytes | None = await self.get(self._key(f"{staging}/{MANIFEST_FILE}"), MAX_MANIFEST_BYTES)
        else:
            head = self._held_back.pop(staging, None)
        if head is None:
            raise FileNotFoundError(errno.ENOENT, "no commit object was written into it", self.url_of(key))
        older = self._committed.get(final, set()) - {write}
        if len(older) == 1:  # the version in place stays readable under its own name (see the module docstring)
            await self._copy_aside(key, next(iter(older)))
        self._heads.pop(key, None)
        try:
            await self.put(key, head)  # the commit: one atomic PUT
        except OSError as exc:
            try:  # a PUT can be stored and its answer lost: look before calling it failed
                stored = await self.get(key, MAX_MANIFEST_BYTES)
            except OSError:
                if not isinstance(exc, FileNotFoundError):
                    self._unknown.add(staging)
                raise exc from None
            if stored != head:
                raise
            log.info("tier %r: the commit object %s was stored though its request failed (%s)", self.tier, self.url_of(key), exc)
        self._committed[final] = {write}
        return f".replaced-{final}-{older.pop()}" if len(older) == 1 else None

    async def _copy_aside(self, key: str, write: str) -> None:
        """Copy commit object ``key`` (of ``write``) aside, before a newer write's is put over it."""
        head = self._heads.get(key)
        if head is None:
            try:
                head = await self.get(key, MAX_MANIFEST_BYTES)
            except FileNotFoundError:
                return  # withdrawn meanwhile: nothing to keep
        await self.put(f"{key.partition('/')[0]}/{_ASIDE.format(write=write)}", head)

    async def withdraw(self, final: str, aside: str) -> None:
        key = f"{final}/{MANIFEST_FILE}"
        self._heads.pop(key, None)
        await self.delete([key])  # first: from here on it is not a version
        self._committed.pop(final, None)

    async def remove(self, name: str) -> OSError | None:
        if name in self._unknown:
            log.warning("tier %r: %s may be committed after all; its objects stay until the tier next opens", self.tier, self.where(name))
            return None
        match = _VIRTUAL.match(name)
        container = self._key(name)
        try:
            keys: Sequence[str] = list(await self.listing(f"{container}/"))
            if match is not None and match.group(1) != "trash":  # one write's objects, not the commit object
                keys = [k for k in keys if (write_of(k.rpartition("/")[2]) or "") == match.group(3) and not k.endswith(f"/{MANIFEST_FILE}")]
            await self.delete(keys)
        except OSError as exc:
            return exc
        self._held_back.pop(name, None)
        return None

    async def remove_object(self, key: str) -> None:
        await self.delete([self._key(key)])

    # -- reading ----------------------------------------------------------------------------------------

    def read_small(self, key: str, limit: int) -> bytes:
        head = self._heads.pop(key, None)  # read by list() a moment ago, in the same open
        if head is not None and len(head) <= limit:
            return head
        return Bucket.read_small(self, self._key(key), limit)

    def open_reader(
        self, key: str, *, size: int | None = None, spans: Sequence[tuple[int, int]] = (), every_chunk: bool = True, direct: bool = False
    ) -> RangeReader:
        return Bucket.open_reader(self, self._key(key), size=size, spans=spans, every_chunk=every_chunk, direct=direct)

    async def close(self) -> None:
        await self._lease.release()
