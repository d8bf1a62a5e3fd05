"""A node's head forwarding one tier's commits between its node's store and the leader's.

For each round the leader publishes (:mod:`tierckpt.pipeline.ranked`), the head's relay, one task on
its engine's loop, reads it from the leader's store (one read the store answers when it is set) and
sets it in its node's store, where each rank of the node reads it. For a decision it then waits for
the node's reports, sets them in the leader's store as one value, reads the outcome there and sets it
in the node's store. So a save costs the leader's store 3 requests of a node's, however many ranks
it has (:mod:`tierckpt.ranks.nodestore`).

A rank that misses its report is named by the head, which waits :data:`HEAD_SHARE` of the timeout, so
that its word reaches the leader before the leader's own wait ends. Once the leader's store cannot be
reached, the head publishes that as the next round, and each rank of its node fails as it would have
on its own. Closing: every rank of the node stops following (it voids its round in the leader's
store, as without relays, and says ``stopped``); the relay ends once all of them did, ending its own
read of the next round the same way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgpack

from tierckpt.pipeline.channel import ROUND_WAIT_S, TierChannel
from tierckpt.ranks.group import CoordinationLost

log = logging.getLogger("tierckpt")

HEAD_SHARE = 0.75
_LOOK_S = 0.02  # between looks at a round when no client could block on it


class NodeRelay:
    """The head's forwarding of one tier's rounds, reports and outcomes (see the module)."""

    def __init__(self, channel: TierChannel) -> None:
        link = channel.group.link
        assert link is not None and link.head
        self.channel = channel
        self.ranks = link.ranks
        self.index = link.index
        self.node = link.store
        self._next = 1
        self._flushing: int | None = None  # the decision whose reports and outcome this relay forwards now
        self._ending = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"tierckpt-relay-{self.channel.tier}")

    async def _run(self) -> None:
        channel, group = self.channel, self.channel.group
        try:
            while not self._ending:
                n, key = self._next, channel.key("round", self._next)
                raw = await self._read(key)
                await self.node.put_raw(key, raw)
                self._next += 1
                if "flush" in msgpack.unpackb(raw, raw=False):
                    self._flushing = n
                    await self._relay_flush(n)
                    self._flushing = None
        except CoordinationLost as exc:
            if group.lost is None:
                return  # this node's own store closed: the engine is closing
            # The leader's store is gone: the node's ranks learn it as the outcome they wait for, if
            # any, and as their next round.
            log.error("tier %r: node %d's relay: %s", channel.tier, self.index, exc)
            lost = {"lost": str(exc)}
            try:
                if self._flushing is not None:
                    await self.node.put(channel.key("outcome", self._flushing), lost)
                await self.node.put(channel.key("round", self._next), lost)
            except CoordinationLost:
                pass
        except Exception:  # a bug: the node's ranks will wait out their timeouts; say why
            log.exception("tier %r: node %d's relay stopped", channel.tier, self.index)
            raise

    async def _read(self, key: str) -> bytes:
        """Round ``key`` from the leader's store, once it is set."""
        group = self.channel.group
        while True:
            got = await asyncio.wrap_future(group.fetch([key], ROUND_WAIT_S))
            if got is not None:
                return got[0]
            looked = await group.get_if_set(key)  # no client to be had (raises CoordinationLost when the store is gone)
            if looked is not None:
                return looked
            await asyncio.sleep(_LOOK_S)

    async def _relay_flush(self, n: int) -> None:
        channel, group, node = self.channel, self.channel.group, self.node
        keys = [channel.key("report", n, r) for r in self.ranks]
        wait = HEAD_SHARE * group.timeout_s
        got: list[Any] | None = None
        if not self._ending:
            got = await node.get_when_set(keys, wait)
        if got is None:
            got = [await node.get(k) if await node.has([k]) else None for k in keys]
        missing = {"error": f"did not report to its node's head within {wait:g} s (dead, hung, or slower than the timeout)"}
        await group.put(channel.key("report", n, "node", self.index), [report if report is not None else missing for report in got])
        outcome = await group.get_when_set([channel.key("outcome", n)], 2 * group.timeout_s)
        if outcome is not None:
            await node.put(channel.key("outcome", n), outcome[0])

    async def finish(self) -> None:
        """Closing, once this rank stopped following: wait (up to the timeout) until every rank of the
        node did, then end the relay."""
        assert self._task is not None
        channel = self.channel
        stopped = [channel.key("stopped", r) for r in self.ranks]
        try:
            if not await self.node.wait_for(stopped, channel.group.timeout_s):
                late = [r for r, key in zip(self.ranks, stopped) if not await self.node.has([key])]
                log.warning("tier %r: rank(s) %s of node %d did not stop following within %g s", channel.tier, late, self.index, channel.group.timeout_s)
            self._ending = True
            if not self._task.done():  # its read of the next round: ended as a stopping follower ends its own
                await channel.group.put_if_absent(channel.key("round", self._next), {"void": channel.group.rank})
            await asyncio.wait_for(asyncio.shield(self._task), channel.group.timeout_s)
        except (CoordinationLost, asyncio.TimeoutError) as exc:
            log.warning("tier %r: node %d's relay did not end (%s)", channel.tier, self.index, exc)
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
