"""The load planner: one entry point, :func:`plan`, from a saved version and this rank's template to
the targets and the chunk jobs that fill them; :meth:`Plan.run` runs them.

A saved version comes as a :class:`~tierckpt.format.saved_layout.SavedLayout` (every key's global tensor
and its stored pieces, whatever layout saved it: universal checkpoints), or as the version source
this rank reads whole (:meth:`Tier.read_whole <tierckpt.tiers.base.Tier.read_whole>`). The general
path (:mod:`tierckpt.restore.reshard`) fills each destination from the stored pieces it overlaps,
reading only the chunks that hold some of it: another number of ranks, other placements, one
process consolidating, or a dtype to convert. A whole source whose records are exactly the template
(:func:`fits`) takes the fast path (:mod:`tierckpt.restore.exact`): each chunk read straight into its
destination, fresh memory faulted in ahead of the reads; any other source is read through its own
layout by the general path.

Planning checks everything a template could refuse before a byte moves; nothing is read until
:meth:`Plan.run`. The fast path lands each chunk in the template once it verified, unless asked to
verify the whole version first (``verify_first``: bytes staged, then copied by
:func:`~tierckpt.restore.landing.finish`); the general path always stages. What a run writes into a
template before the version verified is :attr:`Plan.touched`.

Bytes are read in the tier's threads with O_DIRECT where the tier allows it, chunk by chunk, each
chunk hashed right after its read while it is in cache.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Callable, Sequence, Union

from tierckpt._buffers import prefault
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import TensorRecord
from tierckpt.format.saved_layout import SavedLayout, source_layout
from tierckpt.format.source import VersionSource
from tierckpt.restore import exact, reshard
from tierckpt.restore.device import DeviceRing
from tierckpt.restore.landing import Target, Work, finish
from tierckpt.state import Leaf
from tierckpt.storage.scratch import ChunkJobs

__all__ = ["Plan", "Saved", "fits", "load", "plan", "staging_bytes"]

# What a plan reads from: a saved layout, or the source of a version this rank reads whole.
Saved = Union[VersionSource, SavedLayout]
Progress = Callable[[int], None]  # called with each chunk's stored bytes once it landed
Ahead = Sequence[tuple[int, memoryview]]  # (job index, fresh destination bytes): faulted in ahead of the readers


def fits(records: tuple[TensorRecord, ...], templates: dict[str, Leaf]) -> bool:
    """Whether one rank's own records load as they are: each is exactly its template's piece.

    False when any record needs the saved layout: a stored shard whose template is another piece (or
    a plain tensor, or none: consolidation), a template shard of a value stored whole, or a dtype or
    shape to convert or to refuse with the reason.
    """
    for r in records:
        t = templates.get(r.key)
        sharded = r.region is not None and r.region.global_shape != r.shape
        if t is None:
            if sharded:
                return False
            continue
        if t.kind != r.kind or t.dtype != r.dtype or tuple(t.shape) != r.shape:
            return False
        if sharded and t.region != r.region:
            return False
        if t.region is not None and t.region.global_shape != tuple(t.shape) and r.region is None:
            return False
    return True


def _exact(saved: Saved, templates: dict[str, Leaf], records: Sequence[TensorRecord] | None) -> VersionSource | None:
    """The source, when it takes the exact-fit fast path; else None."""
    if isinstance(saved, SavedLayout) or records is not None or not fits(saved.records, templates):
        return None
    return saved


def _layout(saved: Saved) -> SavedLayout:
    # A source that does not fit, read through the layout it holds: one process's part, as a tier
    # without a layout of its own reads it (Tier.read_layout).
    return saved if isinstance(saved, SavedLayout) else source_layout(saved, complete=False)


def staging_bytes(saved: Saved, templates: dict[str, Leaf], *, verify_first: bool = True, stage_all: bool = False) -> int:
    """The size of the staging area :func:`plan` lays out for loading ``saved`` into ``templates``:
    what a caller borrows beforehand (memory already faulted in) and passes as ``lent``."""
    source = _exact(saved, templates, None)
    if source is not None:
        return exact.staging_bytes(source, templates, verify_first=verify_first, stage_all=stage_all)
    return reshard.staging_bytes(saved.records, templates)


class Plan:
    """What this rank reads of a saved version, and where it lands (built by :func:`plan`).

    Call order: :meth:`open` (or any source of the same version holding :attr:`records`), then
    :meth:`run` once, then :func:`~tierckpt.restore.landing.finish` with :attr:`saved` and the targets.
    """

    def __init__(
        self,
        saved: Saved,
        targets: list[Target],
        work: list[Work],
        *,
        ahead: Sequence[tuple[int, memoryview]] = (),
        records: Sequence[TensorRecord] | None = None,
        partial: bool = False,
        ring: DeviceRing | None = None,
        deferred: Sequence[Work] = (),
    ) -> None:
        self.saved = saved  # what finish() rebuilds the state from (its skeleton), and its metadata
        self.targets = targets  # one per planned record, for tierckpt.restore.landing.finish
        # The stored pieces to open (layout.open); None: the plan reads the whole source it was given.
        self.records = records
        # Some piece is read for only part of its elements: other ranks (on this node, likely) read
        # the same chunks for the rest, so they are better read through the page cache, where the
        # second reader finds them (O_DIRECT read a Shard(0) -> Shard(1) restore twice from disk).
        self.partial = partial
        self._work = work
        self._ahead = ahead  # (job index, fresh destination bytes): faulted in ahead of the readers
        self._ring = ring  # pinned buffers the chunks bound for CUDA templates go through
        # Chunks of replicated values that the ranks storing them send (tierckpt.restore.replicas);
        # read here only when they cannot (run_deferred).
        self.deferred = list(deferred)
        self.bytes_read = 0  # the stored bytes of the chunks read and landed so far

    @property
    def touched(self) -> list[str]:
        """The template keys whose own bytes :meth:`run` writes as chunks verify (not staged): what a
        run that fails half-way leaves partly overwritten."""
        return [t.record.key for t in self.targets if t.template and t.staged is None and t.record.nbytes]

    @property
    def read_bytes(self) -> int:
        """The stored bytes :meth:`run` reads: what its ``progress`` callback counts in all."""
        return sum(_stored(args) for _, args in self._work)

    @property
    def exact(self) -> bool:
        """Whether this is the exact-fit fast path (reading the whole source it was given)."""
        return self.records is None

    def open(self) -> VersionSource:
        """The source :meth:`run` reads from (blocking). Of the general path a new one, which the
        caller closes; of the fast path the source the plan was given (its opener closes it)."""
        if isinstance(self.saved, SavedLayout):
            assert self.records is not None
            return self.saved.open(self.records, shared=self.partial)
        return self.saved

    def run(
        self, source: VersionSource, executor: concurrent.futures.Executor, threads: int = 2, progress: Callable[[int], None] | None = None
    ) -> list[Target]:
        """Read, verify and land every planned chunk of ``source``; returns the targets (blocking).

        ``threads`` of the tier's ``executor`` run the chunk jobs; meanwhile this thread faults the
        fresh destination pages in ahead of them, then runs jobs alongside them. ``progress``: called
        with each chunk's stored bytes once it landed, from the thread that read it (several at once);
        :attr:`read_bytes` in all.
        """
        return self._run(source, executor, threads, progress, self._work, self._ahead)

    def run_deferred(self, source: VersionSource, executor: concurrent.futures.Executor, threads: int = 2) -> list[Target]:
        """Read the :attr:`deferred` chunks here after all, as :meth:`run` reads the others (blocking)."""
        deferred, self.deferred = self.deferred, []
        return self._run(source, executor, threads, None, deferred, ())

    def _run(
        self,
        source: VersionSource,
        executor: concurrent.futures.Executor,
        threads: int,
        progress: Progress | None,
        work: Sequence[Work],
        ahead: Ahead,
    ) -> list[Target]:
        if self._ring is not None:
            self._ring.start(threads + 1)  # the tier's threads and this one
        try:
            self._jobs(source, executor, threads, progress, work, ahead)
        finally:
            if self._ring is not None:
                self._ring.close()  # every copy to a device is done before the targets are handed on
        return self.targets

    def _jobs(self, source: VersionSource, executor: concurrent.futures.Executor, threads: int, progress: Progress | None, work: Sequence[Work], ahead: Ahead) -> None:
        calls: list[Callable[[], None]] = [functools.partial(fn, source, *args) for fn, args in work]
        if progress is not None:
            # Wrapped only when someone counts: without a bar the chunk jobs are exactly as before.
            calls = [functools.partial(_counted, call, _stored(args), progress) for call, (_, args) in zip(calls, work)]
        jobs = ChunkJobs(calls, executor, threads)
        try:
            # Skip what the readers have reached already: where faults are slower than the disk, each
            # side then faults pages of its own instead of both waiting on the same ones.
            for index, out in ahead:
                if jobs.error is not None:
                    break
                if index > jobs.started:
                    prefault(out)
            jobs.join()
            self.bytes_read += sum(_stored(args) for _, args in work)
        except BaseException as exc:
            jobs.stop()
            if isinstance(exc, CorruptCheckpointError) and exc.key is None:
                raise CorruptCheckpointError(str(exc), tier=self.saved.tier, step=self.saved.step) from exc
            raise


def _stored(args: tuple[Any, ...]) -> int:
    """The stored bytes a chunk job reads: its arguments begin with the record and the chunk index
    (:data:`~tierckpt.restore.landing.Work`). A chunk not resolved counts nothing here: its job raises."""
    found = args[0].chunks[args[1]]
    return 0 if found is None else int(found.stored)


def _counted(call: Callable[[], None], nbytes: int, progress: Callable[[int], None]) -> None:
    call()
    progress(nbytes)


def plan(
    saved: Saved,
    templates: dict[str, Leaf],
    lent: memoryview | None = None,
    *,
    cast: bool = False,
    verify_first: bool = True,
    stage_all: bool = False,
    records: Sequence[TensorRecord] | None = None,
    owner: int | None = None,
) -> Plan:
    """Check every template against ``saved`` and lay out every destination; nothing is read yet.

    ``saved``: a saved layout, or the source of a version this rank reads whole; a source whose
    records are exactly the template (:func:`fits`) takes the fast path, reading each chunk straight
    into its destination. ``lent``: page-aligned memory, already faulted in, for the staging area
    when it is large enough (:func:`staging_bytes`), else a fresh mapping stages; keys without a
    template get new tensors of their global shape. ``cast``: convert a saved dtype to the template's
    (general path). ``verify_first``: stage what could fail half-way, so that a template is written
    only once every chunk verified (else the fast path lands each chunk in the template's own memory
    as soon as it verified, through the tier threads' reused buffers; the general path always
    stages). ``stage_all``: stage even what could be copied straight into the template (a template
    is then written only by :func:`~tierckpt.restore.landing.finish`). ``records``: plan
    only these of a layout's records (one at a time, say, to bound memory); the plan's targets are
    then theirs, not a whole state's. ``owner``: this rank, when the chunks of replicated values
    that other ranks store are to come from them (fast path only: :attr:`Plan.deferred`).

    Raises:
        RestoreError: a template does not match its key (kind, global shape, dtype without ``cast``).
        CorruptCheckpointError: the skeleton does not match the records, the pieces do not cover a
            destination, or disagree on its dtype.
        NotHere: the layout is only part of the version and lacks pieces this rank needs.
    """
    source = _exact(saved, templates, records)
    if source is not None:  # the fast path
        targets, work, ahead, ring, deferred = exact.land(source, templates, lent, verify_first=verify_first, stage_all=stage_all, owner=owner)
        return Plan(source, targets, work, ahead=ahead, ring=ring, deferred=deferred)
    layout = _layout(saved)
    targets, work, needed, partial = reshard.land(layout, templates, lent, cast=cast, records=records)
    return Plan(layout, targets, work, records=needed, partial=partial)


def load(
    source: VersionSource,
    templates: dict[str, Leaf],
    executor: concurrent.futures.Executor,
    threads: int = 2,
    lent: memoryview | None = None,
) -> Any:
    """Read, verify and decode every record of ``source``; returns the rebuilt state (blocking).

    :func:`plan`, :meth:`Plan.run`, then :func:`~tierckpt.restore.landing.finish`; several ranks agree
    between the last two, so that no template is written before every rank verified its part.
    """
    planned = plan(source, templates, lent)
    # A plan of a whole source reads that source (through its own layout too): nothing else to open.
    return finish(planned.saved, planned.run(source, executor, threads))
