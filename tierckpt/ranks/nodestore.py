"""Node relays: the ranks of a node commit through their node's first rank, and it through the leader.

Without relays every rank reads each round, sets its report and reads each outcome in the leader's
store: 3 requests a rank a save, 30,000 at 10,000 ranks, every one served by a thread of rank 0's
process. With them (``distributed.relay``), each node but the leader's has a store of its own, served
by its first rank (its *head*) on 127.0.0.1: the node's ranks talk to it, and the head alone to the
leader, 3 requests a node (:mod:`tierckpt.pipeline.relay` forwards them). The leader's own node talks
to the leader's store as before: it is on the same node as that store already.

The price is a hop: a round reaches a node's ranks through its head, and their reports go back the
same way, two more wake-ups of a process on the commit's path. At a few ranks that hop costs more than
the store's work it saves (here a ``TCPStore`` serves about 170,000 requests a second, a save of 64
ranks about 1 ms of them), so ``auto`` relays from :data:`RELAY_MIN_WORLD` ranks on.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tierckpt.errors import ConfigError
from tierckpt.ranks.group import RankGroup
from tierckpt.ranks.nodes import group_nodes, node_identity, split_nodes

__all__ = ["RELAY_MIN_WORLD", "NodeLink", "link_nodes", "relayed_nodes"]

RELAY_MIN_WORLD = 64
LOOPBACK = "127.0.0.1"  # a node's store is reached only by the ranks on that node
_CONNECT = datetime.timedelta(seconds=10)


@dataclass
class NodeLink:
    """This rank's node, when it relays: its index among the job's nodes, its ranks (group positions,
    its head first), and its store (this rank's client of it; the head's serves it)."""

    index: int
    ranks: tuple[int, ...]
    store: RankGroup

    @property
    def head(self) -> bool:
        return self.store.rank == self.ranks[0]


def relayed_nodes(nodes: list[list[int]]) -> dict[int, tuple[int, ...]]:
    """The nodes that relay, by index: every node but the leader's (the first) that has more than
    one rank (a node of one rank would ask the leader's store as much through a relay)."""
    return {i: tuple(node) for i, node in enumerate(nodes) if i > 0 and len(node) > 1}


def link_nodes(group: RankGroup, mode: str, nodes: int | None = None) -> None:
    """Set up the node relays of ``group`` for ``distributed.relay`` = ``mode`` (``auto``, ``nodes``,
    ``off``): :attr:`RankGroup.relayed` on every rank, :attr:`RankGroup.link` on the ranks of a
    relayed node. ``nodes``: ``distributed.nodes``.

    Collective over the group (every rank calls it at the same point of construction): it may find
    the nodes (one exchange of node identities) and then exchanges where each head serves its store.
    """
    if mode == "off" or (mode == "auto" and group.world < RELAY_MIN_WORLD):
        return
    if group.nodes is None:
        group.nodes = split_nodes(group.world, nodes) if nodes is not None else group_nodes(group.all_gather(node_identity()))
    relayed = relayed_nodes(group.nodes)
    if not relayed:
        return
    timeout = datetime.timedelta(seconds=group.timeout_s)
    mine = next(((i, ranks) for i, ranks in relayed.items() if group.rank in ranks), None)
    server: Any = None
    said: int | str | None = None
    if mine is not None and mine[1][0] == group.rank:
        try:
            server = dist.TCPStore(LOOPBACK, 0, None, True, timeout, wait_for_workers=False)
            said = server.port
        except (RuntimeError, OSError) as exc:  # said to every rank: none is left waiting for this one
            said = f"{type(exc).__name__}: {exc}"
    ports = group.all_gather(said)
    failed = next(((r, p) for r, p in enumerate(ports) if isinstance(p, str)), None)
    if failed is not None:
        raise ConfigError(f"distributed.relay: rank {failed[0]} could not serve its node's store ({failed[1]}); set distributed.relay: off", key="distributed.relay")
    group.relayed = relayed
    if mine is None:
        _agree(group, None)
        return
    index, ranks = mine
    port = int(ports[ranks[0]])
    store, why = server, None
    if store is None:
        try:
            # A store on this host answers at once or never: a short connect.
            store = dist.TCPStore(LOOPBACK, port, None, False, min(timeout, _CONNECT))
        except (RuntimeError, OSError) as exc:  # not on its head's host: distributed.nodes does not match the hosts
            why = f"rank {group.rank} cannot reach its node's store (rank {ranks[0]}, {LOOPBACK}:{port}: {exc})"
    view = RankGroup(
        group.rank, group.world, group.ranks, group.run, group.timeout_s, store, None, server, address=(LOOPBACK, port), host_rank=ranks[0]
    )
    _agree(group, why)
    group.link = NodeLink(index, ranks, view)


def _agree(group: RankGroup, why: str | None) -> None:
    """Every rank says whether it reached its node's store; one that did not fails every rank's
    construction the same way, before any rank starts relaying (one exchange)."""
    said = group.all_gather(why)
    failed = next((w for w in said if w), None)
    if failed is not None:
        raise ConfigError(
            f"distributed.relay: {failed}; the ranks of a node must share a host (distributed.nodes splits them in consecutive blocks)",
            key="distributed.relay",
        )
