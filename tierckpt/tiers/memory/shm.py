"""The files behind a memory tier that outlives its process (``path:`` on a RAM-backed file system).

Layout of the tier's directory (``/dev/shm/<job>`` typically)::

    pool.msgpack    what the pool is: slot size and slot count, checked when a new process opens it
    pool.bin        the host pool itself, mapped shared: captures land here, so persisting costs no copy
    step-<12>/      a committed snapshot: manifest.msgpack (the filesystem tier's format, checksums
                    included) and data-r00000.bin, a hard link to pool.bin whose records point into the
                    snapshot's slot

A snapshot's directory exists only while its slot holds exactly its bytes: it is written after the
capture (checksums first), and removed before the slot takes another capture. A process killed at any
moment leaves each ``step-`` directory either whole or absent, and a new process opening the tier with
the same ``host`` settings maps the same pool and restores from it; one with other settings, or a
directory holding anything else, is refused rather than reused.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import uuid
from pathlib import Path
from typing import Sequence

import msgpack

from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.format import CHUNK_BYTES, DATA_FILE, MANIFEST_FILE, Chunk, Manifest, TensorRecord, checksum, parse_version_dirname, version_dirname
from tierckpt.format.records import chunk_count
from tierckpt.snapshot import Entry
from tierckpt.storage.posix import remove_out_of_sight, write_file
from tierckpt.storage.lock import DirectoryLock

log = logging.getLogger("tierckpt")

POOL_FILE = "pool.bin"
POOL_INFO = "pool.msgpack"
_POOL_FORMAT = "tierckpt-pool"


class ShmStore:
    """A memory tier's directory: its lock, its pool file and its snapshots' version directories."""

    def __init__(self, root: Path, tier: str, slot_size: int, slots: int) -> None:
        self.root = root
        self.tier = tier
        self.slot_size = slot_size
        self.slots = slots
        self._lock = DirectoryLock(root, tier)

    def _error(self, problem: str, hint: str) -> ConfigError:
        return ConfigError(f"tier {self.tier!r}: {str(self.root)!r} {problem}; {hint}", tier=self.tier, key=f"tiers.{self.tier}.path")

    # -- opening -------------------------------------------------------------------------------------

    def open(self) -> mmap.mmap:
        """Lock the directory, check what it holds, and map the pool (made, and its RAM reserved, if new)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._error(f"cannot be created ({exc.strerror or exc})", "use a directory on /dev/shm") from exc
        self._lock.acquire()
        try:
            return self._map()
        except BaseException:
            self._lock.release()
            raise

    def _map(self) -> mmap.mmap:
        names = set(os.listdir(self.root))
        info_path, pool_path = self.root / POOL_INFO, self.root / POOL_FILE
        wanted = {"format": _POOL_FORMAT, "version": 1, "slot_size": self.slot_size, "slots": self.slots}
        size = self.slot_size * self.slots
        if POOL_INFO in names:
            info = self._read_info(info_path)
            if {k: info.get(k) for k in wanted} != wanted:
                raise self._error(
                    f"holds a host pool of {info.get('slots')} slots of {info.get('slot_size')} bytes, and this "
                    f"config asks for {self.slots} of {self.slot_size}",
                    "open it with the host settings it was made with to restore from it, or remove it",
                )
            try:
                fd = os.open(pool_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                raise self._error(f"has {POOL_INFO} but no {POOL_FILE}", "remove the directory") from None
            try:
                if os.fstat(fd).st_size != size:
                    raise self._error(f"has a {POOL_FILE} of {os.fstat(fd).st_size} bytes, not {size}", "remove the directory")
                return self._mmap(fd, size)
            finally:
                os.close(fd)
        foreign = sorted(n for n in names if not n.startswith((".tmp-", ".trash-")))
        if foreign:
            raise self._error(
                f"holds files that are not a tierckpt memory tier (e.g. {foreign[0]!r})",
                "give the tier an empty or new directory",
            )
        if not _ram_backed(self.root):
            log.warning("tier %r: %s is not on a RAM-backed file system (tmpfs): snapshots will go through its disk", self.tier, self.root)
        tmp = self.root / f".tmp-{POOL_FILE}-{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                # Reserve the RAM now: a tmpfs too small for the pool fails here, not with SIGBUS mid-capture.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EFBIG):
                    raise
                raise self._error(
                    f"has no room for a {size}-byte host pool ({exc.strerror})",
                    "lower host.capacity, or give the RAM file system more room (e.g. mount -o remount,size=... /dev/shm)",
                ) from None
            memory = self._mmap(fd, size)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.rename(tmp, pool_path)
        tmp_info = self.root / f".tmp-{POOL_INFO}-{uuid.uuid4().hex[:12]}"
        write_file(tmp_info, msgpack.packb(wanted))
        os.rename(tmp_info, info_path)
        return memory

    def _read_info(self, path: Path) -> dict:
        try:
            data = path.read_bytes()
            info = msgpack.unpackb(data[:4096], raw=False) if len(data) <= 4096 else None
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            raise self._error(f"has an unreadable {POOL_INFO} ({exc})", "remove the directory") from None
        if not isinstance(info, dict) or info.get("format") != _POOL_FORMAT:
            raise self._error(f"has a {POOL_INFO} that is not a tierckpt pool's", "remove the directory")
        return info

    @staticmethod
    def _mmap(fd: int, size: int) -> mmap.mmap:
        # Not MAP_POPULATE: the host pool faults its slots in the background (tierckpt.capture.prepare),
        # and a restore from the snapshots found here faults only the pages it reads.
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def scan(self) -> list[tuple[Manifest, int | None]]:
        """The committed snapshots the directory holds, with their slot (None: no tensor bytes, any
        slot will do); leftovers swept, versions that are not whole snapshots of this pool removed."""
        pool_inode = os.stat(self.root / POOL_FILE).st_ino
        found: list[tuple[Manifest, int | None]] = []
        taken: set[int] = set()
        for name in sorted(os.listdir(self.root)):
            path = self.root / name
            if name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                continue
            step = parse_version_dirname(name)
            if step is None:
                continue
            try:
                manifest = Manifest.decode((path / MANIFEST_FILE).read_bytes(), tier=self.tier, step=step)
                data = path / DATA_FILE.format(rank=0)
                if os.stat(data, follow_symlinks=False).st_ino != pool_inode:
                    raise CorruptCheckpointError(f"{data.name} is not this tier's pool")
                slot = self._slot_of(manifest)
                if slot is not None and slot in taken:
                    raise CorruptCheckpointError(f"slot {slot} is claimed by two versions")
            except (OSError, CorruptCheckpointError) as exc:
                log.warning("tier %r: removing %s: it is not a whole snapshot of this pool (%s)", self.tier, name, exc)
                self.remove_dir(path)
                continue
            if slot is not None:
                taken.add(slot)
            found.append((manifest, slot))
        return found

    def _slot_of(self, manifest: Manifest) -> int | None:
        slots = {c.offset // self.slot_size for r in manifest.records for c in r.all_chunks()}
        ends = {(c.offset + c.stored - 1) // self.slot_size for r in manifest.records for c in r.all_chunks() if c.stored}
        if len(slots | ends) > 1 or any(s >= self.slots for s in slots):
            raise CorruptCheckpointError("its records do not lie in one slot")
        if any(r.codec != "none" or r.file != DATA_FILE.format(rank=0) for r in manifest.records):
            raise CorruptCheckpointError("its records are not raw slot bytes")
        return slots.pop() if slots else None

    # -- snapshots -----------------------------------------------------------------------------------

    def persist(self, manifest: Manifest) -> Path:
        """Make ``manifest`` (records pointing into the pool) a committed version directory (blocking)."""
        final = self.root / version_dirname(manifest.step)
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            os.link(self.root / POOL_FILE, tmp / DATA_FILE.format(rank=0))
            write_file(tmp / MANIFEST_FILE, manifest.encode())
            if final.exists():
                # An earlier snapshot of the same step: it goes first (its slot is still whole).
                self.remove_dir(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def remove_dir(self, path: Path) -> None:
        """Remove a version directory: out of sight first (one rename), then its files."""
        remove_out_of_sight(self.root, path, path.name)

    def close(self) -> None:
        self._lock.release()


def slot_records(
    entries: Sequence[Entry],
    *,
    offset: int,
    checksums: Sequence[Sequence[int]] | None,
    file: str,
    shared: bool = False,
) -> tuple[TensorRecord, ...]:
    """Records of a snapshot's entries, their chunks at ``offset`` + the entry's offset in the slot;
    checksum -1 (none) without ``checksums``.

    With ``shared``, an entry other ranks hold alike is cut into its shared chunks and says which ranks
    store them (for a flush); else every record is whole, in CHUNK_BYTES chunks (what this rank holds).
    """
    per_entry: Sequence[Sequence[int] | None] = checksums if checksums is not None else [None] * len(entries)
    return tuple(_slot_record(e, offset, sums, file, e.chunk_bytes if shared else CHUNK_BYTES, e.shared if shared else None) for e, sums in zip(entries, per_entry))


def _slot_record(e: Entry, offset: int, sums: Sequence[int] | None, file: str, size: int, shared: tuple[int, ...] | None) -> TensorRecord:
    return TensorRecord(
            **e.identity(),
            file=file,
            codec="none",
            chunk_bytes=size,
            chunks=tuple(
                Chunk(offset + e.offset + c * size, min(size, e.nbytes - c * size), sums[c] if sums else -1)
                for c in range(chunk_count(e.nbytes, size))
            ),
            shared=shared,
            region=e.region,
        )


def slot_manifest(
    step: int,
    created: float,
    skeleton: object,
    metadata: dict,
    entries: Sequence[Entry],
    slot_offset: int,
    checksums: Sequence[Sequence[int]],
) -> Manifest:
    """The manifest of a snapshot held in the pool: its records point into the pool file."""
    records = slot_records(entries, offset=slot_offset, checksums=checksums, file=DATA_FILE.format(rank=0))
    return Manifest(step=step, created=created, skeleton=skeleton, records=records, metadata=metadata)


def chunk_checksums(view: memoryview, nbytes: int) -> tuple[int, ...]:
    """xxh3 of each CHUNK_BYTES piece of an entry's bytes ``view[:nbytes]``."""
    return tuple(checksum(view[c * CHUNK_BYTES : min(nbytes, (c + 1) * CHUNK_BYTES)]) for c in range(chunk_count(nbytes)))


def first_mismatch(view: memoryview, nbytes: int, sums: tuple[int, ...]) -> int | None:
    """The first chunk of an entry's bytes ``view[:nbytes]`` whose xxh3 is not its ``sums``'s; None if all match."""
    return next((c for c, (have, want) in enumerate(zip(chunk_checksums(view, nbytes), sums)) if have != want), None)


def _ram_backed(path: Path) -> bool:
    """Whether ``path`` lies on tmpfs or ramfs (from /proc/self/mountinfo; True when it cannot tell)."""
    target = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount = fields[4].replace("\\040", " ")
                if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, fstype = mount, right.split()[0]
    except OSError:
        return True
    return fstype is None or fstype in ("tmpfs", "ramfs")
