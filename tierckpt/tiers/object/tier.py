"""An object tier: versions in an S3-compatible bucket, under ``url: s3://bucket/prefix``.

Keys (the format of a filesystem tier, with a write id in the data and rank manifest names)::

    <prefix>/step-000000000005/manifest.msgpack                  the commit object, written last
    <prefix>/step-000000000005/data-r00000.<write>.bin           rank 0's data object
    <prefix>/step-000000000005/manifest-r00000.<write>.msgpack   rank 0's manifest (several ranks)
    <prefix>/.writer-lease                                        the Checkpointer writing here

The commit protocol is the stored tier's (:mod:`tierckpt.tiers.stored.tier`), over a bucket store
(:class:`~tierckpt.storage.s3store.BucketStore`), which has no rename: every data object is uploaded
(one multipart upload each) under its final key, with a *write id* (the ranks' shared staging
decision, or a fresh one) that no other write of the step uses. **The version is committed when its
commit object ``manifest.msgpack`` is written**: the single process's manifest, or the commit marker
naming each rank's manifest by name and checksum, put in one request after every data object
completed. A PUT is atomic, so a reader finds the old version or the new one, never half of one.
Saving a step again overwrites the commit object; the objects of the older write go afterwards
(later, when a restore still reads them). An earlier version of a step saved again cannot be kept
readable for the differential versions written against it (its commit object is overwritten): the
prune after that commit ends them.

Deleting removes the commit object first, then the rest: a reader never finds a commit object whose
data is gone. What a crash leaves (objects of a write no commit object names; incomplete multipart
uploads, aborted through :mod:`~tierckpt.storage.s3uploads`) is swept when the tier opens, by the
Checkpointer holding the writer lease (:mod:`~tierckpt.storage.s3lease`: one Checkpointer per
prefix). A commit object that does not verify is kept (never delete what may be someone's only copy)
and listed invalid.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import TYPE_CHECKING

from tierckpt.config import TierConfig
from tierckpt.format import CommitMarker, Manifest, decode_document
from tierckpt.storage.s3store import BucketStore, write_of
from tierckpt.tiers.stored.tier import StoredTier

if TYPE_CHECKING:
    from tierckpt.ranks import RankGroup

__all__ = ["ObjectTier", "referenced_writes"]


def referenced_writes(head: Manifest | CommitMarker) -> set[str]:
    """The writes a commit object names: its records' data objects, or its ranks' manifests."""
    names = {r.file for r in head.records} if isinstance(head, Manifest) else {part[0] for part in head.ranks}
    return {w for w in map(write_of, names) if w is not None}


class ObjectTier(StoredTier):
    """Versions in a bucket (see the module docstring). Several ranks: rank 0 holds the lease, sweeps,
    commits and deletes; every rank uploads its own part."""

    shared_as = "the same bucket prefix (the same url and endpoint)"
    located_by = "url"
    reads_replicas_once = True

    def __init__(self, config: TierConfig, group: RankGroup | None = None) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(config.concurrency, thread_name_prefix=f"tierckpt-s3-{config.name}")
        store = BucketStore(config, lambda head: referenced_writes(decode_document(head, tier=config.name)), tier=config.name)
        super().__init__(config, group, store)

    @property
    def threads(self) -> int:
        # Ranged reads in flight on a restore: `concurrency`, whatever the cores. A thread spends most
        # of a chunk waiting on a GET, its own or that of the 16 MiB window its chunk lies in
        # (tierckpt.storage.coalesce), so fewer threads leave GETs unmade. Measured on 2 cores that
        # also ran the server, 1 GiB, chunks grouped along their boundaries: 8 threads 85-87% of the
        # raw client's GETs, 12 and 16 the same, 4 threads 79%.
        return self.config.concurrency

    @property
    def write_threads(self) -> int:
        return min(self.config.concurrency, os.cpu_count() or 2)
