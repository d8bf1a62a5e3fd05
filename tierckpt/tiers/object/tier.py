"""An object tier: versions in an S3-compatible bucket, under ``url: s3://bucket/prefix``.

Keys (the format of a filesystem tier, with a write id in the data and rank manifest names)::

    <prefix>/step-000000000005/manifest.msgpack                  the commit object, written last
    <prefix>/step-000000000005/data-r00000.<write>.bin           rank 0's data object
    <prefix>/step-000000000005/manifest-r00000.<write>.msgpack   rank 0's manifest (several ranks)
    <prefix>/.writer-lease                                        the Checkpointer writing here

An object store has no rename, so nothing is staged under another name and moved: every data object
is uploaded (one multipart upload each, :class:`~tierckpt.storage.s3.S3DataWriter`) under its final
key, with a *write id* (the ranks' shared staging decision, or a fresh one) that no other write of the
step uses. **The version is committed when its commit object ``manifest.msgpack`` is written**: the
single process's manifest, or the commit marker naming each rank's manifest by name and checksum, put
in one request after every data object completed. A PUT is atomic, so a reader finds the old version
or the new one, never half of one. Saving a step again overwrites the commit object; the objects of
the older write go afterwards (later, when a restore still reads them).

Deleting removes the commit object first, then the rest: a reader never finds a commit object whose
data is gone. What a crash leaves (a container without a commit object; objects of a write the commit
object does not name; incomplete multipart uploads, aborted through
:mod:`~tierckpt.storage.s3uploads`) is swept when the tier opens, by the Checkpointer holding the
writer lease. A commit object that does not verify is kept (never delete what may be someone's only copy)
and listed invalid.

Two Checkpointers writing one prefix would sweep each other's writes: the first takes the lease
object with a conditional PUT (``If-None-Match: *``) and renews it every :data:`RENEW_S`; a second is
refused with a ConfigError naming the holder. A lease not renewed for :data:`STALE_S` (its holder
died), or held by a process of this host that no longer exists, is taken over (a conditional PUT on
its ETag, so two successors cannot both win).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import MANIFEST_FILE, CommitMarker, Manifest, decode_document, version_dirname
from tierckpt.format.manifest import MAX_MANIFEST_BYTES
from tierckpt.storage.s3 import Bucket
from tierckpt.tiers.base import Part, Staged, VersionInfo, VersionSource
from tierckpt.tiers.object.lease import WriterLease
from tierckpt.tiers.object.read import containers
from tierckpt.tiers.stored.source import StoreVersion
from tierckpt.tiers.stored.tier import StoredTier

if TYPE_CHECKING:
    from tierckpt.ranks import RankGroup

log = logging.getLogger("tierckpt")

__all__ = ["ObjectTier"]

_WRITE = re.compile(r"^(?:data|manifest)-r\d{5}\.([A-Za-z0-9_-]+)\.(?:bin|msgpack)$")


def write_of(name: str) -> str | None:
    """The write id in an object's name (None: the commit object, or a name of no write)."""
    match = _WRITE.match(name)
    return match.group(1) if match else None


def referenced_writes(head: Manifest | CommitMarker) -> set[str]:
    """The writes a commit object names: its records' data objects, or its ranks' manifests."""
    names = {r.file for r in head.records} if isinstance(head, Manifest) else {part[0] for part in head.ranks}
    return {w for w in map(write_of, names) if w is not None}


@dataclass
class _Write:
    """What one rank wrote of one version: the keys to remove if it is not committed."""

    container: str
    write: str
    keys: list[str]
    head: bytes | None = None  # the commit object, once known (a single process: its manifest)
    # The commit's PUT failed without an answer: it may have been stored all the same, so these
    # objects are left for the next open to judge by the commit object it finds.
    uncertain: bool = False


@dataclass
class _CommittedWrites:
    """A committed version's writes: the one its commit object names, and older ones still to remove."""

    writes: set[str]
    stale: set[str] = field(default_factory=set)


class ObjectTier(StoredTier):
    """Versions in a bucket (see the module docstring). Several ranks: rank 0 holds the lease, sweeps,
    commits and deletes; every rank uploads its own part."""

    def __init__(self, config: TierConfig, group: RankGroup | None = None) -> None:
        super().__init__(config, group)
        self.bucket = Bucket(config)
        self.executor = concurrent.futures.ThreadPoolExecutor(config.concurrency, thread_name_prefix=f"tierckpt-s3-{config.name}")
        self._held: dict[int, _CommittedWrites] = {}
        self._lease = WriterLease(self.bucket, config.name)

    @property
    def location(self) -> str:
        return self.bucket.url

    @property
    def location_key(self) -> str:
        return f"tiers.{self.name}.url"

    @property
    def threads(self) -> int:
        # Ranged reads in flight on a restore: `concurrency`, whatever the cores. A thread spends most
        # of a chunk waiting on a GET, its own or that of the 16 MiB window its chunk lies in
        # (tierckpt.storage.coalesce), so fewer threads leave GETs unmade. Measured on 2 cores that
        # also ran the server, 1 GiB, chunks grouped along their boundaries: 8 threads 85-87% of the
        # raw client's GETs, 12 and 16 the same, 4 threads 79%.
        return self.config.concurrency

    def _error(self, exc: BaseException) -> ConfigError:
        return ConfigError(f"tier {self.name!r}: cannot use {self.bucket.url} ({exc})", tier=self.name, key=f"tiers.{self.name}.url")

    async def _open_keeper(self) -> None:
        try:
            try:
                await self.bucket.list(".writer-lease")  # the bucket, the credentials, the endpoint: one request
                await self._lease.acquire()
            except OSError as exc:
                raise self._error(exc) from exc
            await self._index_all(sweep=True)
        except BaseException:
            await self._lease.release()
            raise

    async def _open_other(self) -> None:
        await self._index_all(sweep=False)

    async def _index_all(self, *, sweep: bool) -> None:
        """Index the committed versions; the lease holder also removes what crashes left."""
        try:
            listing = await self.bucket.list()
        except OSError as exc:
            raise self._error(exc) from exc
        if sweep:
            await self._abort_uploads()
        for step, names in containers(listing).items():
            container = version_dirname(step)
            if MANIFEST_FILE not in names:
                if sweep:  # a write never committed, or a deletion cut short
                    await self._remove(container, names)
                continue
            try:
                head = decode_document(await self.bucket.get(f"{container}/{MANIFEST_FILE}", MAX_MANIFEST_BYTES), tier=self.name, step=step)
            except (OSError, CorruptCheckpointError) as exc:
                log.warning("tier %r: %s", self.name, exc)
                self._index[step] = VersionInfo(self.name, step, 0, 0.0, self.bucket.url_of(container), valid=False)
                continue
            writes = referenced_writes(head)
            self._index[step] = self._info(step, head.stored_bytes, head.created, self.bucket.url_of(container), head=head)
            self._held[step] = _CommittedWrites(writes)
            stray = {n: s for n, s in names.items() if n != MANIFEST_FILE and write_of(n) not in writes}
            if sweep and stray:
                await self._remove(container, stray)

    async def _abort_uploads(self) -> None:
        """Abort the multipart uploads a killed writer left incomplete (invisible, yet stored and billed)."""
        try:
            aborted = await asyncio.to_thread(self.bucket.abort_uploads, "step-", self.config.timeout_s)
        except OSError as exc:
            log.warning("tier %r: incomplete uploads under %s not aborted (%s); the bucket's lifecycle rule expires them", self.name, self.bucket.url, exc)
            return
        if aborted:
            log.info("tier %r: aborted %d incomplete upload(s) under %s left by a killed writer", self.name, aborted, self.bucket.url)

    async def _remove(self, container: str, names: Any) -> bool:
        keys = [f"{container}/{n}" for n in names]
        try:
            await self.bucket.delete(keys)
            log.info("tier %r: removed %d object(s) of %s left by an interrupted write or deletion", self.name, len(keys), container)
            return True
        except OSError as exc:
            log.warning("tier %r: could not remove what a crash left in %s (%s); tried again at the next open", self.name, container, exc)
            return False

    # -- writing, committing, deleting ------------------------------------------------------------------

    async def write(self, source: VersionSource, staging: str | None = None) -> Staged:
        """Upload this rank's part of ``source`` under its final keys (a write id of its own); nothing
        is visible until the commit object is written."""
        await self._clean_stale()
        container = version_dirname(source.step)
        prefix = f".tmp-{container}-"
        wid = staging[len(prefix):] if staging and staging.startswith(prefix) else uuid.uuid4().hex[:12]
        ranked = self.group is not None
        data = f"{container}/data-r{self.rank:05d}.{wid}.bin"
        done = _Write(container, wid, [data])
        try:
            manifest, encoded, choice = await self._write_part(source, data, self.bucket, threads=min(self.config.concurrency, os.cpu_count() or 2))
            if ranked:
                name = f"manifest-r{self.rank:05d}.{wid}.msgpack"
                done.keys.append(f"{container}/{name}")
                await self.bucket.put(f"{container}/{name}", encoded)
            else:
                done.head = encoded
        except BaseException:
            await self._discard(done)
            raise
        return self._staged(source, done, manifest, encoded, name if ranked else MANIFEST_FILE, choice)

    async def seal(self, staged: Staged, parts: list[Part], metadata: dict[str, Any]) -> None:
        marker = self._marker(staged, parts, metadata)
        staged.location.head = marker.encode()
        staged.nbytes = marker.stored_bytes

    async def commit(self, staged: Staged) -> VersionInfo:
        done: _Write = staged.location
        assert done.head is not None, "commit before seal"
        key = f"{done.container}/{MANIFEST_FILE}"
        try:
            await self.bucket.put(key, done.head)  # the commit: one atomic PUT
        except OSError as exc:
            try:  # a PUT can be stored and its answer lost: look before calling it failed
                stored = await self.bucket.get(key, MAX_MANIFEST_BYTES)
            except (OSError, CorruptCheckpointError):
                done.uncertain = not isinstance(exc, FileNotFoundError)
                raise exc from None
            if stored != done.head:
                raise
            log.info("tier %r: the commit of step %d was stored though its request failed (%s)", self.name, staged.step, exc)
        return self._indexed(staged)

    def _indexed(self, staged: Staged) -> VersionInfo:
        done: _Write = staged.location
        info = self._info(staged.step, staged.nbytes, staged.created, self.bucket.url_of(done.container), head=staged)
        self._index[staged.step] = info
        old = self._held.get(staged.step)
        self._held[staged.step] = _CommittedWrites({done.write}, (old.writes | old.stale) - {done.write} if old else set())
        return info

    async def adopt(self, staged: Staged, nbytes: int) -> VersionInfo:
        staged.nbytes = nbytes
        info = self._indexed(staged)
        self._held[staged.step].stale.clear()  # rank 0's to remove
        return info

    async def forget(self, step: int) -> None:
        self._index.pop(step, None)
        self._held.pop(step, None)

    async def abort(self, staged: Staged) -> None:
        done: _Write = staged.location
        if done.uncertain:
            log.warning("tier %r: step %d may be committed after all; its objects stay until the tier next opens", self.name, staged.step)
            return
        await self._discard(done)

    async def _discard(self, done: _Write) -> None:
        try:
            await self.bucket.delete(done.keys)
        except OSError as exc:
            log.warning("tier %r: could not remove %s (%s); swept when the tier next opens", self.name, ", ".join(done.keys), exc)

    async def _clean_stale(self) -> None:
        """Remove the objects of older writes of re-saved steps, once no restore or flush reads them."""
        if not self.keeps:
            return
        for step, held in list(self._held.items()):
            if not held.stale or self.leased(step):
                continue
            container = version_dirname(step)
            try:
                names = await self.bucket.list(f"{container}/")
                await self.bucket.delete([k for k in names if write_of(k.rpartition("/")[2]) in held.stale])
                held.stale.clear()
            except OSError as exc:
                log.warning("tier %r: could not remove the older write of %s (%s); tried again later", self.name, container, exc)

    async def delete(self, step: int) -> None:
        self._check_deletable(step)
        container = version_dirname(step)
        await self.bucket.delete([f"{container}/{MANIFEST_FILE}"])  # first: from here on it is not a version
        self._index.pop(step, None)
        self._held.pop(step, None)
        names = await self.bucket.list(f"{container}/")
        await self.bucket.delete(list(names))

    # -- reading ----------------------------------------------------------------------------------------

    async def _version(self, step: int) -> StoreVersion:
        container = version_dirname(step)
        try:
            listing = await self.bucket.list(f"{container}/")
        except OSError as exc:
            raise CorruptCheckpointError(f"step {step} on tier {self.name!r}: cannot be listed ({exc})", tier=self.name, step=step) from exc
        return StoreVersion(self.bucket, container, {k.rpartition("/")[2]: s for k, s in listing.items()})

    async def _files(self, step: int) -> StoreVersion:
        return await self._version(step)

    def _at(self, step: int) -> str:
        return self.bucket.url_of(version_dirname(step))

    async def close(self) -> None:
        try:
            if self.keeps:
                await self._clean_stale()
        finally:
            await self._lease.release()
            self.executor.shutdown(wait=True)
