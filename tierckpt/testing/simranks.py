"""Thousands of ranks in one process: the commit protocol's real code, with the bytes left out.

A job of 10,000 ranks cannot run here, but its coordination can: :func:`simulate_saves` drives the
real :class:`~tierckpt.pipeline.ranked.LeaderFlusher` and a real
:class:`~tierckpt.pipeline.ranked.FollowerFlusher` per other rank, each with a real
:class:`~tierckpt.ranks.group.RankGroup` (its keys, its waits, its tally of requests), through every
save's round, reports, commit and outcome. Only what no real part can produce at that scale
is replaced, and nothing else:

- the store: :class:`SimStore`, a dict with the TCPStore's methods (``set``, ``get``, ``multi_set``,
  ``multi_get``, ``check``, ``add``, ``compare_set``, ``delete_key``), its blocking ``wait`` and the
  reads it answers once their keys are set as futures resolved then (a real TCPStore would need a
  socket and a thread per waiting rank);
- the tier: :class:`NullTier`, a :class:`~tierckpt.tiers.base.GroupTier` that stores no bytes but
  seals a real :class:`~tierckpt.format.CommitMarker` of every rank's part, so the global record's
  size is the real one;
- host memory: every rank has each save at once (:class:`_Everything`).

``tests/test_scale_simulation.py`` holds the simulation's counts against a real job's, so it cannot
drift from the code. ``benchmarks/scale.py --simulate`` prints them for 1,000 to 10,000 ranks.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import msgpack

from tierckpt.config import FlushPolicy, KeepPolicy, TierConfig
from tierckpt.format import CommitMarker
from tierckpt.pipeline.flusher import Located
from tierckpt.pipeline.ranked import FollowerFlusher, LeaderFlusher
from tierckpt.policy import Candidate
from tierckpt.ranks.group import RankGroup
from tierckpt.ranks.nodes import split_nodes
from tierckpt.ranks.nodestore import NodeLink, relayed_nodes
from tierckpt.ranks.tally import StoreTally
from tierckpt.format.lineage import Lineage, lineage_of
from tierckpt.tiers.base import GroupTier, Lease, Part, Staged, VersionInfo

__all__ = ["NullTier", "SaveCost", "SimGroup", "SimStore", "leader_seconds", "simulate_saves"]


class SimStore:
    """The TCPStore's methods over a dict, in this thread; a wait is a future resolved by the set
    that completes its keys."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self._waits: dict[str, list[tuple[set[str], concurrent.futures.Future[bool]]]] = collections.defaultdict(list)

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value
        for missing, future in self._waits.pop(key, []):
            missing.discard(key)
            if not missing and not future.done():
                future.set_result(True)

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data[k] for k in keys]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str | bytes, desired: bytes) -> bytes:
        if key not in self.data and not expected:
            self.set(key, desired)
        elif key in self.data and self.data[key] == (expected.encode() if isinstance(expected, str) else expected):
            self.set(key, desired)
        return self.data.get(key, desired if not expected else b"")

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def wait(self, keys: Sequence[str]) -> concurrent.futures.Future[bool]:
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        missing = {k for k in keys if k not in self.data}
        if not missing:
            future.set_result(True)
        for key in missing:
            self._waits[key].append((missing, future))
        return future


class SimGroup(RankGroup):
    """A real RankGroup whose store is a :class:`SimStore`, called in this thread (its tally counts
    every request as over a real store)."""

    def __init__(self, rank: int, world: int, store: SimStore, timeout_s: float = 600.0, host_rank: int = 0) -> None:
        super().__init__(rank, world, range(world), "sim", timeout_s, store, None, address=("sim", 0), host_rank=host_rank)
        self._sim = store

    async def _call(self, method: str, *args: Any) -> Any:
        result = getattr(self._sim, method)(*args)
        self.tally.record(method, args, result)
        return result

    def watch(self, keys: Sequence[str], timeout_s: float) -> concurrent.futures.Future[bool]:
        self.tally.record("wait", list(keys))
        return self._sim.wait(keys)

    def fetch(self, keys: Sequence[str], timeout_s: float) -> concurrent.futures.Future[list[bytes] | None]:
        self.tally.record("multi_get" if len(keys) > 1 else "get", [list(keys)] if len(keys) > 1 else list(keys))
        values: concurrent.futures.Future[list[bytes] | None] = concurrent.futures.Future()
        values.set_running_or_notify_cancel()

        def answer(_: object) -> None:
            got = self._sim.multi_get(list(keys))
            self.tally.answer(got)
            values.set_result(got)

        self._sim.wait(keys).add_done_callback(answer)
        return values

    def close(self) -> None:
        self._executor.shutdown(wait=False)


class NullTier(GroupTier):
    """A tier that stores nothing: each rank's part is a name and a size; the leader seals a real
    commit marker of every part and keeps its encoded size (:attr:`marker_bytes`)."""

    def __init__(self, name: str = "shared", part_bytes: int = 1 << 30) -> None:
        super().__init__(TierConfig(name=name, type="filesystem", path=Path("/nonexistent")))
        self.part_bytes = part_bytes
        self.committed: list[VersionInfo] = []
        self.marker_bytes = 0

    def versions(self) -> list[VersionInfo]:
        return list(self.committed)

    async def read(self, step: int) -> Any:
        raise NotImplementedError("a NullTier stores no bytes")

    async def write(self, source: Any, staging: str | None = None) -> Staged:
        part = Part(f"manifest-{staging}.msgpack", 0, self.part_bytes)
        return Staged(source.step, staging, self.part_bytes, time.time(), part, lineage=lineage_of(source.metadata))

    async def seal(self, staged: Staged, parts: list[Part], metadata: dict[str, Any]) -> None:
        marker = CommitMarker(staged.step, staged.created, len(parts), tuple((p.manifest, p.checksum, p.nbytes) for p in parts), metadata)
        self.marker_bytes = len(marker.encode())

    async def commit(self, staged: Staged) -> VersionInfo:
        info = VersionInfo(self.name, staged.step, staged.nbytes, staged.created, lineage=staged.lineage)
        self.committed.append(info)
        return info

    async def abort(self, staged: Staged) -> None:
        pass

    async def adopt(self, staged: Staged, nbytes: int) -> VersionInfo:
        return await self.commit(staged)

    async def forget(self, step: int) -> None:
        self.committed = [v for v in self.committed if v.step != step]

    async def delete(self, step: int) -> None:
        await self.forget(step)


@dataclass
class _Source:
    step: int
    metadata: dict[str, Any]

    def close(self) -> None:
        pass


class _Everything:
    """Upstream and flush events of one simulated rank: it holds every save; commits are counted."""

    def __init__(self, done: collections.Counter[int], changed: asyncio.Event) -> None:
        self._done, self._changed = done, changed

    def locate(self, tier: str, candidate: Candidate) -> Located:
        async def open_() -> Any:
            return _Source(candidate.step, {})

        return Located("ram", Lease(None), open_)

    def defer(self, tier: str, candidate: Candidate) -> bool:
        return False

    def spared(self, tier: str, step: int) -> bool:
        return False

    def direction(self) -> Lineage | None:
        return None  # simulated versions have no lineage: retention counts every one

    def committed(self, tier: str, candidate: Candidate, info: VersionInfo, started: float) -> None:
        self._done[candidate.step] += 1
        self._changed.set()

    def failed(self, tier: str, candidate: Candidate | None, error: BaseException) -> None:
        raise AssertionError(f"a simulated flush failed: {error}")

    def skipped(self, tier: str, token: int, step: int) -> None:
        pass

    def forced(self, tier: str, candidate: Candidate) -> None:
        pass

    def delete_failed(self, tier: str, step: int, error: BaseException) -> None:
        raise AssertionError(f"a simulated deletion failed: {error}")

    def deleted(self, tier: str, step: int) -> None:
        pass


@dataclass
class SaveCost:
    """What one save cost the store: requests by kind, all ranks and the leader's alone, the bytes
    through the store, the largest message, the commit marker's size, and the seconds of the whole
    simulated save (every rank's coordination and the store's, on one core)."""

    world: int
    requests: dict[str, int]
    by_key: dict[str, int]
    leader_requests: dict[str, int]
    bytes: int
    largest: int
    marker_bytes: int
    seconds: float
    node_by_key: dict[str, int]  # of the nodes' own stores, all nodes together (relays: ``per_node``)

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    @property
    def per_rank(self) -> float:
        return self.total / self.world


def _tally(groups: Sequence[RankGroup]) -> StoreTally:
    total = StoreTally()
    for group in groups:
        total.requests.update(group.tally.requests)
        total.by_key.update(group.tally.by_key)
        total.sent += group.tally.sent
        total.received += group.tally.received
        total.largest = max(total.largest, group.tally.largest)
    return total


def _link(groups: Sequence[RankGroup], per_node: int) -> list[RankGroup]:
    """Nodes of ``per_node`` ranks, each but the leader's relaying through a store of its own (as
    :func:`~tierckpt.ranks.nodestore.link_nodes` sets them up); the nodes' store views."""
    world = len(groups)
    relayed = relayed_nodes(split_nodes(world, world // per_node))
    views: list[RankGroup] = []
    for group in groups:
        group.relayed = relayed
    for index, ranks in relayed.items():
        store = SimStore()
        for r in ranks:
            view = SimGroup(r, world, store, host_rank=ranks[0])
            groups[r].link = NodeLink(index, ranks, view)
            views.append(view)
    return views


async def _simulate(world: int, saves: int, keep_last: int | None, per_node: int | None = None) -> list[SaveCost]:
    store = SimStore()
    done: collections.Counter[int] = collections.Counter()
    changed = asyncio.Event()
    groups = [SimGroup(r, world, store) for r in range(world)]
    views = _link(groups, per_node) if per_node else []
    tiers = [NullTier() for _ in range(world)]
    policy = FlushPolicy()
    flushers = []
    for rank, (group, tier) in enumerate(zip(groups, tiers)):
        if keep_last is not None:
            tier.config = TierConfig(name=tier.name, type="filesystem", path=Path("/nonexistent"), keep=KeepPolicy(last=keep_last))
        kind = LeaderFlusher if rank == 0 else FollowerFlusher
        events = _Everything(done, changed)
        flushers.append(kind(tier, policy, events, upstream=events, clock=time.monotonic, group=group))
    for flusher in flushers:
        flusher.start()
    costs: list[SaveCost] = []
    try:
        await asyncio.sleep(0)  # every follower is reading the first round
        for step in range(1, saves + 1):
            before, leader_before, nodes_before = _tally(groups), groups[0].tally.copy(), _tally(views)
            began = time.perf_counter()
            for flusher in flushers:
                flusher.offer(step, step, step)
            while done[step] < world:
                changed.clear()
                await changed.wait()
            await asyncio.sleep(0)  # the followers' last requests of this save (the next round's read)
            seconds = time.perf_counter() - began
            after, leader = _tally(groups), groups[0].tally
            costs.append(SaveCost(
                world, dict(after.requests - before.requests), dict(after.by_key - before.by_key), dict(leader.requests - leader_before.requests),
                (after.sent + after.received) - (before.sent + before.received), after.largest, tiers[0].marker_bytes, seconds,
                dict(_tally(views).by_key - nodes_before.by_key),
            ))
    finally:
        await asyncio.gather(*(flusher.stop() for flusher in flushers))
        for group in groups:
            group.close()
    return costs


def simulate_saves(world: int, saves: int = 5, *, keep_last: int | None = None, per_node: int | None = None) -> list[SaveCost]:
    """``saves`` saves of a job of ``world`` ranks through the real commit protocol; one
    :class:`SaveCost` per save (the first pays for setting up the waits). ``per_node``: nodes of that
    many ranks, relaying (``distributed.relay: nodes``); else every rank talks to the leader's store."""
    return asyncio.run(_simulate(world, saves, keep_last, per_node))


async def _leader_alone(world: int, saves: int) -> list[float]:
    store = SimStore()
    done: collections.Counter[int] = collections.Counter()
    changed = asyncio.Event()
    group, tier = SimGroup(0, world, store), NullTier()
    events = _Everything(done, changed)
    leader = LeaderFlusher(tier, FlushPolicy(), events, upstream=events, clock=time.monotonic, group=group)
    report = msgpack.packb({"part": ["manifest-r.msgpack", 0, tier.part_bytes]}, use_bin_type=True)
    for n in range(1, saves + 1):  # every follower's report is in before the leader decides
        store.multi_set([leader.channel.key("report", n, r) for r in range(1, world)], [report] * (world - 1))
    leader.start()
    seconds: list[float] = []
    try:
        for step in range(1, saves + 1):
            began = time.process_time()
            leader.offer(step, step, step)
            while done[step] < 1:
                changed.clear()
                await changed.wait()
            seconds.append(time.process_time() - began)
    finally:
        await leader.stop()
        group.close()
    return seconds


def leader_seconds(world: int, saves: int = 5) -> list[float]:
    """The CPU seconds of each save on the leader alone (its round, the reports of ``world``
    ranks read and sealed into the commit marker, the outcome), the store's side included: a TCPStore
    is served by a thread of the leader's own process."""
    return asyncio.run(_leader_alone(world, saves))
