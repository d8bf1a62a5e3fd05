"""The stored versions the command line reads: found in a directory or under an object tier's prefix,
opened (every rank's part), and verified chunk by chunk.

``tierckpt ls`` and ``verify`` (:mod:`tierckpt.cli`) and ``tierckpt status`` (:mod:`tierckpt.clistatus`)
read versions the same way, so that ``status --verify`` finds what ``verify`` finds; this module is
what they share, below both. What a read refuses is :mod:`tierckpt.tiers.stored.read`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import damage as marks
from tierckpt.format import MANIFEST_FILE, CommitMarker, Manifest, TensorRecord, parse_version_dirname
from tierckpt.format.layout import where
from tierckpt.format.lineage import Lineage, head, is_live, lineage_of
from tierckpt.observe.progress import format_size
from tierckpt.storage.posix import fsync_dir, replace_durably
from tierckpt.storage.scratch import scratch, scratch2, scratch_bytes
from tierckpt.storage.store import TooLarge, Unreadable
from tierckpt.tiers.base import VersionInfo
from tierckpt.tiers.stored.read import open_source, read_head, read_rank_manifest, version_files
from tierckpt.tiers.stored.source import StoredSource, StoreVersion

__all__ = [
    "DAMAGED", "NO_TIER_HINT", "OK", "USAGE", "ListedVersion", "OpenedVersion", "UsageError", "Verdict", "abandoned",
    "bucket_versions", "damage_message", "dir_versions", "direction", "format_size", "format_time", "held_bytes",
    "keep_verdict", "marked", "open_parts", "verify_bytes", "verify_version",
]

OK, DAMAGED, USAGE = 0, 1, 2  # the commands' exit statuses


class UsageError(Exception):
    """A command line the commands cannot act on: printed after the program's name, exit status 2."""


@dataclass(frozen=True)
class ListedVersion:
    """One version a command found, by the name it prints (a directory's, or an object container's)."""

    path: Path | None  # None: a version of an object tier
    step: int | None  # None: a version directory under another name (a copy)
    files: StoreVersion
    name: str

    @classmethod
    def local(cls, path: Path, step: int | None) -> ListedVersion:
        return cls(path, step, version_files(path), path.name)


NO_TIER_HINT = (
    "no tier and no version found here; pass a tier's directory (the path: of a filesystem tier, holding "
    "step-<12 digits> directories), a folder holding tier directories, one version directory, or s3://bucket/prefix"
)


def bucket_versions(url: str, endpoint: str | None) -> list[ListedVersion]:
    """The committed versions under an object tier's prefix, or the one it names."""
    from tierckpt.errors import ConfigError
    from tierckpt.tiers.object.read import list_versions, open_bucket

    try:
        return [ListedVersion(None, step, files, files.container) for step, files in list_versions(open_bucket(url, endpoint))]
    except ConfigError as exc:
        raise UsageError(f"{url}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{url}: cannot be listed ({exc})") from None


def dir_versions(directory: Path) -> list[ListedVersion]:
    """The versions in ``directory``: itself when it is one, else its ``step-...`` entries by step."""
    if not directory.exists():
        raise UsageError(f"{directory}: no such directory")
    if not directory.is_dir():
        raise UsageError(f"{directory}: not a directory")
    # The directory named on the command line may be reached through a symlink (``latest -> step-...``):
    # the user chose it. Symlinks inside it are refused, as restore refuses them.
    directory = directory.resolve()
    own = parse_version_dirname(directory.name)
    if own is not None or os.path.lexists(directory / MANIFEST_FILE):
        return [ListedVersion.local(directory, own)]
    found = []
    try:
        entries = os.listdir(directory)
    except OSError as exc:
        raise UsageError(f"{directory}: {exc.strerror or exc}") from exc
    for name in entries:
        step = parse_version_dirname(name)
        if step is not None:  # a symlink or a file by that name is listed, and refused when read
            found.append(ListedVersion.local(directory / name, step))
    return sorted(found, key=lambda v: v.step or 0)


def damage_message(exc: CorruptCheckpointError, version: ListedVersion) -> str:
    """The error without its "step N: " prefix: the line already names the version."""
    text = str(exc)
    prefix = f"{where(None, version.step)}: "
    return text[len(prefix) :] if text.startswith(prefix) else text


@dataclass
class OpenedVersion:
    """A version's manifests and open files: one per rank that saved it."""

    head: Manifest | CommitMarker
    parts: list[tuple[Manifest, StoredSource]]
    verdict: Verdict | None = None  # what verify_version found of it

    @property
    def tensors(self) -> int:
        return len(self.logical_records())

    def logical_records(self) -> list[TensorRecord]:
        """Every value once: a value several ranks share counts once, a rank's own value per rank."""
        seen: dict[tuple[int | str, str], TensorRecord] = {}
        for manifest, _ in self.parts:
            for r in manifest.records:
                seen.setdefault(("shared" if r.shared else manifest.rank, r.key), r)
        return list(seen.values())

    def close(self) -> None:
        for _, source in self.parts:
            source.close()


def open_parts(version: ListedVersion) -> OpenedVersion:
    """The version's head and every rank's part it holds, each opened and checked against its files
    (no chunk is read): CorruptCheckpointError when one is not."""
    head = read_head(version.files, tier=None, step=version.step)
    if isinstance(head, Manifest):
        manifests = [head]
    else:  # a node-local tier's directory holds its node's ranks' parts
        held = range(head.world_size) if head.holds is None else head.holds
        manifests = [read_rank_manifest(version.files, head, r, tier=None) for r in held]
    opened = OpenedVersion(head, [])
    try:
        for manifest in manifests:
            opened.parts.append((manifest, open_source(None, version.files, manifest)))
    except BaseException:
        opened.close()
        raise
    return opened


def held_bytes(head: Manifest | CommitMarker) -> int:
    """The bytes a version's directory or container stores (of a node's part: that part's)."""
    return head.held_bytes if isinstance(head, CommitMarker) else head.stored_bytes


def format_time(unix: float) -> str:
    """A time as every command prints it: local, with its UTC offset (``2026-11-27T15:29:06+01:00``)."""
    return datetime.fromtimestamp(unix).astimezone().isoformat(timespec="seconds")


def _ordered(version: Manifest | CommitMarker) -> VersionInfo:
    """A version's head as :mod:`tierckpt.format.lineage` orders versions: its step, save time and lineage."""
    return VersionInfo("", version.step, held_bytes(version), version.created, lineage=lineage_of(version.metadata))


def direction(heads: Iterable[Manifest | CommitMarker]) -> Lineage | None:
    """The lineage of the newest save among ``heads`` (:func:`tierckpt.format.lineage.head`): pass those
    of every version a command lists whose manifest read, of every tier it lists, as restore looks at
    every tier (a rollback's new saves may lie on one tier, the versions it left on another)."""
    return head(_ordered(h) for h in heads)


def abandoned(version: Manifest | CommitMarker, top: Lineage | None) -> bool:
    """Whether a save after a rollback left the version's direction: it is not ``top``'s (:func:`direction`)."""
    return not is_live(_ordered(version), top)


def verify_bytes(versions: list[ListedVersion]) -> int:
    """The bytes :func:`verify_version` reads of ``versions``, in all: what each one's head says it
    stores (:func:`held_bytes`); a version whose head cannot be read counts none, as none of it is read.
    The total of a progress bar over verifying them."""
    total = 0
    for version in versions:
        try:
            total += held_bytes(read_head(version.files, tier=None, step=version.step))
        except CorruptCheckpointError:
            pass
    return total


def _check_chunk(source: StoredSource, record: TensorRecord, chunk: int) -> tuple[str, bool] | None:
    """None if the chunk verifies (and decodes), else the damage and whether it may pass (:func:`_passing`)."""
    _, length = record.chunk_span(chunk)
    out = scratch2(record.chunk_bytes)[:length]
    try:
        source.read_logical(record, chunk, out, scratch(scratch_bytes(record.chunk_bytes)))
    except CorruptCheckpointError as exc:
        return str(exc), _passing(exc)
    return None


def _passing(exc: CorruptCheckpointError) -> bool:
    """Whether the read failed rather than found wrong bytes (an I/O error, a store that did not
    answer): the next read may succeed, so it is no damage to keep (:func:`keep_verdict`). A missing
    file, a symlink refused, a size refused are not passing."""
    cause = exc.__cause__
    return isinstance(cause, OSError) and not isinstance(cause, (FileNotFoundError, TooLarge, Unreadable))


@dataclass(frozen=True)
class Verdict:
    """What :func:`verify_version` found of a version whose manifests read: ``damage`` (None: it
    verifies); ``passing``: each damaged chunk failed to be read rather than read wrong."""

    head: Manifest | CommitMarker
    damage: str | None
    passing: bool = False


def verify_version(
    version: ListedVersion, executor: concurrent.futures.Executor, progress: Callable[[int], None] | None = None
) -> tuple[OpenedVersion | None, str | None]:
    """The version and None if it verifies (every rank's part), else its damage (the first found, and
    how many chunks are damaged). The version's
    :attr:`OpenedVersion.verdict` says whether the damage may pass (:func:`keep_verdict`).

    ``progress``: called in this thread with each chunk's stored bytes once it was checked, damaged
    or not; of a version that opens, :func:`held_bytes` of its head in all (of one that does not,
    nothing). ``progress_bar(verify_bytes(versions), ...).update`` draws one bar over several.
    """
    try:
        opened = open_parts(version)
    except CorruptCheckpointError as exc:
        return None, damage_message(exc, version)
    try:
        jobs = [
            (source, record, c)
            for manifest, source in opened.parts
            for record in manifest.records
            for c, chunk in enumerate(record.chunks)
            if chunk is not None  # a shared chunk is checked in the part of the rank that stored it
        ]
        damage: list[tuple[str, bool]] = []
        # In order, as the checks finish: the callback runs here, never on the executor's threads.
        for (_, record, c), found in zip(jobs, executor.map(lambda job: _check_chunk(*job), jobs)):
            if found is not None:
                damage.append(found)
            if progress is not None:
                progress(record.chunk(c).stored)
    finally:
        opened.close()
    if not damage:
        opened.verdict = Verdict(opened.head, None)
        return opened, None
    text = damage_message(CorruptCheckpointError(damage[0][0]), version)
    extra = len(damage) - 1
    more = f" (and {extra} more damaged chunk{'s' if extra > 1 else ''})" if extra else ""
    opened.verdict = Verdict(opened.head, text + more, passing=all(p for _, p in damage))
    return opened, text + more


def _mark_at(version: ListedVersion) -> tuple[Path | None, Any, str] | None:
    """Where ``version``'s damage mark is: the directory beside it, or its bucket (prefix-relative
    key); None for a version under another name than its step's (a copy: nothing to mark)."""
    if version.step is None:
        return None
    name = marks.mark_name(version.step)
    if version.path is not None:
        return version.path.parent, None, name
    return None, version.files.store, name


def marked(version: ListedVersion, head: Manifest | CommitMarker) -> marks.Mark | None:
    """The damage mark ``tierckpt verify`` left of this save of ``version`` (:mod:`tierckpt.format.damage`),
    or None (none, or one of another save of the step, or one that does not read)."""
    at = _mark_at(version)
    if at is None:
        return None
    directory, bucket, name = at
    try:
        if directory is not None:
            with open(directory / name, "rb") as f:
                data = f.read(marks.MARK_BYTES + 1)
        else:
            data = bucket.read_small(name, marks.MARK_BYTES)
    except OSError:
        return None
    mark = marks.decode(data)
    return mark if mark is not None and mark.created == head.created else None


def keep_verdict(version: ListedVersion, verdict: Verdict) -> str | None:
    """Leave what verify found for every later process: a damage mark beside a damaged version (not
    for damage that may pass: a read that failed), none beside one that verifies. Returns why that
    could not be done (a read-only directory, refused credentials), or None."""
    at = _mark_at(version)
    if at is None or (verdict.damage is not None and verdict.passing):
        return None
    directory, bucket, name = at
    if verdict.damage is None and marked(version, verdict.head) is None:
        return None  # nothing to take back (a mark of another save of the step is its tier's keeper's to remove)
    data = None if verdict.damage is None else marks.encode(marks.Mark(verdict.head.created, verdict.damage, time.time()))
    try:
        if directory is not None:
            _keep_local(directory, name, data)
        elif data is not None:
            asyncio.run(bucket.put(name, data))
        else:
            asyncio.run(bucket.delete([name]))
    except OSError as exc:
        doing = "leave a damage mark of" if data is not None else "remove the damage mark of"
        return f"cannot {doing} {version.name} ({exc.strerror or exc}): later restores will read it to find out"
    return None


def _keep_local(directory: Path, name: str, data: bytes | None) -> None:
    """Write the mark (durable, whole: through a temporary name), or remove it (None)."""
    path = directory / name
    if data is None:
        os.remove(path)
        fsync_dir(directory)
        return
    replace_durably(path, data, directory / f"{name}.{os.getpid()}.tmp")

