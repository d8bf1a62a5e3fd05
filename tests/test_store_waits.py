"""The ranks' waits on the group's store (tierckpt.ranks.group): a wait ends when its keys are set,
not at the next look; it times out False; a store that is gone raises CoordinationLost.

One process plays both ranks: a real TCPStore served by the "leader", a client of it for the
"follower", as RankGroup.discover makes them (without the process groups these waits do not use).
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import threading
import time
from typing import Any, Iterator

import pytest
import torch.distributed as dist

from tierckpt.ranks.group import CoordinationLost, RankGroup

from helpers import until

TIMEOUT_S = 30.0


@pytest.fixture
def ranks() -> Iterator[tuple[RankGroup, RankGroup, list[Any]]]:
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    address = ("127.0.0.1", server.port)
    leader = RankGroup(0, 2, [0, 1], "run", TIMEOUT_S, server, None, server, address=address)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout)
    follower = RankGroup(1, 2, [0, 1], "run", TIMEOUT_S, client, None, address=address)
    servers = [server]  # the test may drop it: the store's server goes with the last reference
    del server
    yield leader, follower, servers
    follower.close()
    leader.close()


def _waiting_threads() -> int:
    return sum(t.name == "tierckpt-store-wait" and t.is_alive() for t in threading.enumerate())


def test_a_wait_ends_when_its_keys_are_set_by_another_rank(ranks: tuple[RankGroup, RankGroup, list[Any]]) -> None:
    leader, follower, _ = ranks
    before = _waiting_threads()
    result: list[bool] = []
    waiting = threading.Thread(target=lambda: result.append(asyncio.run(follower.wait_for(["report/1", "report/2"], TIMEOUT_S))))
    waiting.start()
    # The keys come only once the follower blocks in the store's own wait for them (no look finds them).
    assert until(lambda: _waiting_threads() > before)
    asyncio.run(leader.put("report/1", {"part": 1}))
    asyncio.run(leader.put("report/2", {"part": 2}))
    waiting.join(TIMEOUT_S)
    assert result == [True]
    assert asyncio.run(follower.get("report/2")) == {"part": 2}


def test_a_watch_resolves_when_its_keys_come_and_false_when_it_times_out(ranks: tuple[RankGroup, RankGroup, list[Any]]) -> None:
    leader, follower, _ = ranks
    watch = follower.watch(["decision/1"], TIMEOUT_S)
    asyncio.run(leader.put("decision/1", [5, 1]))
    assert watch.result(TIMEOUT_S) is True
    assert follower.watch(["decision/2"], 0.2).result(TIMEOUT_S) is False
    assert asyncio.run(follower.wait_for(["decision/2"], 0.2)) is False
    # A client whose wait timed out is not used again; the next wait still ends on its keys.
    again = follower.watch(["decision/3"], TIMEOUT_S)
    asyncio.run(leader.put("decision/3", [6, 2]))
    assert again.result(TIMEOUT_S) is True


def test_a_wait_on_a_store_that_is_gone_raises_coordination_lost(ranks: tuple[RankGroup, RankGroup, list[Any]]) -> None:
    leader, follower, servers = ranks
    leader.close()
    servers.clear()
    gc.collect()  # the leader's process is gone: so is the store it served
    with pytest.raises(CoordinationLost, match="lost contact with the leader"):
        asyncio.run(follower.wait_for(["outcome/1"], TIMEOUT_S))


def test_close_waits_for_a_wait_the_rank_itself_ends(ranks: tuple[RankGroup, RankGroup, list[Any]]) -> None:
    """A follower ends its own wait (it voids the round it waits for) before it lets go of the store:
    close() then finds no wait still blocked in the store, which could abort the process at its exit."""
    leader, follower, _ = ranks
    watch = follower.watch(["bell/1"], TIMEOUT_S)
    asyncio.run(follower.put("bell/1", True))
    follower.close()
    assert watch.done() and watch.result() is True


def test_a_read_of_values_is_answered_when_the_last_key_is_set_and_none_after_its_timeout(ranks: tuple[RankGroup, RankGroup, list[Any]]) -> None:
    """get_when_set: one request, which the store answers once every key is set (the leader's read of
    every report, a follower's of the outcome), not at the next look."""
    leader, follower, _ = ranks
    before = _waiting_threads()
    result: list[Any] = []
    reading = threading.Thread(target=lambda: result.append(asyncio.run(leader.get_when_set(["report/1/1", "report/1/2"], TIMEOUT_S))))
    reading.start()
    assert until(lambda: _waiting_threads() > before)  # blocked in the store: the keys are not there yet
    asyncio.run(follower.put("report/1/1", {"part": 1}))
    asyncio.run(follower.put("report/1/2", {"part": 2}))
    reading.join(TIMEOUT_S)
    assert result == [[{"part": 1}, {"part": 2}]]
    assert leader.tally.by_key["multi_get report/#/#"] == 1 and leader.tally.by_key["check report/#/#"] == 0
    assert asyncio.run(follower.get_when_set(["outcome/7"], 0.2)) is None  # never set: None after its timeout
    asyncio.run(leader.put("outcome/8", {"nbytes": 1}))
    assert asyncio.run(follower.get_when_set(["outcome/8"], TIMEOUT_S)) == [{"nbytes": 1}]  # a client out of step is not reused


def test_put_if_absent_lets_the_first_writer_win(ranks: tuple[RankGroup, RankGroup, list[Any]]) -> None:
    """A round is the leader's or, when a stopping follower voided it first, void: never both."""
    leader, follower, _ = ranks
    assert asyncio.run(follower.put_if_absent("round/3", {"void": 1})) == {"void": 1}
    assert asyncio.run(leader.put_if_absent("round/3", {"flush": [5, 1]})) == {"void": 1}
    assert asyncio.run(leader.put_if_absent("round/4", {"flush": [5, 1]})) == {"flush": [5, 1]}
    assert asyncio.run(follower.get("round/4")) == {"flush": [5, 1]}


@pytest.mark.slow
def test_a_follower_whose_read_gets_no_client_looks_for_the_round_on_its_own(ranks: tuple[RankGroup, RankGroup, list[Any]]) -> None:
    """A follower's pending read of the next round needs a connection of its own; where none can be
    had (here: nothing listens where its reads connect), it looks for the round through its own
    client instead, and takes it all the same."""
    import collections
    import socket

    from tierckpt.config import FlushPolicy
    from tierckpt.pipeline.ranked import FollowerFlusher
    from tierckpt.testing.simranks import NullTier, _Everything

    leader, follower, _ = ranks
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        nowhere = closed.getsockname()[1]
    cut_off = RankGroup(1, 2, [0, 1], "run", 1.0, follower._store, None, address=("127.0.0.1", nowhere))

    async def follow() -> tuple[Any, Any, int]:
        events = _Everything(collections.Counter(), asyncio.Event())
        flusher = FollowerFlusher(NullTier(), FlushPolicy(), events, upstream=events, clock=time.monotonic, group=cut_off)
        assert await flusher._round() is None  # its read is made, and cannot connect
        assert until(lambda: flusher._reading is not None and flusher._reading[0].done())
        await flusher._follow()  # failed: a look finds nothing published yet, and it waits a look's time
        nothing_yet = flusher._next
        await leader.put_if_absent("tier/shared/round/1", {"flush": [5, 1]})
        found = None
        for _ in range(200):
            found = await flusher._round()  # looks again (a new read after 20 ms fails again)
            if found is not None:
                break
            await asyncio.sleep(0.02)
        return nothing_yet, found, flusher._next

    assert asyncio.run(follow()) == (1, {"flush": [5, 1]}, 2)
    cut_off.close()
