"""A filesystem tier: local NVMe or a parallel file system, one directory per committed version.

Layout (format v2): ``<path>/step-<12 digits>/{manifest.msgpack, data-r00000.bin}``. A version is
written under ``.tmp-step-...`` in the same parent, its files fsynced, renamed into place, and the
parent fsynced: a reader sees a whole version or none. Deletion renames to ``.trash-...`` first, so a
crash mid-delete never leaves a half-removed version that looks committed. ``.tmp-``/``.trash-``
leftovers and step directories without a manifest are swept on open; a step directory whose manifest
is damaged is kept (never delete what may be someone's only copy) and fails verification on restore.

Replacing a committed version of the same step takes two renames (a non-empty directory cannot be
renamed over): the old one goes to ``.replaced-step-...``, then the new one into place. A crash between
the two leaves no ``step-...`` directory, so open renames the ``.replaced-`` copy back instead of
sweeping it: the step keeps its old, committed content rather than vanishing (:mod:`~tierckpt.tiers.stored.sweep`;
the renames: :mod:`~tierckpt.tiers.stored.commit`).

What is stored and in which order it becomes durable and visible is the stored tier's
(:mod:`tierckpt.tiers.stored.tier`); this class only makes its store, the local file system
(:class:`~tierckpt.storage.local.LocalStore`): a rename into place is its ``publish``, a rename aside
its ``withdraw``, an fsync of a directory its ``sync``, and reads go through its read half
(:class:`~tierckpt.storage.localread.LocalFiles`: no symlink is followed).

Reading (:mod:`tierckpt.tiers.stored.read`) trusts nothing a manifest says: files are opened without following
symlinks, and records are checked against the files before anything is allocated or read.

Any write, fsync, rename or removal may fail (a full disk, a quota, EIO, EACCES): see
:mod:`tierckpt.tiers.stored.tier` for what a failure leaves behind.

Several ranks (a :class:`~tierckpt.ranks.RankGroup`) share the tier's directory. Every rank writes its
data file and its rank manifest into one staging directory whose name the leader's decision fixes;
once every rank reported its part durable, the leader writes the commit marker there (``seal``)
and renames the directory into place (``commit``); the other ranks only index it (``adopt``).
Only the directory's *keeper* (rank 0; on a node-local tier, each node's first rank:
:mod:`~tierckpt.tiers.nodelocal.tier`) sweeps, locks, deletes and renames: another rank never removes
anything but its own files of a version that was abandoned.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import TYPE_CHECKING

from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.stored.tier import StoredTier

if TYPE_CHECKING:
    from tierckpt.ranks import RankGroup


class FilesystemTier(StoredTier):
    """Versions as directories under ``config.path`` (relative paths resolve against the working directory)."""

    shared_as = "the same directory (a shared file system, or one node's disk for all its ranks)"
    reads_replicas_once = True

    def __init__(self, config: TierConfig, group: RankGroup | None = None) -> None:
        assert config.path is not None  # guaranteed by TierConfig validation
        self.root = Path(config.path).expanduser().absolute()
        self.executor = concurrent.futures.ThreadPoolExecutor(config.io_threads, thread_name_prefix=f"tierckpt-io-{config.name}")
        super().__init__(config, group, LocalStore(self.root, self.executor, tier=config.name))

    @property
    def location(self) -> str:
        return repr(str(self.root))

    @property
    def write_threads(self) -> int:
        return self.config.io_threads

    def _unusable(self, exc: OSError) -> ConfigError:
        return ConfigError(
            f"tier {self.name!r}: cannot use {str(self.root)!r} as a checkpoint directory ({exc.strerror or exc})",
            tier=self.name,
            key=self.location_key,
        )
