"""Flushing a version that several ranks save: the leader decides, every rank writes its part, the
leader commits once all parts are durable.

Per tier below host memory, the leader's flusher runs the tier's flush policy as a single process
would, and publishes each decision in the group's store as the next *round* (round ``n``: flush step
S, the leader's save number A; one request). Each follower reads the rounds in order, each with one
read that the store answers the moment the leader publishes it (a follower between rounds sends
nothing). A follower that stops voids the round it waits for, unless the leader published it first
(the first writer wins; the leader then publishes in the next round). For a decision, a follower
waits for its
own snapshot of S (its training may be a little behind), its save number A where it has it (the
ranks number their saves alike: a step saved twice, and flushed twice by the leader, is written
twice here too, each time from the save the leader took), writes its part into the staging
directory decision ``n`` names, and reports the part (file, checksum, bytes) or its failure. The leader waits for every report up to
``distributed.timeout``; with all parts durable it writes the commit marker and renames the version
into place, then publishes the outcome with the versions retention deletes; else it removes the
staging directory and publishes the abandonment, naming each missing or failed rank. Every rank's
handle resolves from that outcome, so all of them say the same thing.

So flush and retention decisions are made once, by the leader, and no rank can take another: a
follower keeps each eligible snapshot until a decision takes it or a newer one (or a horizon round:
the newest save the leader has dealt with, step and save number) passes it over. As on one process, every
tier selects on the stream of saves, and each rank reads its part of a decided version from its own
host memory, or else from a filesystem tier above that holds it (the leader's retention spares what
a tier below waits for, on every rank). A follower whose leader is gone (the store cannot be
reached) fails what waits and what comes, naming rank 0. On a node that relays (``distributed.relay``),
a follower does all this through its node's store, and its node's head forwards (:mod:`tierckpt.pipeline.relay`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import replace
from typing import Any

import msgpack

from tierckpt.ranks.group import CoordinationLost, RankGroup
from tierckpt.config import FlushPolicy
from tierckpt.pipeline.channel import ROUND_WAIT_S, TierChannel, rank_failure
from tierckpt.pipeline.flusher import FlushEvents, Flusher, Located
from tierckpt.pipeline.relay import NodeRelay
from tierckpt.policy import Candidate, finished, pass_over, pass_over_older_saves, take
from tierckpt.tiers.base import GroupTier, Staged, Tier, VersionInfo

log = logging.getLogger("tierckpt")

_FOLLOW_POLL_S = 0.02
_EVERY_SAVE = 2**62  # a save number above any: (step, _EVERY_SAVE) covers every save of that step


class _GroupFlusher(Flusher):
    """A flusher of a tier the ranks write together: it depends on :class:`~tierckpt.tiers.base.GroupTier`
    alone, and talks to the other ranks through the tier's :class:`~tierckpt.pipeline.channel.TierChannel`."""

    tier: GroupTier
    retries_retention = False

    def __init__(self, tier: Tier, policy: FlushPolicy, events: FlushEvents, *, group: RankGroup, **kwargs: Any) -> None:
        if not isinstance(tier, GroupTier):
            raise TypeError(f"tier {tier.name!r} ({type(tier).__name__}) cannot be written by several ranks: it is no GroupTier")
        super().__init__(tier, policy, events, **kwargs)
        self.channel = TierChannel(group, tier.name)
        self._newest_offered = -1  # the newest step of this rank's own saves offered here
        self._newest_arrival = 0  # the largest save number of those

    def offer(self, step: int, token: int, arrival: int) -> None:
        self._newest_offered = max(self._newest_offered, step)
        self._newest_arrival = max(self._newest_arrival, arrival)
        super().offer(step, token, arrival)


class LeaderFlusher(_GroupFlusher):
    """Rank 0's flusher: the tier's policy decides; every decision and its outcome go to the store.

    It drives its tier through the leader's steps of :class:`~tierckpt.tiers.base.GroupTier`.
    """

    def __init__(self, tier: Tier, policy: FlushPolicy, events: FlushEvents, *, group: RankGroup, **kwargs: Any) -> None:
        super().__init__(tier, policy, events, group=group, **kwargs)
        self._rounds = 0  # the rounds published so far (decisions, horizons, and rounds a stopping rank voided)
        self._doomed: list[int] = []
        self._published: tuple[int, int] = (-1, 0)
        self._decided: tuple[int, int] = (-1, 0)  # the step and save number of the newest decision

    async def _sleep(self, timeout: float | None) -> None:
        horizon = (self._newest_offered, self._newest_arrival)
        if not self.state.waiting() and self.in_flight is None and horizon > self._published:
            # Nothing waits: every step offered so far was taken or passed over. Followers pass over
            # what they still hold up to here (a step this rank never saved, for one). A horizon at the
            # save just decided tells them nothing that decision did not (they passed over every older
            # save as they followed it): not published, it costs no follower a request.
            try:
                if horizon != self._decided:
                    # With its save number: a step saved again after this horizon is not passed over.
                    await self._publish_round({"horizon": list(horizon)})
                self._published = horizon
            except CoordinationLost as exc:
                log.error("tier %r: %s", self.tier.name, exc)
        # Woken while publishing (a capture ended, a version arrived): this returns at once (Flusher._sleep).
        await super()._sleep(timeout)

    async def _publish_round(self, value: dict[str, Any]) -> int:
        """Publish ``value`` as the next round, one request (each follower's read of it answers then);
        returns its number. A round that a stopping rank voided first is passed (the next one, then)."""
        group = self.channel.group
        while True:
            self._rounds += 1
            if await group.put_if_absent(self.channel.key("round", self._rounds), value) == value:
                return self._rounds

    async def _store(self, candidate: Candidate, located: Located) -> VersionInfo:
        channel = self.channel
        n = await self._publish_round({"flush": [candidate.step, candidate.arrival]})
        self._decided = (candidate.step, candidate.arrival)
        staged: Staged | None = None
        try:
            source = await located.open()
            try:
                staged = await self.tier.write(source, channel.staging(candidate.step, n))
            finally:
                source.close()
            metadata = dict(source.metadata)
            parts, failures = await channel.collect(n)
            if failures:
                raise rank_failure(self.tier.name, candidate.step, failures)
            assert staged.part is not None
            parts[0] = staged.part
            await self.tier.seal(staged, [parts[r] for r in range(channel.group.world)], metadata)
            info = await self.tier.commit(staged)
        except BaseException as exc:
            if staged is not None:
                await self.tier.abort(staged)
            await self._publish(n, {"error": str(exc), "ranks": list(getattr(exc, "ranks", ()) or [0])})
            raise
        self._doomed = self.doomed(candidate.step)
        await self._publish(n, {"nbytes": info.nbytes, "delete": self._doomed})
        return info

    async def _publish(self, n: int, outcome: dict[str, Any]) -> None:
        try:
            await self.channel.group.put(self.channel.key("outcome", n), outcome)
        except CoordinationLost:
            pass  # this process hosts the store: only a closed store ends up here

    async def prune(self, committed: int) -> None:
        doomed, self._doomed = self._doomed, []
        await self.delete(doomed)


class FollowerFlusher(_GroupFlusher):
    """A follower's flusher: writes its part of each version the leader decides to flush, in order.

    It drives its tier through the follower's steps of :class:`~tierckpt.tiers.base.GroupTier`.
    """

    replaces_step = False  # the leader's decisions say which save of a step goes down

    def __init__(self, tier: Tier, policy: FlushPolicy, events: FlushEvents, *, group: RankGroup, **kwargs: Any) -> None:
        super().__init__(tier, policy, events, group=group, **kwargs)
        # Keep every eligible version until a decision takes it or passes it over: queue, never replace.
        self.policy = replace(self.policy, newest_only=False, min_interval_s=0.0)
        self._next = 1  # the next decision to follow
        # Every step up to here the leader has gone past (a decision for a newer step, its horizon). A
        # save of such a step that this rank captures only later (its training is behind) will never
        # be taken either: kept waiting, it would hold a host slot that this rank's save of the
        # decided step needs, and both would wait out the timeout.
        self._passed: tuple[int, int] = (-1, 0)  # (step, save number), compared in that order
        self._lost: CoordinationLost | None = None
        # The read of round ``_next``, which the store answers once the leader publishes it, and since when.
        self._reading: tuple[concurrent.futures.Future[list[bytes] | None], float] | None = None
        link = group.link  # this rank's node relays: its store has the rounds (its head forwards them)
        self._relay = NodeRelay(self.channel) if link is not None and link.head else None

    def start(self) -> None:
        super().start()
        if self._relay is not None:
            self._relay.start()

    async def _step(self) -> None:
        """Follow the leader's next decision; once its store is gone, fail what waits and what comes."""
        if self._lost is None:
            try:
                await self._follow()
                return
            except CoordinationLost as exc:
                self._lost = exc
        self._fail_waiting()
        await self._sleep(None)

    async def stop(self) -> None:
        """Stop following, and end this rank's read of the next round before the store can go: a
        process that ends with a thread blocked in the store may abort, and a read the store's closing
        cuts short prints the client's error. The round is voided, unless the leader published it
        first: the leader then publishes its next round after it, and every follower passes it."""
        await super().stop()
        group, channel = self.channel.group, self.channel
        if self._reading is not None and not self._reading[0].done():
            try:  # in the leader's store, through a relay too: the head forwards the round, void or not
                await group.put_if_absent(channel.key("round", self._next), {"void": group.rank})
                await asyncio.wait_for(asyncio.wrap_future(self._reading[0]), group.timeout_s)
            except (CoordinationLost, asyncio.TimeoutError) as exc:
                log.warning("tier %r: this rank's wait for the leader's decisions did not end (%s)", self.tier.name, exc)
        if channel.store is not group:
            try:
                await channel.store.put(channel.key("stopped", group.rank), True)
            except CoordinationLost:
                pass  # the head is gone: nobody waits for this
        if self._relay is not None:
            await self._relay.finish()

    async def _round(self) -> dict[str, Any] | None:
        """Round ``_next`` as the leader published it (a decision, a horizon, or void), or None while it
        has not: one read per round, which the store answers when it is published (and which wakes
        this flusher then); between rounds this rank sends nothing.

        Raises CoordinationLost when the store cannot be reached."""
        group, key = self.channel.store, self.channel.key("round", self._next)
        if self._reading is None:
            loop = asyncio.get_running_loop()

            def wake(_: object) -> None:
                try:
                    loop.call_soon_threadsafe(self._wake.set)
                except RuntimeError:
                    pass  # the engine's loop is closed: nobody is left to wake

            reading = group.fetch([key], ROUND_WAIT_S)
            reading.add_done_callback(wake)
            self._reading = (reading, time.monotonic())
        reading, since = self._reading
        if not reading.done():
            return None
        got = reading.result()
        if got is None:  # no client to be had, or the store is gone (this look raises then): look instead
            looked = await group.get_if_set(key)
            if looked is None:
                if time.monotonic() - since >= _FOLLOW_POLL_S:
                    self._reading = None  # read again
                return None
            got = [looked]
        self._reading = None
        self._next += 1
        return _unless_lost(dict(msgpack.unpackb(got[0], raw=False)))

    def _fail_waiting(self) -> None:
        assert self._lost is not None
        for candidate in self.state.waiting():
            self._events.failed(self.tier.name, candidate, self._lost_failure(candidate.step, self._lost))
        self.state = replace(self.state, queue=(), fallback=None)
        self._idle.set()

    async def _follow(self) -> None:
        channel = self.channel
        n = self._next
        published = await self._round()
        if published is None or "flush" not in published:
            if published is not None and "horizon" in published:
                step, arrival = published["horizon"]
                self._pass_over((step, arrival), inclusive=True)
            if not self.state.waiting():
                self._idle.set()
            if published is None:  # until the round is published or a snapshot of its own arrives
                # (a read that failed, no client to be had, leaves the looks to go on, every 20 ms)
                pending = self._reading is not None and not self._reading[0].done()
                await self._sleep(None if pending else _FOLLOW_POLL_S)
            return
        step, arrival = published["flush"]
        self._pass_over((step - 1, _EVERY_SAVE), inclusive=False)
        candidate = await self._await_snapshot(step, arrival)
        if candidate is None:
            error = f"rank {channel.group.rank} holds no step {step} for tier {self.tier.name!r} (it skipped, evicted or never made that save)"
            await channel.store.put(channel.key("report", n, channel.group.rank), {"error": error})
            await self._outcome(n)  # stay in step with the leader's decisions
            return
        self._apply(pass_over_older_saves(self.state, candidate))
        self._apply(take(self.state, self.policy, candidate, now=self._clock()))
        self.in_flight = candidate
        started = self._clock()
        located = self.upstream.locate(self.tier.name, candidate)
        try:
            await self._write_part(n, candidate, located, started)
        finally:
            self.in_flight = None

    async def _write_part(self, n: int, candidate: Candidate, located: Located | None, started: float) -> None:
        channel = self.channel
        me = channel.group.rank
        staged: Staged | None = None
        try:
            if located is None:
                raise KeyError(f"rank {me} holds step {candidate.step} nowhere above tier {self.tier.name!r} any more (evicted from host memory)")
            source = await located.open()
            try:
                staged = await self.tier.write(source, channel.staging(candidate.step, n))
            finally:
                source.close()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if located is not None:
                located.lease.release()
            await channel.store.put(channel.key("report", n, me), {"error": f"{type(exc).__name__}: {exc}"})
            await self._outcome(n)  # stay in step with the leader's decisions; this rank's error is the one to raise
            self._events.failed(self.tier.name, candidate, exc)
            return
        assert located is not None
        located.lease.release()
        try:
            await channel.store.put(channel.key("report", n, me), {"part": list(staged.part) if staged.part else None})
            await self.tier.settle(staged, channel.key("outcome", n))
            outcome = await self._outcome(n)
        except CoordinationLost as exc:  # rank 0 (or this node's head) is gone: no outcome will come for this one either
            await self.tier.abort(staged)
            self._events.failed(self.tier.name, candidate, self._lost_failure(candidate.step, exc))
            raise
        if outcome is None or "error" in outcome:
            await self.tier.abort(staged)
            if outcome is None:
                failure = rank_failure(self.tier.name, candidate.step, {self._contact: f"no outcome within {2 * channel.group.timeout_s:g} s"})
            else:
                failure = rank_failure(self.tier.name, candidate.step, {r: "see rank 0's log" for r in outcome["ranks"]})
                failure.args = (f"tier {self.tier.name!r}: step {candidate.step} was abandoned by rank 0: {outcome['error']}",)
            self._events.failed(self.tier.name, candidate, failure)
            return
        info = await self.tier.adopt(staged, outcome["nbytes"])
        self.state = finished(self.state, started=started, ok=True)
        self._events.committed(self.tier.name, candidate, info, started)
        for step in outcome["delete"]:
            await self.tier.forget(step)

    async def _outcome(self, n: int) -> dict[str, Any] | None:
        """The leader's outcome of decision ``n``; None if none came in twice the timeout (the leader's
        wait for the reports, and its own write)."""
        got = await self.channel.store.get_when_set([self.channel.key("outcome", n)], 2 * self.channel.group.timeout_s)
        return None if got is None else _unless_lost(got[0])

    @property
    def _contact(self) -> int:
        """The rank whose store this rank follows: the leader, or its node's head."""
        return self.channel.store.host_rank

    def _lost_failure(self, step: int, lost: CoordinationLost) -> Exception:
        """``step`` failed because a store is gone: named after the rank the news names, else this rank's contact."""
        return rank_failure(self.tier.name, step, {self._contact if lost.rank is None else lost.rank: str(lost)})

    async def _await_snapshot(self, step: int, arrival: int) -> Candidate | None:
        """This rank's save of ``step`` offered here, its save number ``arrival`` where it has it (else
        its newest of that step); waits for it while this rank is behind."""
        deadline = time.monotonic() + self.channel.group.timeout_s
        while True:
            saves = [c for c in self.state.waiting() if c.step == step]
            exact = next((c for c in saves if c.arrival == arrival), None)
            if exact is not None:
                return exact
            # A newer save came: this one never will. (The ranks' numbers differ when one skipped a save.)
            if self._newest_offered > step or self._newest_arrival >= arrival:
                return saves[-1] if saves else None
            left = deadline - time.monotonic()
            if left <= 0:
                return saves[-1] if saves else None
            await self._sleep(min(left, _FOLLOW_POLL_S))

    def offer(self, step: int, token: int, arrival: int) -> None:
        super().offer(step, token, arrival)
        if (step, arrival) <= self._passed:
            self.forget(token)  # the leader went past it before this rank saved it
        if self._lost is not None:
            self._wake.set()

    def _pass_over(self, up_to: tuple[int, int], *, inclusive: bool) -> None:
        """The leader went past ``up_to`` (step, save number): what waits here up to it will not be
        taken, nor what this rank saves up to it later."""
        # A decision is the leader's latest word (a step saved again after a rollback may come lower);
        # a horizon read later may be older than the decision just followed, so it only raises this.
        self._passed = max(self._passed, up_to) if inclusive else up_to
        self._apply(pass_over(self.state, self._passed))

    async def drain(self) -> None:
        """Wait until the leader dealt with everything waiting here, for at most the timeout."""
        try:
            await asyncio.wait_for(super().drain(), self.channel.group.timeout_s)
        except asyncio.TimeoutError:
            left = self.state.waiting()
            log.warning(
                "tier %r: rank 0 took none of steps %s within %g s; they will not go down",
                self.tier.name, [c.step for c in left], self.channel.group.timeout_s,
            )
            self.give_up()
            self._idle.set()


def _unless_lost(said: dict[str, Any]) -> dict[str, Any]:
    """A round or outcome as read, unless it is this node's head saying that the leader's store is gone."""
    if "lost" in said:
        raise CoordinationLost(said["lost"], rank=0)  # the failures name the leader, not the head that relayed it
    return said
