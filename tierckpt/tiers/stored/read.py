"""Reading a stored version, in any byte store: nothing a manifest says may lead a read out of the
version's container, or into an allocation that the objects do not back.

A manifest is untrusted even once its own checksum matches (another tool, a tampered file, a bug).
Before a byte of tensor data is allocated or read (:func:`open_source`, :func:`read_manifest`):

- the store opens what a key names only as the store's rules allow
  (:class:`~tierckpt.storage.store.ReadableStore`): on a file system, the version directory and every
  file in it without following symlinks and only as a directory and regular files (a FIFO or a device
  is refused without blocking on it); on an object store, only names its container's listing holds;
- data file names are plain names (:meth:`Manifest.decode` refuses ``..``, ``/``, absolute paths, NUL);
- the manifest is at most :data:`~tierckpt.format.manifest.MAX_MANIFEST_BYTES`, checked on its size
  before it is read;
- every record has a dtype, a shape and chunks that the data objects back (:func:`check_records`, in
  :mod:`tierckpt.tiers.stored.check`), so what restore allocates is backed by stored bytes.

Every failure is a :class:`CorruptCheckpointError` naming tier, step, the object and (for a record)
its key (:class:`~tierckpt.tiers.stored.source.StoreVersion`), so restore warns and moves on to the
next candidate. Bytes no chunk covers (the zero padding between 4 KiB-aligned tensors of an
uncompressed version, a file's tail past its last chunk) are not data: nothing reads them, so damage
there changes nothing restored and is not reported.

A version several ranks saved (format v3) is read per rank: ``manifest.msgpack`` is the commit marker,
and rank r's manifest must match the checksum the marker records for it (:func:`read_manifest`). The
chunks of a shared record that other ranks stored are found in their manifests
(:func:`resolve_shared`) and read from their data files.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping, cast

from tierckpt.errors import CorruptCheckpointError, LayoutError
from tierckpt.format import MANIFEST_FILE, CommitMarker, Manifest, TensorRecord, checksum, decode_document
from tierckpt.format.layout import after_where, where
from tierckpt.state import skeleton_leaf_count
from tierckpt.storage.localread import LocalFiles
from tierckpt.tiers.stored.source import StoredSource, StoreVersion
from tierckpt.tiers.stored.sweep import REPLACED

__all__ = ["find_base", "open_source", "read_head", "read_manifest", "read_rank_manifest", "resolve_shared", "version_files"]


def version_files(where: Path | StoreVersion) -> StoreVersion:
    """``where`` as a :class:`StoreVersion` (a path: the version directory, read as the local store reads)."""
    if isinstance(where, StoreVersion):
        return where
    path = Path(os.path.abspath(where))  # "." has a name too
    return StoreVersion(LocalFiles(path.parent), path.name)


def read_manifest(path: Path | StoreVersion, *, tier: str | None, step: int | None, rank: int = 0, world: int | None = None) -> Manifest:
    """Read and decode rank ``rank``'s manifest of the version directory ``path`` (blocking).

    ``world``: the number of ranks reading the version; None takes whatever saved it.

    Raises:
        CorruptCheckpointError: see the module docstring.
        LayoutError: the version was saved by another number of ranks than ``world``.
    """
    head = read_head(path, tier=tier, step=step)
    saved = head.world_size
    if world is not None and saved != world:
        raise LayoutError(
            f"{where(tier, step)} was saved by {saved} rank(s), and this job has {world}: "
            "no rank part is this rank's as it is (a restore reads the saved layout instead)",
            tier=tier,
            step=step,
        )
    if isinstance(head, Manifest):
        return head
    return read_rank_manifest(path, head, rank, tier=tier)


def read_head(path: Path | StoreVersion, *, tier: str | None, step: int | None) -> Manifest | CommitMarker:
    """``manifest.msgpack`` of the version directory ``path``: a manifest, or several ranks' commit marker."""
    return decode_document(version_files(path).read_small(MANIFEST_FILE, tier=tier, step=step), tier=tier, step=step)


def read_rank_manifest(path: Path | StoreVersion, marker: CommitMarker, rank: int, *, tier: str | None) -> Manifest:
    """Rank ``rank``'s manifest of a version several ranks saved, checked against its commit marker."""
    step = marker.step
    name, digest, _ = marker.ranks[rank]
    data = version_files(path).read_small(name, tier=tier, step=step)
    if checksum(data) != digest:
        raise CorruptCheckpointError(
            f"{where(tier, step)}: {name} does not match the checksum its commit marker records (rank {rank})",
            tier=tier,
            step=step,
        )
    manifest = Manifest.decode(data, tier=tier, step=step, name=name)
    if (manifest.rank, manifest.world_size) != (rank, marker.world_size):
        raise CorruptCheckpointError(
            f"{where(tier, step)}: {name} is rank {manifest.rank} of {manifest.world_size}, "
            f"not rank {rank} of {marker.world_size}",
            tier=tier,
            step=step,
        )
    return manifest


def resolve_shared(
    path: Path | StoreVersion, marker: CommitMarker, manifest: Manifest, *, tier: str | None, manifests: Mapping[int, Manifest] | None = None
) -> Manifest:
    """``manifest`` with each chunk another rank stored filled in from that rank's manifest (blocking).

    ``manifests``: rank manifests already read (and checked), by rank; others are read here.

    Raises CorruptCheckpointError when the owner's manifest does not verify or does not hold the same
    value (key, dtype, shape, chunking) with that chunk.
    """
    step = manifest.step
    needed: set[int] = set()
    for r in manifest.records:
        for q in {r.owner(i) for i, c in enumerate(r.chunks) if c is None}:
            if q is None or not 0 <= q < marker.world_size or q == manifest.rank:
                raise CorruptCheckpointError(f"{where(tier, step)}: a shared chunk names rank {q}", tier=tier, step=step)
            needed.add(q)
    if not needed:
        return manifest
    theirs: dict[int, dict[str, TensorRecord]] = {}
    for q in sorted(needed):
        known = manifests.get(q) if manifests is not None else None
        theirs[q] = {r.key: r for r in (known or read_rank_manifest(path, marker, q, tier=tier)).records}
    records = []
    for r in manifest.records:
        if all(c is not None for c in r.chunks):
            records.append(r)
            continue
        chunks = list(r.chunks)
        for i, c in enumerate(r.chunks):
            if c is not None:
                continue
            q = cast(int, r.owner(i))  # checked above: a rank of the version, not this one
            other = theirs[q].get(r.key)
            theirs_i = other.chunks[i] if other is not None else None
            same = other is not None and (other.kind, other.dtype, other.shape, other.nbytes, other.chunk_bytes, other.shared) == (
                r.kind, r.dtype, r.shape, r.nbytes, r.chunk_bytes, r.shared
            )
            if other is None or theirs_i is None or not same:
                raise CorruptCheckpointError(
                    f"{where(tier, step)}: {r.key} chunk {i} should be in rank {q}'s {marker.ranks[q][0]}, which does not hold it",
                    tier=tier,
                    step=step,
                    key=r.key,
                )
            chunks[i] = dataclasses.replace(theirs_i, file=other.file)
        records.append(dataclasses.replace(r, chunks=tuple(chunks)))
    return dataclasses.replace(manifest, records=tuple(records))


def open_source(tier: str | None, path: Path | StoreVersion, manifest: Manifest, *, direct: bool = False) -> StoredSource:
    """The version at ``path`` opened for a restore or a promotion (blocking).

    Checks the skeleton first (it must be well formed and refer to exactly the records): a manifest
    with a damaged skeleton is refused here, naming its file, rather than half-way through a load or
    copied on to the next tier.
    """
    try:
        leaves = skeleton_leaf_count(manifest.skeleton)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{where(tier, manifest.step)}: {MANIFEST_FILE}: {exc}", tier=tier, step=manifest.step, key=exc.key
        ) from None
    if leaves != len(manifest.records):
        raise CorruptCheckpointError(
            f"{where(tier, manifest.step)}: {MANIFEST_FILE}: the skeleton refers to {leaves} arrays, "
            f"the manifest records {len(manifest.records)}",
            tier=tier,
            step=manifest.step,
        )
    files = version_files(path)
    base = find_base(files, manifest, tier=tier) if manifest.base is not None else None
    return files.open_source(tier, manifest, direct=direct, base=base)


def find_base(files: StoreVersion, manifest: Manifest, *, tier: str | None) -> StoreVersion:
    """The base of the differential version ``manifest``: the version it was written against, whose
    manifest of the same rank has the checksum ``manifest`` records. That is the base's step in
    place, or, once that step was saved again, its earlier version kept aside under
    ``.replaced-step-…`` for as long as versions written against it are kept (a file system's
    directory moved aside; a bucket's older write, its commit object copied aside).

    Raises CorruptCheckpointError naming the base (missing, damaged, or saved again and not kept).
    """
    assert manifest.base is not None
    step, (base_step, _) = manifest.step, manifest.base
    in_place = files.base_of(manifest)
    try:
        if _is_base(in_place, manifest, tier=tier):
            return in_place
    except CorruptCheckpointError as exc:
        problem: CorruptCheckpointError | None = exc
    else:
        problem = None
    for name in files.store.containers_named(f"{REPLACED}{in_place.container}-"):
        aside = StoreVersion(files.store, name)
        try:
            if _is_base(aside, manifest, tier=tier):
                return aside
        except CorruptCheckpointError:
            continue
    if problem is not None:
        raise CorruptCheckpointError(
            f"{where(tier, step)}: its base, step {base_step}: {after_where(problem, tier, base_step)}", tier=tier, step=step
        ) from problem
    raise CorruptCheckpointError(
        f"{where(tier, step)}: its base, step {base_step}, is not the version it was written against "
        "(saved again since, or its manifest was replaced)",
        tier=tier,
        step=step,
    )


def _is_base(candidate: StoreVersion, manifest: Manifest, *, tier: str | None) -> bool:
    """Whether ``candidate`` holds the version ``manifest`` was written against (CorruptCheckpointError
    when its manifest cannot be read)."""
    assert manifest.base is not None
    base_step, expected = manifest.base
    data = candidate.read_small(MANIFEST_FILE, tier=tier, step=base_step)
    head = decode_document(data, tier=tier, step=base_step)
    if isinstance(head, Manifest):
        return checksum(data) == expected
    return manifest.rank < head.world_size and head.ranks[manifest.rank][1] == expected
