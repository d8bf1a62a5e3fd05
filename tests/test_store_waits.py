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


def test_put_many_sets_every_key_in_one_request_and_wakes_a_wait_on_them(ranks: tuple[RankGroup, RankGroup, list[Any]]) -> None:
    leader, follower, _ = ranks
    watch = follower.watch(["bell/1", "bell/2"], TIMEOUT_S)
    asyncio.run(leader.put_many(["bell/1", "bell/2"], True))
    assert watch.result(TIMEOUT_S) is True
    assert asyncio.run(follower.get("bell/2")) is True


def test_close_waits_for_a_wait_the_rank_itself_ends(ranks: tuple[RankGroup, RankGroup, list[Any]]) -> None:
    """A follower ends its own wait (it rings its bell) before it lets go of the store: close() then
    finds no wait still blocked in the store, which could abort the process at its exit."""
    leader, follower, _ = ranks
    watch = follower.watch(["bell/1"], TIMEOUT_S)
    asyncio.run(follower.put("bell/1", True))
    follower.close()
    assert watch.done() and watch.result() is True
