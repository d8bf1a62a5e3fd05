"""The tier interfaces: :class:`Tier`, and :class:`GroupTier` for a tier several ranks write together.

Call order for a :class:`Tier` (all on the engine thread, the library's event loop):

1. ``await open()`` once: create, sweep leftovers of a crashed run, index committed versions.
2. Any interleaving of ``versions()``, ``lease(step)``, ``await read(step)`` and ``await delete(step)``.
   ``await write(source)`` followed by ``await commit(staged)`` (or ``await abort(staged)``) stores a
   version: one write at a time per tier (its flusher's), concurrent with reads of other versions.
3. ``await close()`` once, after the tier's flusher has stopped.

A tier's ``read`` returns a :class:`~tierckpt.format.source.VersionSource`, the version's bytes as
every flush and restore reads them.

Bulk bytes never move on the event loop: ``write`` and ``read``'s sources run their byte work in the
tier's own threads. A leased version is never deleted; ``delete`` of a leased step raises.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures
import contextlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from tierckpt.config import TierConfig
from tierckpt.format.lineage import Lineage
from tierckpt.format.saved_layout import SavedLayout, source_layout
from tierckpt.format.source import VersionSource as VersionSource  # re-exported: it was defined here


@dataclass(frozen=True)
class VersionInfo:
    """One committed version on one tier, as :meth:`Checkpointer.versions` reports it."""

    tier: str
    step: int
    nbytes: int  # bytes held on the tier (after compression)
    created: float  # unix time the state was saved
    path: str | None = None  # the version's directory on a filesystem tier
    # False: its manifest did not verify when the tier was opened. Restore tries it last-resort style
    # (and warns); retention neither counts nor deletes it, so a damaged newer version can never
    # push good ones out.
    valid: bool = True
    # A differential version (a tier with ``delta``): the step of the whole version it depends on, and
    # which version after that base it is (0: a whole version). ``needed_by``: of a whole version, the
    # differential versions on this tier that depend on it (retention keeps it while they are kept).
    base: int | None = None
    chain: int = 0
    needed_by: tuple[int, ...] = ()
    # Which save it is and which saves it descends from (tierckpt.format.lineage), from its record;
    # None: saved before lineages were recorded, or a record that did not verify.
    lineage: Lineage | None = None
    # Saved in a direction training left (a save after a rollback excludes it): set where every tier
    # was looked at (Checkpointer.versions, the CLI), False from a tier alone.
    abandoned: bool = False
    # Why its bytes are damaged: found so by a restore of this process (Checkpointer.versions), or by
    # ``tierckpt verify``, whose mark the tier read when it opened (tierckpt.format.damage); None: not found so.
    damaged: str | None = None

    @property
    def serial(self) -> int:
        """The number of the save() call that made it, across restarts (0: saved before serials were recorded)."""
        return 0 if self.lineage is None else self.lineage.serial


class Part(NamedTuple):
    """One rank's durable part of a version several ranks save, as it reports it to the leader."""

    manifest: str  # the rank manifest's name (a peer tier: the tier's name)
    checksum: int  # of that manifest's bytes, which the commit marker records (0: none)
    nbytes: int  # stored bytes of the part


@dataclass
class Staged:
    """A version written under a temporary name: durable, not yet visible."""

    step: int
    location: Any
    nbytes: int
    created: float
    part: Part | None = None  # of a version several ranks save: this rank's part
    base: int | None = None  # a differential version's base step (the tier's decision: every rank's the same)
    chain: int = 0
    lineage: Lineage | None = None  # from the version's metadata (tierckpt.format.lineage)


class Lease:
    """Pins one version of one tier against retention and deletion until released."""

    def __init__(self, release: Any) -> None:
        self._release = release

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Tier(abc.ABC):
    """One level of storage. See the module docstring for the call order.

    ``executor`` runs the tier's blocking byte work (its sources' chunk reads during a restore); a
    subclass creates it and shuts it down in :meth:`close`.
    """

    executor: concurrent.futures.Executor
    # Whether the earlier version of a step saved again stays readable (kept aside) for the differential
    # versions written against it; else the prune after that commit ends them (they cannot be read).
    keeps_replaced_bases: bool = False
    # Whether a value stored once between ranks is stored once for all of them here (a shared file
    # system, a bucket; not a node's disk): a restore then reads each chunk on the rank that stored it
    # and sends it to the others (tierckpt.restore.replicas).
    reads_replicas_once: bool = False

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.name = config.name
        self._leases: collections.Counter[int] = collections.Counter()
        # The copies a restore of this process found damaged, by (step, created): one save's copy (a
        # step saved again is another), why. Later restores pass them over and retention neither
        # counts nor deletes them (docs/guarantees.md).
        self.found_damaged: dict[tuple[int, float], str] = {}

    def damage_of(self, info: VersionInfo) -> str | None:
        """Why ``info``'s copy here is damaged, as a restore of this process found it or as
        ``tierckpt verify`` marked it (:mod:`tierckpt.format.damage`); None: not known so."""
        found = self.found_damaged.get((info.step, info.created)) if self.found_damaged else None
        return found or info.damaged

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Prepare the tier: create it, sweep what a crash left, index what is committed."""

    @abc.abstractmethod
    def versions(self) -> list[VersionInfo]:
        """Committed versions, oldest step first (from an in-memory index: no I/O)."""

    def lease(self, step: int) -> Lease:
        """Pin ``step`` so retention leaves it alone while it is read, and its base with it (a
        differential version's).

        Raises KeyError when the tier does not hold ``step`` (any more): a caller holding a list of
        versions made earlier moves on instead of reading a version being deleted.
        """
        info = next((i for i in self.versions() if i.step == step), None)
        if info is None:
            raise KeyError(f"tier {self.name!r} holds no step {step}")
        # Reading a differential version reads its base: that stays too, even once the step is saved
        # again meanwhile (the reader then reads the earlier copy, kept aside, and this is its base).
        pinned = (step,) if info.base is None else (step, info.base)
        for s in pinned:
            self._leases[s] += 1

        def release() -> None:
            for s in pinned:
                self._leases[s] -= 1
                if self._leases[s] <= 0:
                    del self._leases[s]
                self.on_release(s)

        return Lease(release)

    @property
    def threads(self) -> int:
        """Threads of :attr:`executor` that read a version's chunks in a restore."""
        return self.config.io_threads

    @property
    def place(self) -> str | None:
        """Where this rank's copies on this tier are, when the tier's name does not say (a node-local
        tier: which node's directory), for messages."""
        return None

    def has_part(self, step: int) -> bool:
        """Whether this rank can read its own part of ``step`` here without another rank's help (a
        node-local tier: only when this rank's node holds it; a peer tier: never, it holds the others')."""
        return True

    def holdings(self) -> Any:
        """What this rank tells the others of this tier once every rank constructed its Checkpointer
        (plain lists and ints), for :meth:`learn`; None: nothing."""
        return None

    async def learn(self, reports: Sequence[Any]) -> None:  # noqa: B027 - optional hook
        """After construction, from every rank's :meth:`holdings` (rank order): what a tier whose
        versions lie with several ranks holds after a restart (a peer tier's copies, a node-local
        tier's directories)."""

    def recovery(self) -> Recovery | None:
        """How this tier gets this rank's part of a version from other ranks in a restore of several
        ranks (a new one for each restore); None when it cannot."""
        return None

    def leased(self, step: int) -> bool:
        return self._leases.get(step, 0) > 0

    def on_release(self, step: int) -> None:  # noqa: B027 - optional hook
        """Called when the last lease on ``step`` goes."""

    @abc.abstractmethod
    async def read(self, step: int) -> VersionSource:
        """Open a committed version for reading; the caller holds a lease on it and closes the source.

        Of a version several ranks saved, this rank's part: what a flush writes further down.
        """

    async def read_whole(self, step: int) -> VersionSource:
        """As :meth:`read`, with every chunk this rank restores, those other ranks stored included."""
        return await self.read(step)

    async def read_layout(self, step: int, rank: int) -> SavedLayout:
        """The saved layout of a committed version, for rank ``rank`` of a job with another layout.

        This default holds one process's snapshot: only the part this process saved (not
        :attr:`~tierckpt.format.saved_layout.SavedLayout.complete`); a tier holding every rank's part
        overrides it.
        """
        return source_layout(await self.read_whole(step), complete=False)

    async def write(self, source: VersionSource, staging: str | None = None) -> Staged:
        """Store ``source`` durably under a temporary name: ``staging`` when the ranks of a group agreed
        on one (:class:`GroupTier`), else a name of the tier's choosing."""
        raise NotImplementedError(f"tier {self.name!r} is not written by flushes")

    async def commit(self, staged: Staged) -> VersionInfo:
        """Make a staged version visible atomically; replaces an older version of the same step."""
        raise NotImplementedError(f"tier {self.name!r} is not written by flushes")

    async def abort(self, staged: Staged) -> None:
        """Remove a staged version that will not be committed."""
        raise NotImplementedError(f"tier {self.name!r} is not written by flushes")

    @abc.abstractmethod
    async def delete(self, step: int) -> None:
        """Remove a committed, unleased version."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads and files."""


class Recovery(abc.ABC):
    """How a tier gets this rank's part of a version from other ranks, in a restore of several ranks:
    a copy a peer holds, another node's directory. Made for one restore by :meth:`Tier.recovery`.

    Collective: :func:`tierckpt.restore.fallback.restore_versions` makes the same calls on every rank, in
    the same order, whether this rank wants anything or not: every rank reports before the ranks agree
    on a step, and every rank fetches at the tier's place in the order of each step tried (its own
    copies on the tiers before it were tried first).
    """

    def report(self) -> Any:
        """What this rank tells the others before the ranks agree on a step (plain lists and ints)."""
        return None

    @abc.abstractmethod
    def reachable(self, reports: Sequence[Any]) -> list[set[int]]:
        """From every rank's :meth:`report` (rank order): the steps each rank can get its part of
        through this tier."""

    @abc.abstractmethod
    async def fetch(self, step: int, wants: bool, held_open: contextlib.ExitStack) -> Tier | None:
        """Serve what other ranks fetch of ``step`` from this rank, and fetch this rank's part when
        ``wants``. Returns a tier to read it from (what it holds goes when ``held_open`` closes), or
        None when this rank fetched nothing.

        Raises:
            CorruptCheckpointError: this rank's fetch failed (its part could not be served, or did not
                arrive whole); what it served meanwhile was served all the same.
        """


class GroupTier(Tier):
    """A tier the ranks of a job write together: each rank stores its part of a version, and the
    version becomes visible on every rank at once, when the leader (rank 0) commits it.

    :mod:`tierckpt.pipeline.ranked` drives it through these steps, on the engine thread of each rank, for
    decision ``n`` of the leader (flush step S), with ``staging`` the name the decision gives:

    Leader (rank 0):
        1. ``staged = await write(source, staging)``: its own part, durable, not visible.
        2. Waits for every follower's report (a :class:`Part`, or a failure), up to
           ``distributed.timeout``.
        3. All parts durable: ``await seal(staged, parts, metadata)`` (the commit marker naming each
           rank's part, in rank order), then ``info = await commit(staged)`` makes the version
           visible; else, or if either raises, ``await abort(staged)``.
        4. Publishes the outcome, with the steps its retention deletes (``delete`` on this rank).

    Follower (every other rank):
        1. ``staged = await write(source, staging)`` (the same ``staging``), reports ``staged.part``
           (or its failure), then ``await settle(staged, outcome)``: its share of the leader's commit,
           if any (``outcome``: the store key of the leader's outcome of this decision).
        2. Waits for the leader's outcome: committed: ``await adopt(staged, nbytes)`` indexes the
           version; abandoned or no outcome in time: ``await abort(staged)``.
        3. ``await forget(step)`` for each step the leader's retention deleted.

    A follower decides nothing: the leader's decisions are the only ones, so every rank says the same
    thing of every version. (Where a tier has several directories, a follower may carry a decision out
    in its own: a node-local tier's keepers seal, rename and delete in their node's directory.)
    """

    @abc.abstractmethod
    async def write(self, source: VersionSource, staging: str | None = None) -> Staged:
        """Store this rank's part of ``source`` durably under ``staging``; ``staged.part`` reports it."""

    @abc.abstractmethod
    async def seal(self, staged: Staged, parts: list[Part], metadata: dict[str, Any]) -> None:
        """The leader, once every rank's part is durable: record ``parts`` (rank order) with the staged version."""

    @abc.abstractmethod
    async def commit(self, staged: Staged) -> VersionInfo:
        """The leader: make the sealed version visible atomically."""

    @abc.abstractmethod
    async def abort(self, staged: Staged) -> None:
        """Either role: give back what this rank staged of a version that will not be committed."""

    async def settle(self, staged: Staged, outcome: str) -> None:  # noqa: B027 - optional hook
        """A follower, its part reported, before it waits for the outcome (at store key ``outcome``):
        its share of the leader's commit (a node-local tier: a node's first rank commits the node's
        directory). Raises only when the group's store is lost; a failure is reported to the leader,
        which abandons the version."""

    @abc.abstractmethod
    async def adopt(self, staged: Staged, nbytes: int) -> VersionInfo:
        """A follower: the leader committed the version this rank staged a part of (``nbytes`` in all)."""

    @abc.abstractmethod
    async def forget(self, step: int) -> None:
        """A follower: the leader deleted ``step``; drop it from this rank's index (a node-local tier's
        keeper deletes it from its node's directory too). Logs what it cannot do; never raises."""
