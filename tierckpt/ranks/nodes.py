"""Which ranks share a node, and where a peer tier places the copies of each rank's snapshot.

A peer tier (in-memory redundancy, as in Gemini) copies each rank's snapshot into the memory of ranks
on other nodes, so that losing a node loses no rank's newest snapshot. This module is the plan, as pure
functions; the ranks exchange their node identities and run the copies elsewhere.

How the ranks are split into nodes:

- ``distributed.nodes`` set: :func:`split_nodes`, blocks of consecutive ranks, to simulate nodes on
  one host (tests, trials).
- otherwise every rank shares its :func:`node_identity` (``GROUP_RANK`` under torchrun, else the host
  name) and :func:`group_nodes` groups equal ones. ``LOCAL_WORLD_SIZE`` alone cannot tell the nodes
  apart: when nodes run different numbers of ranks, the rank numbers say nothing about where one node
  ends, hence the exchange.

Example:
    >>> nodes = split_nodes(4, 2)
    >>> nodes
    [[0, 1], [2, 3]]
    >>> place = placement(nodes, 1, tier="peer")
    >>> place
    {0: (2,), 1: (3,), 2: (0,), 3: (1,)}
    >>> senders(place)
    {0: (2,), 1: (3,), 2: (0,), 3: (1,)}
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

from tierckpt.errors import ConfigError

__all__ = ["split_nodes", "group_nodes", "node_identity", "placement", "senders"]

_SIMULATE = "torchrun sets GROUP_RANK per node, or set distributed.nodes to simulate nodes on one host"


def split_nodes(world: int, nodes: int) -> list[list[int]]:
    """The ranks ``0..world-1`` split into ``nodes`` nodes of consecutive ranks (``distributed.nodes``).

    Args:
        world: the number of ranks (>= 1).
        nodes: how many nodes to split them into (>= 1).

    Returns:
        One list of ranks per node, each ``world // nodes`` long, in rank order.

    Raises:
        ConfigError: ``nodes`` is below 1, above ``world``, or does not divide ``world``; the error
            names ``distributed.nodes``.
        ValueError: ``world`` is below 1.

    Example:
        >>> split_nodes(6, 3)
        [[0, 1], [2, 3], [4, 5]]
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, not {world!r}")
    key = "distributed.nodes"
    if nodes < 1 or nodes > world:
        hint = f"use from 1 to {world} nodes, a divisor of the {world} ranks"
        raise ConfigError(f"{key}: {nodes} is not allowed for {world} rank(s); {hint}", key=key)
    if world % nodes:
        divisors = ", ".join(str(n) for n in range(1, world + 1) if world % n == 0)
        problem = f"{world} ranks do not split evenly into {nodes} nodes"
        raise ConfigError(f"{key}: {problem}; use one of: {divisors}", key=key)
    size = world // nodes
    return [list(range(start, start + size)) for start in range(0, world, size)]


def group_nodes(ids: Sequence[str]) -> list[list[int]]:
    """The ranks of each node, given each rank's node identity.

    Args:
        ids: ``ids[rank]`` is the :func:`node_identity` of that rank, as every rank shared it.

    Returns:
        One list of ranks per node: nodes ordered by their lowest rank, ranks ascending.

    Example:
        >>> group_nodes(["b", "a", "b", "c", "a"])
        [[0, 2], [1, 4], [3]]
    """
    by_id: dict[str, list[int]] = {}
    for rank, node in enumerate(ids):
        by_id.setdefault(node, []).append(rank)
    return list(by_id.values())  # a dict keeps first insertion order: lowest rank first


def node_identity(env: Mapping[str, str] = os.environ) -> str:
    """What names this rank's node: ``GROUP_RANK`` when set (torchrun's node rank), else the host name.

    Ranks exchange it and group equal ones (:func:`group_nodes`). ``LOCAL_WORLD_SIZE`` alone cannot
    tell nodes apart when they run different numbers of ranks, hence the exchange.

    Args:
        env: the environment to read ``GROUP_RANK`` from.

    Example:
        >>> node_identity({"GROUP_RANK": "3"})
        '3'
    """
    group_rank = env.get("GROUP_RANK", "")
    return group_rank if group_rank else socket.gethostname()


def placement(nodes: list[list[int]], copies: int, *, tier: str) -> dict[int, tuple[int, ...]]:
    """For every rank, the ``copies`` ranks that hold copies of its snapshot, each on another node.

    The rank at position ``i`` of node ``n`` (of ``N``) is copied, for ``j = 1..copies``, to the rank at
    position ``i % len(node)`` of node ``(n + j) % N``. So a rank's copies are on distinct nodes, none
    on its own; losing any ``copies`` nodes leaves every rank's snapshot somewhere; and with nodes of
    equal size every rank holds exactly ``copies`` copies.

    Args:
        nodes: the ranks of each node (:func:`split_nodes` or :func:`group_nodes`), none empty.
        copies: how many copies of each rank's snapshot (the peer tier's ``copies``, >= 1).
        tier: the peer tier's name, named in errors.

    Returns:
        ``{rank: (holder, ...)}`` for every rank, holders in the order ``j = 1..copies``.

    Raises:
        ConfigError: there are fewer than ``copies + 1`` nodes; the error names ``tiers.<tier>.copies``.
        ValueError: ``copies`` is below 1, or a node holds no rank.

    Example:
        >>> placement([[0, 1], [2], [3, 4]], 2, tier="peer")
        {0: (2, 3), 1: (2, 4), 2: (3, 0), 3: (0, 2), 4: (1, 2)}
    """
    if copies < 1:
        raise ValueError(f"copies must be >= 1, not {copies!r}")
    if not all(nodes):
        raise ValueError(f"every node needs at least one rank: {nodes!r}")
    count = len(nodes)
    if count - 1 < copies:
        key = f"tiers.{tier}.copies"
        problem = f"all ranks are on {count} node(s); a peer tier with copies: {copies} needs at least {copies + 1} nodes"
        raise ConfigError(f"{key}: {problem}; {_SIMULATE}", key=key, tier=tier)
    place: dict[int, tuple[int, ...]] = {}
    for n, node in enumerate(nodes):
        for i, rank in enumerate(node):
            targets = (nodes[(n + j) % count] for j in range(1, copies + 1))
            place[rank] = tuple(target[i % len(target)] for target in targets)
    return dict(sorted(place.items()))


def senders(place: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """The inverse of :func:`placement`: for every rank, the ranks whose copies it holds, ascending.

    Example:
        >>> senders({0: (1,), 1: (0,), 2: (0,)})
        {0: (1, 2), 1: (0,), 2: ()}
    """
    held: dict[int, list[int]] = {rank: [] for rank in place}
    for owner, holders in place.items():
        for holder in holders:
            held.setdefault(holder, []).append(owner)
    return {rank: tuple(sorted(owners)) for rank, owners in sorted(held.items())}
