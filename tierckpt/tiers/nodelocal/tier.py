"""A node-local filesystem tier across several nodes (``scope: node``): each node's own directory, and a
version committed on every node or on none.

Each node's ranks write their parts into their node's directory (the tier's ``path``, ``{node}``
replaced by the node's name), and the node's first rank, its *keeper*, locks, sweeps, seals, renames
and deletes there, as rank 0 does in a shared directory. Flush and retention decisions stay rank 0's
(:mod:`tierckpt.pipeline.ranked`); a commit runs in three phases over the group's store:

1. Prepare: every rank writes and fsyncs its part into its node's staging directory and reports it
   (the flusher's report).
2. Seal: with every part reported, rank 0 writes its node's marker (the commit marker of every rank's
   part, plus ``holds``: the ranks whose parts this directory holds), posts the *seal order* (the
   parts and the metadata) and renames its staging directory into place. Every other keeper
   (:meth:`NodeLocalTier.settle`) writes its node's marker from the order, renames into place, and
   posts that it is done, or why not.
3. Decide: rank 0 waits for every keeper up to ``distributed.timeout``. All done: committed, and the
   flusher publishes the outcome. A node not done: rank 0 takes its own copy back and raises a
   :class:`~tierckpt.errors.RankFailureError` naming the node's ranks; the flusher publishes the
   abandonment, and every keeper that renamed takes its copy back on it. An older copy of the same step, moved aside by the rename, is put back then, and removed only once
   the version is committed. A keeper that said it committed and then hears nothing from rank 0
   keeps its copy: rank 0 may have committed before it died, and the next start judges.

So "committed" can be judged from the disks alone when the job restarts: at construction every
keeper reports what its directory holds (:meth:`NodeLocalTier.holdings`), and a step is listed
(:meth:`NodeLocalTier.learn`) only if the nodes' markers agree and together hold every rank's part. A
step some node lacks (it was wiped, replaced, or its keeper died mid-commit) is not listed; its copies
on the other nodes are removed once a newer version commits. A version of another world size is
ignored with one warning, never half-read, and deleted only when this job saves the same step.
A step saved again whose commit a keeper's crash cut short after its rename leaves that node with
the new save in place and the committed one moved aside: the keeper keeps both at open (a shared
tier removes the one aside), reports both, and puts back the one the other nodes hold.

A value stored once between ranks (``save(replicated=...)``) is stored once per node: its chunks are
shared among the node's ranks only, so that a node's directory holds every byte its ranks restore.

With ``delta``, each rank writes its part against its own part of the base in its node's directory,
and a base saved again stays aside on every node while versions written against it are kept.

A rank reads its own part from its node's directory (:meth:`NodeLocalTier.has_part`); a rank whose
part lies on another live node's directory (the job came back with its ranks on other nodes) fetches
it from there in a restore (:meth:`NodeLocalTier.fetch_plan`, :mod:`tierckpt.tiers.nodelocal.fetch`). A
node-local tier serves only the layout that saved it, as host memory does (:meth:`read_layout` is
this rank's part alone): a restore into another layout reads a shared tier.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any, Sequence

from tierckpt.config import TierConfig
from tierckpt.errors import CorruptCheckpointError, RankFailureError
from tierckpt.format import MANIFEST_FILE, CommitMarker, Manifest, version_dirname
from tierckpt.format.saved_layout import SavedLayout
from tierckpt.ranks.group import CoordinationLost, RankGroup
from tierckpt.tiers.base import Part, Staged, Tier, VersionInfo
from tierckpt.tiers.filesystem import FilesystemTier
from tierckpt.tiers.stored.commit import Left
from tierckpt.tiers.stored.delta import BaseChoice, DeltaBase
from tierckpt.tiers.stored.read import read_head
from tierckpt.tiers.nodelocal.fetch import NodeRecovery
from tierckpt.tiers.nodelocal.plan import Holding, complete_versions

log = logging.getLogger("tierckpt")

__all__ = ["NodeLocalTier"]


class NodeLocalTier(FilesystemTier):
    """A filesystem tier with ``scope: node`` in a job on several nodes. See the module docstring.

    ``nodes``: the group positions of each node's ranks, ascending, this rank's node among them;
    ``node_name``: what names this rank's node in messages (default: its index in ``nodes``).
    """

    reads_replicas_once = False  # a value is stored once per node here: each node holds its own copy

    def __init__(self, config: TierConfig, group: RankGroup, nodes: Sequence[Sequence[int]], node_name: str | None = None) -> None:
        super().__init__(config, group)
        self.nodes = tuple(tuple(n) for n in nodes)
        self.node_index = next(i for i, n in enumerate(self.nodes) if group.rank in n)
        self.node = self.nodes[self.node_index]
        self.node_name = str(self.node_index) if node_name is None else node_name
        self.node_names = tuple(str(i) for i in range(len(self.nodes)))  # every node's, once learn() heard them
        self.keeper = self.node[0]
        self.sharing = self.node
        self.group: RankGroup = group
        self._local: dict[int, VersionInfo] = {}  # what this node's directory holds, committed or not
        self._held: dict[int, Holding] = {}  # of those, each version's marker, as read at open
        self._orphans: set[int] = set()  # held here, committed on no other node: removed once a newer commits
        self._placed: dict[str, str | None] = {}  # a keeper's staged versions renamed into place, not yet decided
        self._aside: dict[int, Holding] = {}  # a keeper: copies moved aside by a replacement cut short, kept at open
        self._outcomes: dict[str, str] = {}  # a keeper: the store key of rank 0's outcome of each staged version
        self._doomed: set[int] = set()  # a keeper: steps retention deleted while this rank held a lease
        self._tasks: set[asyncio.Task[None]] = set()  # deletions deferred to a lease's release
        # One deletion at a time, in the order asked: a lease on a differential version releases it before its base.
        self._removal = asyncio.Lock()
        self._where: dict[int, dict[int, int]] = {}  # of each listed step: rank -> the node whose directory holds its part

    @property
    def place(self) -> str:
        return f"node {self.node_name} ({self.root})"

    @property
    def _open_key(self) -> str:
        return f"open/{self.name}/node-{self.node_index}"

    def _key(self, staged: Staged, *parts: Any) -> str:
        return "/".join(("nodes", self.name, str(staged.location), *map(str, parts)))

    # -- opening, and learning what is committed across the nodes ------------------------------------

    async def _open(self) -> None:
        await super()._open()
        self._local, self._index = self._index, {}  # listed once learn() knows what every node holds

    def _seen(self, step: int, head: Manifest | CommitMarker) -> None:
        if isinstance(head, CommitMarker) and head.holds is not None:
            self._held[step] = Holding.of(head)

    async def _keep_aside(self, step: int, name: str) -> bool:
        """At open: a copy of ``step`` moved aside by a replacement that a crash cut short is kept, for
        :meth:`learn` to tell which copy the other nodes committed (a shared tier removes it)."""
        try:
            head = await asyncio.to_thread(read_head, self.root / name, tier=self.name, step=step)
        except CorruptCheckpointError:
            return False
        if not isinstance(head, CommitMarker) or head.holds is None:
            return False
        self._aside[step] = Holding.of(head, name)
        return True

    def holdings(self) -> list[Any]:
        """This node's name and what its directory holds (its keeper reports; the others report nothing)."""
        if not self.keeps:
            return []
        held = [h for step, h in sorted(self._held.items()) if step in self._local] + list(self._aside.values())
        return [self.node_name, [h.pack() for h in held]]

    async def learn(self, reports: Sequence[Sequence[Any]]) -> None:
        """List the versions committed across the nodes, from every rank's :meth:`holdings` (rank order);
        a keeper puts back a copy moved aside when that is the one the other nodes committed."""
        world = self.group.world
        self.node_names = tuple(str(reports[node[0]][0]) for node in self.nodes)
        by_node = {i: [Holding.unpack(raw) for raw in reports[node[0]][1]] for i, node in enumerate(self.nodes)}
        complete = complete_versions(by_node, world)
        foreign = sorted(s for s, info in self._local.items() if info.valid and (s not in self._held or self._held[s].world != world))
        if foreign and self.keeps:
            log.warning(
                "tier %r: %s holds step(s) %s saved by another number of ranks, or not by a node-local tier of "
                "this job; ignored, and left as they are (this job has %d ranks on %d nodes)",
                self.name, self.root, foreign, world, len(self.nodes),
            )
        for step, (where, held) in complete.items():
            self._where[step] = where
            local = self._local.get(step)
            path = local.path if local else None
            self._index[step] = VersionInfo(self.name, step, held.nbytes, held.created, path, base=held.base, chain=held.chain, lineage=held.lineage)
        for step, (_, held) in complete.items():  # once every version is listed: which ones a copy aside is the base of
            await self._settle_aside(step, held)
        mine = self._held.keys() & self._local.keys()
        self._orphans = {s for s in mine if s not in complete and self._held[s].world == world}
        self._held = {s: h for s, h in self._held.items() if s in complete}

    async def _settle_aside(self, step: int, committed: Holding) -> None:
        """Of a step committed across the nodes, keep this node's copy of that version: the one moved
        aside is put back in place of one the other nodes never committed; else it is kept while
        differential versions written against it are (the step was saved again since), or removed."""
        aside = self._aside.get(step)
        if aside is None or aside.aside is None:
            return
        del self._aside[step]
        final = version_dirname(step)
        if aside.parts == committed.parts and self._held.get(step, aside).parts != committed.parts:
            log.warning("tier %r: putting back %s's committed copy from %s (the save in place was never committed)", self.name, final, aside.aside)
            trash = f".trash-{final}-{uuid.uuid4().hex[:12]}"
            await self.store.withdraw(final, trash)
            await self.store.publish(aside.aside, final)
            await self.store.sync()
            await self.leftovers.discard(trash)
            self._held[step] = dataclasses.replace(aside, aside=None)
        elif self._needs_earlier(step):
            self.leftovers.keep(step, aside.aside)
        else:
            await self.leftovers.discard(aside.aside)

    def has_part(self, step: int) -> bool:
        held = self._held.get(step)
        return step in self._index and held is not None and self.rank in held.holds

    def _choose_base(self, step: int) -> BaseChoice | None:
        # A base no rank holds its part of on its own node now (the job came back with its ranks on other
        # nodes) would make every part whole until the next whole version: this one is whole instead.
        choice = super()._choose_base(step)
        if choice is None or any(self._where.get(choice.step, {}).get(r) == n for r, n in self._as_saved().items()):
            return choice
        if self.group.leader:
            log.info("tier %r: step %d is written whole: no rank's part of step %d, the base it was due, is on that rank's node now", self.name, step, choice.step)
        return None

    async def _open_base(self, choice: BaseChoice) -> DeltaBase | None:
        """This rank's part of the base; None (its part is written whole) when another node holds it."""
        if not self.has_part(choice.step):
            node = self._where.get(choice.step, {}).get(self.rank, self.node_index)
            log.info("tier %r: rank %d writes its part whole: its part of the base, step %d, is on node %s", self.name, self.rank, choice.step, self.node_names[node])
            return None
        return await super()._open_base(choice)

    def _as_saved(self) -> dict[int, int]:
        """Where the parts of a version committed in this run are: each rank's on its own node."""
        return {r: i for i, node in enumerate(self.nodes) for r in node}

    def node_of(self, rank: int) -> int:
        """The index of the node ``rank`` (a group position) runs on."""
        return next(i for i, node in enumerate(self.nodes) if rank in node)

    def recovery(self) -> NodeRecovery:
        return NodeRecovery(self)

    def fetchable(self, step: int) -> bool:
        """Whether this rank's part of listed ``step`` lies on another node's directory (fetched in a restore)."""
        where = self._where.get(step)
        return where is not None and where.get(self.rank, self.node_index) != self.node_index

    def fetch_plan(self, step: int, wanting: Sequence[int]) -> dict[int, int]:
        """Which of the ``wanting`` ranks fetch their part of ``step`` from another node, and from
        which rank of it (spread over that node's ranks by the fetching rank). The same on every rank."""
        where = self._where.get(step, {})
        plan = {}
        for rank in wanting:
            node = where.get(rank)
            if node is not None and node != self.node_of(rank):
                holders = self.nodes[node]
                plan[rank] = holders[rank % len(holders)]
        return plan

    # -- committing across the nodes -------------------------------------------------------------------

    async def seal(self, staged: Staged, parts: list[Part], metadata: dict[str, Any]) -> None:
        """Rank 0: its node's marker, then the seal order for every other node's keeper."""
        await super().seal(staged, parts, metadata)  # its node's marker (naming the ranks it holds)
        await self.group.put(self._key(staged, "seal"), {"parts": [list(p) for p in parts], "metadata": metadata})

    async def commit(self, staged: Staged) -> VersionInfo:
        """Rank 0: into place on its node, then committed once every other node's keeper is done."""
        self._placed[staged.location] = await self._place(staged)
        others = [i for i in range(len(self.nodes)) if i != self.node_index]
        keys = {i: self._key(staged, "done", i) for i in others}
        await self.group.wait_for(list(keys.values()), self.group.timeout_s)
        failures: dict[int, str] = {}
        for i, key in keys.items():
            said = await self.group.get(key) if await self.group.has([key]) else {"error": f"no word within {self.group.timeout_s:g} s"}
            if said.get("error"):
                failures[i] = str(said["error"])
        if failures:
            await self._take_back(staged)
            ranks = tuple(sorted(r for i in failures for r in self.nodes[i]))
            said = "; ".join(f"node {self.node_names[i]} (ranks {', '.join(map(str, self.nodes[i]))}): {why}" for i, why in sorted(failures.items()))
            raise RankFailureError(
                f"tier {self.name!r}: step {staged.step} was abandoned on every node: not committed on {said}",
                tier=self.name,
                step=staged.step,
                ranks=ranks,
            )
        return await self._committed(staged)

    async def settle(self, staged: Staged, outcome: str) -> None:
        """A keeper other than rank 0: seal and rename its node's copy on rank 0's order, and say so."""
        if not self.keeps:
            return
        self._outcomes[staged.location] = outcome
        key = self._key(staged, "seal")
        if await self.group.wait_any([key, outcome], 2 * self.group.timeout_s) != key:
            return  # abandoned before it was sealed (the outcome came first), or no word: the outcome aborts
        order = await self.group.get(key)
        try:
            marker = self._marker(staged, [Part(*p) for p in order["parts"]], order["metadata"])
            await self.store.write_small(f"{staged.location}/{MANIFEST_FILE}", marker.encode())
            await self.store.sync(staged.location)
            staged.nbytes = marker.stored_bytes
            self._placed[staged.location] = await self._place(staged)
            reply: dict[str, Any] = {}
        except Exception as exc:
            log.error("tier %r: node %s could not commit step %d: %s", self.name, self.node_name, staged.step, exc)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        await self.group.put(self._key(staged, "done", self.node_index), reply)

    async def adopt(self, staged: Staged, nbytes: int) -> VersionInfo:
        if not self.keeps:
            staged.nbytes = nbytes
            info = self._indexed(staged)
            self._where[staged.step] = self._as_saved()
            self._held[staged.step] = Holding(staged.step, self.group.world, (), self.node, staged.created, nbytes, lineage=staged.lineage)
            return info
        staged.nbytes = nbytes
        return await self._committed(staged)

    async def _committed(self, staged: Staged) -> VersionInfo:
        """A keeper: the version is committed on every node; the copy its rename moved aside goes, and
        so do the versions older than it that no other node holds."""
        self._outcomes.pop(staged.location, None)
        self._doomed.discard(staged.step)  # a lease on the earlier save of this step no longer dooms it
        old = self._placed.pop(staged.location, None)
        if old is not None:
            await self._set_aside(staged.step, old)
        info = self._indexed(staged)
        self._where[staged.step] = self._as_saved()
        self._local[staged.step] = info
        self._held[staged.step] = Holding(staged.step, self.group.world, (), self.node, staged.created, staged.nbytes, lineage=staged.lineage)
        for step in sorted(s for s in self._orphans if s < staged.step):
            self._orphans.discard(step)
            self._local.pop(step, None)
            log.info("tier %r: removing step %d, which the other nodes do not hold", self.name, step)
            await self._remove(step)
        self._orphans.discard(staged.step)
        for step in sorted(s for s in self._aside if s < staged.step):  # a copy aside no node needed
            name = self._aside.pop(step).aside
            if name is not None:
                await self.leftovers.discard(name)
        return info

    async def abort(self, staged: Staged) -> None:
        outcome = self._outcomes.pop(staged.location, None)
        if self.keeps and staged.location in self._placed:
            if not self.group.leader and not await self._abandoned(outcome):
                # This node said it committed, and rank 0 said nothing since: rank 0 may have committed
                # the version before it died or stalled. Taking this copy back could unmake a committed
                # version; left in place (and not listed), the next start judges it from every node's disk.
                self._placed.pop(staged.location)
                log.warning(
                    "tier %r: no outcome of step %d from rank 0 after node %s committed its part; its copy is kept "
                    "and judged at the next start", self.name, staged.step, self.node_name,
                )
                return
            await self._take_back(staged)
        await super().abort(staged)

    async def _abandoned(self, outcome: str | None) -> bool:
        """Whether rank 0 published the abandonment of the version whose outcome is at store key ``outcome``."""
        try:
            return outcome is not None and await self.group.has([outcome]) and "error" in await self.group.get(outcome)
        except CoordinationLost:
            return False

    async def _take_back(self, staged: Staged) -> None:
        """Undo this node's rename of a version the other nodes did not commit, old copy put back."""
        old = self._placed.pop(staged.location)
        await self._undo_commit(staged, old)
        if old is None:
            self._index.pop(staged.step, None)  # else the earlier save of the step, put back, stays listed

    def _after_take_back(self, staged: Staged, left: Left) -> None:
        # Nothing is committed here before every node is: a version the disk would not take back is not
        # listed, and an older copy left aside stays for the next open to put back.
        if left.new_in_place or left.old_aside is not None:
            log.error("tier %r: node %s's directory holds step %d as the disk left it; judged at the next start", self.name, self.node_name, staged.step)

    # -- retention -------------------------------------------------------------------------------------

    async def forget(self, step: int) -> None:
        """Rank 0's retention deleted ``step``: the node's keeper deletes it here, the others forget it."""
        self._held.pop(step, None)
        self._where.pop(step, None)
        if not self.keeps:
            self._index.pop(step, None)
            return
        if self.leased(step):
            self._index.pop(step, None)
            self._doomed.add(step)  # read here now (a flush below, a restore): deleted on release
            return
        await self._remove(step)

    async def delete(self, step: int) -> None:
        await super().delete(step)
        self._local.pop(step, None)
        self._held.pop(step, None)
        self._where.pop(step, None)

    def on_release(self, step: int) -> None:
        if step in self._doomed and not self.leased(step):
            self._doomed.discard(step)
            task = asyncio.get_running_loop().create_task(self._remove(step))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _remove(self, step: int) -> None:
        async with self._removal:
            try:
                await self.delete(step)
            except Exception as exc:
                log.warning("tier %r: could not delete step %d: %s", self.name, step, exc)

    # -- reading -----------------------------------------------------------------------------------------

    async def read_layout(self, step: int, rank: int) -> SavedLayout:
        # This rank's part alone: another layout is read from a shared tier.
        return await Tier.read_layout(self, step, rank)
