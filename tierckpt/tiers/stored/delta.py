"""Differential versions on a stored tier (``delta: {full_every: N}``): which versions are written against
which base, and the base as the writer reads it.

Every N-th version a tier stores is whole; the N - 1 after it are written against it (their *base*):
a chunk equal to the base's is a reference, a changed floating-point chunk its XOR against the base's
in byte planes where that pays (:mod:`tierckpt.xordelta`). Each version depends on at most one other,
a whole one: a restore reads two versions at most, and retention keeps a base as long as a version
that depends on it (:meth:`~tierckpt.tiers.stored.tier.StoredTier.versions`).

The base against the previous version would store less (each delta spans one save's training, not up
to N - 1): measured with N = 10 (``benchmarks/delta.py``), 3 to 11 points of the bytes of compression
alone, the most on bf16 saved every step (0.59 against 0.69). It would make every version depend on
all those before it back to the last whole one: a restore would read up to N versions, and one damaged
version would break every later one until the next whole version.

Which base a version gets is decided from the tier's index alone (:func:`choose_base`), the same on
every rank of a job: their parts name the same base, and the leader's commit marker names it for
retention. A rank that cannot read its part of the base (damaged, missing) writes its part whole;
the version still counts as depending on the base, which only keeps the base longer. A base chunk
found damaged while a version is written against it makes the tier write that version again, whole;
one process also takes the base for damaged (``valid=False``), so that no later version is written
against it (of several ranks, every rank's index stays as the others' are).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from tierckpt._buffers import aligned_buffer
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import MANIFEST_FILE, Chunk, CommitMarker, TensorRecord, checksum
from tierckpt.storage.scratch import scratch_bytes
from tierckpt.tiers.base import VersionInfo
from tierckpt.tiers.stored.read import open_source, read_head, read_manifest, resolve_shared
from tierckpt.tiers.stored.source import StoredSource, StoreVersion
from tierckpt.xordelta import DeltaCodec

__all__ = ["BaseChoice", "BaseUnreadable", "DeltaBase", "choose_base", "dependents", "needed_by", "open_base"]


@dataclass(frozen=True)
class BaseChoice:
    """A version to be written against whole version ``step``, as its ``chain``-th after it."""

    step: int
    chain: int


def choose_base(versions: Sequence[VersionInfo], step: int, full_every: int) -> BaseChoice | None:
    """The base of the version of ``step`` about to be written, or None: it is written whole.

    The base is the newest whole version of an older step, unless it did not verify (then this one
    is whole); the new version is the next after those of older steps that depend on it, counted by
    their ``chain``: the newest of them says how many came before it, whether or not retention kept
    them (one whole version every ``full_every``, whatever the tier keeps).
    """
    wholes = [v for v in versions if v.base is None and v.step < step]
    if not wholes:
        return None
    base = max(wholes, key=lambda v: v.step)
    if not base.valid:
        return None  # the newest whole version is damaged: this one is written whole, the next base
    # Versions saved before the base was (against an earlier version of its step, saved again since) are not its.
    chain = 1 + max((v.chain for v in versions if v.base == base.step and v.step < step and v.created >= base.created), default=0)
    return BaseChoice(base.step, chain) if chain < full_every else None


def needed_by(versions: Sequence[VersionInfo]) -> dict[int, tuple[int, ...]]:
    """Of each base among ``versions``: the steps of the versions written against it."""
    return dependents([(v.step, v.base, v.created) for v in versions])


def dependents(versions: Sequence[tuple[int, int | None, float]]) -> dict[int, tuple[int, ...]]:
    """Of each base among ``versions`` (step, base step or None, created): the steps written against
    it. A version saved before its base was is not the base's: it was written against an earlier
    version of that step, kept aside."""
    created = {step: when for step, _, when in versions}
    out: dict[int, list[int]] = {}
    for step, base, when in versions:
        if base is not None and when >= created.get(base, when):
            out.setdefault(base, []).append(step)
    return {b: tuple(sorted(steps)) for b, steps in out.items()}


class BaseUnreadable(Exception):
    """A chunk of the base did not verify while a version was written against it: the version is
    written again, whole (``__cause__``: the CorruptCheckpointError)."""


class DeltaBase:
    """This rank's part of a base version, open for the writer: its records by key, each chunk with
    the digest and the place the new version's chunks refer to (blocking reads, from writer threads).

    ``checksum``: of the base's manifest of this rank, which the new manifest records.
    """

    def __init__(self, step: int, chain: int, checksum: int, source: StoredSource, codec: DeltaCodec) -> None:
        self.step, self.chain, self.checksum = step, chain, checksum
        self.source = source
        self.codec = codec
        self._records = {r.key: r for r in source.records}
        self._local = threading.local()  # each writer thread's buffers for the base's bytes

    def chunk(self, record: TensorRecord, i: int) -> tuple[TensorRecord, Chunk] | None:
        """The base's record and chunk ``i`` that chunk ``i`` of ``record`` may be stored against, or
        None: the base has no such value (another dtype, shape or chunking), or that chunk has no
        digest (a base written before ``delta`` was set)."""
        b = self._records.get(record.key)
        if b is None or (b.kind, b.dtype, b.shape, b.nbytes, b.chunk_bytes) != (
            record.kind, record.dtype, record.shape, record.nbytes, record.chunk_bytes
        ):
            return None
        c = b.chunks[i]
        if c is None or c.digest is None:
            return None
        return b, c

    def read(self, record: TensorRecord, i: int, length: int) -> memoryview:
        """The base chunk's logical bytes (``length``), verified, in this thread's buffer: valid until
        its next read. Raises :class:`BaseUnreadable` when it does not verify."""
        room = scratch_bytes(record.chunk_bytes)
        buffers = getattr(self._local, "buffers", None)
        if buffers is None or len(buffers[0]) < room:
            buffers = self._local.buffers = (aligned_buffer(room), aligned_buffer(room))
        out = memoryview(buffers[0])[:length]
        try:
            self.source.read_logical(record, i, out, memoryview(buffers[1]))
        except CorruptCheckpointError as exc:
            raise BaseUnreadable(str(exc)) from exc
        return out

    def close(self) -> None:
        self.source.close()


def open_base(files: StoreVersion, choice: BaseChoice, codec: DeltaCodec, *, tier: str, rank: int, world: int, direct: bool) -> DeltaBase | None:
    """This rank's part of base ``choice.step``, in ``files``, open for the writer (blocking); None when
    it was written before ``delta`` was set (no digests to refer to, nothing to write against).

    Raises CorruptCheckpointError or LayoutError when it cannot be read.
    """
    manifest = read_manifest(files, tier=tier, step=choice.step, rank=rank, world=world)
    if world > 1:  # its marker records this rank's manifest's checksum, and resolves the shared chunks
        head = read_head(files, tier=tier, step=choice.step)
        assert isinstance(head, CommitMarker)  # read_manifest checked the world
        identity = head.ranks[rank][1]
        manifest = resolve_shared(files, head, manifest, tier=tier)
    else:
        identity = checksum(files.read_small(MANIFEST_FILE, tier=tier, step=choice.step))
    if not any(c is not None and c.digest is not None for r in manifest.records for c in r.chunks):
        return None
    return DeltaBase(choice.step, choice.chain, identity, open_source(tier, files, manifest, direct=direct), codec)
