"""The copies of other ranks' snapshots that one rank holds, as files on a RAM file system.

Layout of the directory (``<memory tier path>/<peer tier>-rank-<rank>`` when the memory tier has a
``path``; else a private directory on ``/dev/shm``, removed at close)::

    w<world>-r<owner>/step-<12>/   a copy of rank <owner>'s part of a version saved by <world> ranks:
                                   manifest.msgpack and data-r00000.bin, a one-process version of the
                                   filesystem format (checksums included)
    .tmp-*                         a copy being received (swept when the directory is opened)

A copy is received into its data file mapped shared, verified against its checksums, and renamed into
place whole: a process killed at any moment leaves each ``step-`` directory whole or absent. A new
process opening the directory finds the copies there; they are verified again when they are read.
Every method blocks (file I/O) and is safe to call from several threads.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import MANIFEST_FILE, Manifest, parse_version_dirname, version_dirname
from tierckpt.format.lineage import Lineage, lineage_of
from tierckpt.storage.posix import preallocate, remove_out_of_sight, write_file
from tierckpt.storage.lock import DirectoryLock
from tierckpt.tiers.wire import COPY_FILE

log = logging.getLogger("tierckpt")

_OWNER_DIR = re.compile(r"^w(\d{5})-r(\d{5})$")
_PRIVATE = "tierckpt-copies-"  # the prefix of a private directory (a memory tier without a path)


def _sweep_orphans(base: Path) -> None:
    """Remove the private directories of processes that died without closing (SIGKILL): each live one
    is locked by its process, so a directory that can be locked has nobody left."""
    for path in base.glob(f"{_PRIVATE}*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # alive
        finally:
            os.close(fd)  # drops the lock, if taken
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class ReplicaId:
    """One copy held: whose part, of which version."""

    world: int
    owner: int
    step: int

    @property
    def dirname(self) -> str:
        return f"w{self.world:05d}-r{self.owner:05d}"


class Incoming:
    """A copy being received: its staging directory and its data file, mapped."""

    def __init__(self, held: ReplicaId, path: Path, nbytes: int) -> None:
        self.held = held
        self.path = path
        self.nbytes = nbytes
        self._map: mmap.mmap | None = None
        # The data file may be a spare already there (see ReplicaStore.stage): resized, not made anew.
        fd = os.open(path / COPY_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, min(nbytes, os.fstat(fd).st_size))
            if nbytes:
                # Reserve the RAM now: a full tmpfs fails here with ENOSPC, not with SIGBUS mid-receive.
                preallocate(fd, nbytes)
                os.ftruncate(fd, nbytes)
                # Not MAP_POPULATE (0.34 s per GiB before the first byte could move): the receivers
                # fault it in beside the transfer (tierckpt._buffers.prefaulting).
                self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    @property
    def data(self) -> memoryview:
        return memoryview(self._map) if self._map is not None else memoryview(b"")

    def unmap(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a receive that failed may still hold a view; the mapping goes with it
                pass
            self._map = None


class ReplicaStore:
    def __init__(self, root: Path | None, tier: str) -> None:
        self.tier = tier
        self._ephemeral = root is None
        if root is None:
            base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
            _sweep_orphans(base)
            root = Path(tempfile.mkdtemp(prefix=_PRIVATE, dir=base))
        self.root = root
        self._lock = DirectoryLock(root, tier)
        self._guard = threading.Lock()
        self._held: dict[ReplicaId, int] = {}  # -> bytes
        self._created: dict[ReplicaId, float] = {}  # -> when its owner saved it (unix time)
        self._lineage: dict[ReplicaId, Lineage] = {}  # -> which save it is (tierckpt.format.lineage), if recorded
        # Data files of deleted copies, kept (up to ``spares``) to receive later copies into: their RAM is
        # allocated and faulted in already, which made a 256 MiB copy land in 65 ms instead of 175-350 ms.
        self.spares = 0
        self._spare: list[Path] = []

    def open(self) -> None:
        """Lock the directory, sweep what a killed process left, and index the copies it holds."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"tier {self.tier!r}: {str(self.root)!r} cannot be created ({exc.strerror or exc}); use a memory tier path on /dev/shm",
                tier=self.tier,
            ) from exc
        self._lock.acquire()
        for name in os.listdir(self.root):
            path = self.root / name
            if name.startswith((".tmp-", ".trash-", ".spare-")):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                continue
            owner = _OWNER_DIR.match(name)
            if owner is None or not path.is_dir():
                continue
            for version in os.listdir(path):
                step = parse_version_dirname(version)
                if step is None:
                    continue
                held = ReplicaId(int(owner[1]), int(owner[2]), step)
                try:
                    size = os.stat(path / version / COPY_FILE).st_size
                    manifest = Manifest.decode((path / version / MANIFEST_FILE).read_bytes(), tier=self.tier, step=step)
                except (OSError, CorruptCheckpointError) as exc:
                    log.warning("tier %r: removing the copy of rank %d's step %d: %s", self.tier, held.owner, step, exc)
                    self._remove(path / version)
                    continue
                self._held[held] = size
                self._note(held, manifest.created, lineage_of(manifest.metadata))

    def held(self) -> dict[ReplicaId, int]:
        with self._guard:
            return dict(self._held)

    def created(self, held: ReplicaId) -> float:
        """When the owner saved the version of a copy held (unix time; 0 if not known)."""
        with self._guard:
            return self._created.get(held, 0.0)

    def lineage(self, held: ReplicaId) -> Lineage | None:
        """Which save the version of a copy held is (None: not recorded)."""
        with self._guard:
            return self._lineage.get(held)

    def _note(self, held: ReplicaId, created: float, lineage: Lineage | None) -> None:
        self._created[held] = created
        if lineage is None:
            self._lineage.pop(held, None)
        else:
            self._lineage[held] = lineage

    def path(self, held: ReplicaId) -> Path:
        return self.root / held.dirname / version_dirname(held.step)

    def stage(self, held: ReplicaId, nbytes: int) -> Incoming:
        """A staging directory with a data file of ``nbytes`` reserved in RAM.

        Raises:
            OSError: ENOSPC when the RAM file system has no room (names the directory).
        """
        tmp = self.root / f".tmp-{held.dirname}-{version_dirname(held.step)}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            spare = self._take_spare(nbytes)
            if spare is not None:
                os.rename(spare, tmp / COPY_FILE)
            return Incoming(held, tmp, nbytes)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno in (errno.ENOSPC, errno.EFBIG):
                raise OSError(exc.errno, f"no room for a {nbytes}-byte copy of rank {held.owner}'s step {held.step} ({exc.strerror})", str(self.root)) from None
            raise

    def commit(self, incoming: Incoming, manifest: bytes, created: float = 0.0, lineage: Lineage | None = None) -> Path:
        """Make a fully received and verified copy visible; replaces an older copy of the same step.
        ``created`` and ``lineage``: when the owner saved it and which save it is, from ``manifest``
        (decoded and checked by the caller)."""
        incoming.unmap()
        write_file(incoming.path / MANIFEST_FILE, manifest)
        final = self.path(incoming.held)
        final.parent.mkdir(exist_ok=True)
        if final.exists():
            self._remove(final)
        os.rename(incoming.path, final)
        with self._guard:
            self._held[incoming.held] = incoming.nbytes
            self._note(incoming.held, created, lineage)
        return final

    def discard(self, incoming: Incoming) -> None:
        incoming.unmap()
        self._keep_spare(incoming.path / COPY_FILE)
        shutil.rmtree(incoming.path, ignore_errors=True)

    def delete(self, held: ReplicaId) -> None:
        with self._guard:
            self._created.pop(held, None)
            self._lineage.pop(held, None)
            if self._held.pop(held, None) is None:
                return
        path = self.path(held)
        trash = self.root / f".trash-{held.dirname}-{path.name}-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, trash)  # out of sight first: a reader sees the copy whole or gone
        except FileNotFoundError:
            return
        self._keep_spare(trash / COPY_FILE)
        shutil.rmtree(trash, ignore_errors=True)

    def _remove(self, path: Path) -> None:
        remove_out_of_sight(self.root, path, f"{path.parent.name}-{path.name}")

    def _keep_spare(self, data: Path) -> None:
        with self._guard:
            if len(self._spare) >= self.spares:
                return
            spare = self.root / f".spare-{uuid.uuid4().hex[:12]}"
            try:
                os.rename(data, spare)
            except OSError:
                return
            self._spare.append(spare)

    def _take_spare(self, nbytes: int) -> Path | None:
        """The smallest spare that holds ``nbytes``, else the largest (grown); None when there is none."""
        with self._guard:
            sized = []
            for path in list(self._spare):
                try:
                    sized.append((os.stat(path).st_size, path))
                except FileNotFoundError:  # removed behind our back: forget it
                    self._spare.remove(path)
            if not sized:
                return None
            fits = [sp for sp in sized if sp[0] >= nbytes]
            _, spare = min(fits) if fits else max(sized)
            self._spare.remove(spare)
            return spare

    def close(self) -> None:
        self._lock.release()
        if self._ephemeral:
            shutil.rmtree(self.root, ignore_errors=True)
