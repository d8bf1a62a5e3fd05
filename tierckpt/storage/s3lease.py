"""One Checkpointer per object-tier prefix: a lease object taken with a conditional PUT, and renewed
(the bucket store's ``open(exclusive=True)``, as a directory's ``flock`` is a local store's).

A bucket has no ``flock``. The writer creates ``<prefix>/.writer-lease`` only if it does not exist
(``If-None-Match: *``), and rewrites it every :data:`RENEW_S` only over its own version (``If-Match``
on its ETag). A second Checkpointer finds it and is refused, naming the holder's host and pid. A
holder that died stops renewing: after :data:`STALE_S` without renewal (by the server's clock), or at
once when the holder was a process of this host that no longer exists, the lease is taken over with a
conditional PUT on the ETag read, so two successors cannot both win. A server that ignores
conditional writes gives no such protection (docs/object-storage.md: the limit).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import socket
import uuid
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.storage.lock import process_alive
from tierckpt.storage.s3 import Bucket

log = logging.getLogger("tierckpt")

__all__ = ["LEASE_KEY", "RENEW_S", "STALE_S", "WriterLease"]

LEASE_KEY = ".writer-lease"
RENEW_S = 30.0
STALE_S = 120.0


class WriterLease:
    """The lease of ``bucket``'s prefix for the tier ``tier`` (see the module docstring)."""

    def __init__(self, bucket: Bucket, tier: str) -> None:
        self.bucket, self.tier = bucket, tier
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "id": uuid.uuid4().hex}
        self._etag: str | None = None
        self._renewing: asyncio.Task[None] | None = None

    def _body(self) -> bytes:
        return json.dumps({**self.holder, "renewed": datetime.datetime.now(datetime.timezone.utc).isoformat()}).encode()

    async def acquire(self) -> None:
        try:
            self._etag = await self.bucket.put(LEASE_KEY, self._body(), create=True)
        except FileExistsError:
            await self._take_over()
        self._renewing = asyncio.get_running_loop().create_task(self._renew())

    async def _take_over(self) -> None:
        meta = await self.bucket.head(LEASE_KEY)
        try:
            theirs: dict[str, Any] = json.loads(await self.bucket.get(LEASE_KEY, 1 << 16))
        except (ValueError, OSError):
            theirs = {}
        age = (datetime.datetime.now(datetime.timezone.utc) - meta["last_modified"]).total_seconds()
        here = theirs.get("host") == self.holder["host"] and isinstance(theirs.get("pid"), int)
        gone = here and not process_alive(theirs["pid"])
        if not gone and age < STALE_S:
            who = f"pid {theirs.get('pid', '?')} on {theirs.get('host', '?')}"
            raise ConfigError(
                f"tier {self.tier!r}: {self.bucket.url} is in use by another Checkpointer ({who}, renewed {age:.0f} s ago); "
                f"close that one first, or give this one its own prefix (a lease left by a dead job expires after {STALE_S:g} s)",
                tier=self.tier,
                key=f"tiers.{self.tier}.url",
            )
        try:
            self._etag = await self.bucket.put(LEASE_KEY, self._body(), etag=meta.get("e_tag"))
        except FileExistsError:
            raise ConfigError(f"tier {self.tier!r}: another Checkpointer took {self.bucket.url} just now", tier=self.tier, key=f"tiers.{self.tier}.url") from None
        log.info("tier %r: took over the lease of %s from %s (%s)", self.tier, self.bucket.url, theirs or "an unreadable lease",
                 "its process is gone" if gone else f"not renewed for {age:.0f} s")

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                self._etag = await self.bucket.put(LEASE_KEY, self._body(), etag=self._etag)
            except FileExistsError:
                log.error("tier %r: another Checkpointer took the lease of %s; stop one of them", self.tier, self.bucket.url)
                return
            except OSError as exc:
                log.warning("tier %r: could not renew the lease of %s (%s); trying again in %g s", self.tier, self.bucket.url, exc, RENEW_S)

    async def release(self) -> None:
        task, self._renewing = self._renewing, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._etag is None:
            return
        self._etag = None
        try:
            await self.bucket.delete([LEASE_KEY])
        except OSError as exc:
            log.warning("tier %r: could not give back the lease of %s (%s); it expires in %g s", self.tier, self.bucket.url, exc, STALE_S)
