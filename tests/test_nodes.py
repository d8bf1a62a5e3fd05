"""tierckpt.ranks.nodes: splitting ranks into nodes, and placing a peer tier's copies across them."""

from __future__ import annotations

import doctest
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierckpt.ranks import nodes as nodes_module
from tierckpt.ranks.nodes import group_nodes, node_identity, placement, senders, split_nodes
from tierckpt.errors import ConfigError
from tierckpt.tiers.nodelocal import plan as nodeplan
from tierckpt.tiers.nodelocal.plan import Holding, complete_versions


def test_doctests() -> None:
    assert doctest.testmod(nodes_module).failed == 0


# --- split_nodes: distributed.nodes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "count", "expected"),
    [
        (1, 1, [[0]]),
        (4, 1, [[0, 1, 2, 3]]),
        (4, 2, [[0, 1], [2, 3]]),
        (4, 4, [[0], [1], [2], [3]]),
        (6, 3, [[0, 1], [2, 3], [4, 5]]),
    ],
)
def test_split_nodes(world: int, count: int, expected: list[list[int]]) -> None:
    assert split_nodes(world, count) == expected


@pytest.mark.parametrize(
    ("world", "count", "says"),
    [
        (4, 3, "4 ranks do not split evenly into 3 nodes; use one of: 1, 2, 4"),
        (4, 5, "5 is not allowed for 4 rank(s); use from 1 to 4 nodes"),
        (4, 0, "0 is not allowed for 4 rank(s)"),
    ],
)
def test_split_nodes_errors(world: int, count: int, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        split_nodes(world, count)
    assert caught.value.key == "distributed.nodes"
    assert str(caught.value).startswith("distributed.nodes: ")
    assert says in str(caught.value)


def test_split_nodes_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="world must be >= 1"):
        split_nodes(0, 1)


# --- group_nodes and node_identity -------------------------------------------------------------------


def test_group_nodes_orders_nodes_by_lowest_rank() -> None:
    assert group_nodes(["b", "a", "b", "c", "a"]) == [[0, 2], [1, 4], [3]]
    assert group_nodes(["h1", "h1", "h2", "h2"]) == [[0, 1], [2, 3]]
    assert group_nodes(["x"]) == [[0]]
    assert group_nodes([]) == []


def test_node_identity() -> None:
    assert node_identity({"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "8"}) == "1"
    assert node_identity({"GROUP_RANK": "0"}) == "0"
    assert node_identity({}) == socket.gethostname()
    assert node_identity({"GROUP_RANK": ""}) == socket.gethostname()


def test_node_identity_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUP_RANK", "7")
    assert node_identity() == "7"
    monkeypatch.delenv("GROUP_RANK")
    assert node_identity() == socket.gethostname()


# --- placement and senders ------------------------------------------------------------------------


def test_placement_two_nodes() -> None:
    place = placement([[0, 1], [2, 3]], 1, tier="peer")
    assert place == {0: (2,), 1: (3,), 2: (0,), 3: (1,)}
    assert senders(place) == {0: (2,), 1: (3,), 2: (0,), 3: (1,)}


def test_placement_three_nodes_two_copies() -> None:
    place = placement([[0, 1], [2, 3], [4, 5]], 2, tier="peer")
    assert place == {0: (2, 4), 1: (3, 5), 2: (4, 0), 3: (5, 1), 4: (0, 2), 5: (1, 3)}
    assert senders(place) == {0: (2, 4), 1: (3, 5), 2: (0, 4), 3: (1, 5), 4: (0, 2), 5: (1, 3)}


def test_placement_unequal_nodes_wraps_positions() -> None:
    # A rank at a position the next node lacks wraps around it; some ranks then hold none.
    place = placement([[0, 1, 2], [3]], 1, tier="peer")
    assert place == {0: (3,), 1: (3,), 2: (3,), 3: (0,)}
    assert senders(place) == {0: (3,), 1: (), 2: (), 3: (0, 1, 2)}


def test_placement_follows_the_given_ranks() -> None:
    # Nodes from group_nodes need not hold consecutive ranks.
    place = placement(group_nodes(["a", "b", "a", "b"]), 1, tier="peer")
    assert place == {0: (1,), 2: (3,), 1: (0,), 3: (2,)}


@pytest.mark.parametrize(
    ("nodes", "copies", "says"),
    [
        ([[0, 1, 2, 3]], 1, "all ranks are on 1 node(s); a peer tier with copies: 1 needs at least 2 nodes"),
        ([[0, 1], [2, 3]], 2, "all ranks are on 2 node(s); a peer tier with copies: 2 needs at least 3 nodes"),
    ],
)
def test_placement_needs_more_nodes_than_copies(nodes: list[list[int]], copies: int, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        placement(nodes, copies, tier="replicas")
    error = caught.value
    assert error.key == "tiers.replicas.copies"
    assert error.tier == "replicas"
    assert str(error).startswith("tiers.replicas.copies: ")
    assert says in str(error)
    assert "torchrun sets GROUP_RANK per node, or set distributed.nodes to simulate nodes on one host" in str(error)


def test_placement_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="copies must be >= 1"):
        placement([[0], [1]], 0, tier="peer")
    with pytest.raises(ValueError, match="every node needs at least one rank"):
        placement([[0], []], 1, tier="peer")


# --- properties -----------------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    """Nodes of 1..5 ranks (1..6 nodes), ranks numbered consecutively or shuffled, and copies 1..2."""
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    ranks = list(range(sum(sizes)))
    if draw(st.booleans()):
        ranks = draw(st.permutations(ranks))
    nodes, start = [], 0
    for size in sizes:
        nodes.append(sorted(ranks[start : start + size]))
        start += size
    nodes.sort(key=min)  # as group_nodes orders them
    return nodes, draw(st.integers(1, 2))


@given(layouts())
def test_placement_properties(layout: tuple[list[list[int]], int]) -> None:
    nodes, copies = layout
    if len(nodes) - 1 < copies:
        with pytest.raises(ConfigError):
            placement(nodes, copies, tier="peer")
        return
    place = placement(nodes, copies, tier="peer")
    node_of = {rank: n for n, node in enumerate(nodes) for rank in node}
    assert sorted(place) == sorted(node_of)

    for rank, holders in place.items():
        assert len(holders) == copies
        # Never on the owner's node, and each copy on another node.
        assert node_of[rank] not in {node_of[h] for h in holders}
        assert len({node_of[h] for h in holders}) == copies

    # Losing any single node: every rank keeps its own node or a copy outside the lost one.
    for lost in range(len(nodes)):
        for rank in nodes[lost]:
            assert any(node_of[h] != lost for h in place[rank])

    # Losing any `copies` nodes: every rank's snapshot is still somewhere (it lives on copies + 1 nodes).
    for rank, holders in place.items():
        assert len({node_of[rank], *(node_of[h] for h in holders)}) == copies + 1

    # senders is the exact inverse.
    held = senders(place)
    assert sorted(held) == sorted(place)
    assert all(list(owners) == sorted(owners) for owners in held.values())
    assert {(o, h) for h, owners in held.items() for o in owners} == {(o, h) for o, hs in place.items() for h in hs}

    # Equal-sized nodes: every rank holds exactly `copies` copies.
    if len({len(node) for node in nodes}) == 1:
        assert all(len(owners) == copies for owners in held.values())


@given(st.integers(1, 24), st.integers(1, 24))
def test_split_nodes_properties(world: int, count: int) -> None:
    if count > world or world % count:
        with pytest.raises(ConfigError):
            split_nodes(world, count)
        return
    split = split_nodes(world, count)
    assert len(split) == count
    assert [rank for node in split for rank in node] == list(range(world))
    assert {len(node) for node in split} == {world // count}
    # Consecutive ranks, as group_nodes would find them had each block its own identity.
    assert group_nodes([str(rank // (world // count)) for rank in range(world)]) == split


# -- what is committed across node-local directories (tiers.nodelocal.plan) ----------------------------------


def _held(step: int, parts: tuple[int, ...], holds: tuple[int, ...], *, world: int = 4, aside: str | None = None) -> Holding:
    return Holding(step, world, parts, holds, 1.0, 8, aside)


def test_a_step_is_committed_when_the_nodes_holding_one_version_hold_every_rank() -> None:
    a, b = (11, 22, 33, 44), (55, 66, 77, 88)
    reports = {
        0: [_held(1, a, (0, 1)), _held(2, a, (0, 1)), _held(3, a, (0, 1))],
        1: [_held(1, a, (2, 3)), _held(2, b, (2, 3)), _held(4, a, (2, 3))],
    }
    complete = complete_versions(reports, 4)
    assert sorted(complete) == [1]  # 2: two different saves; 3 and 4: one node each
    assert complete[1][0] == {0: 0, 1: 0, 2: 1, 3: 1}


def test_requeued_nodes_hold_each_others_ranks_and_another_world_is_not_counted() -> None:
    a = (1, 2, 3, 4)
    assert complete_versions({0: [_held(5, a, (2, 3))], 1: [_held(5, a, (0, 1))]}, 4)[5][0] == {0: 1, 1: 1, 2: 0, 3: 0}
    # Saved by 2 ranks: not a version of this job of 4, whatever it holds.
    assert complete_versions({0: [_held(5, a, (0, 1), world=2)], 1: [_held(5, a, (2, 3), world=2)]}, 4) == {}
    assert doctest.testmod(nodeplan).failed == 0


def test_a_copy_moved_aside_counts_when_it_is_the_version_the_other_nodes_hold() -> None:
    old, new = (1, 2, 3, 4), (5, 6, 7, 8)
    reports = {0: [_held(3, old, (0, 1))], 1: [_held(3, new, (2, 3)), _held(3, old, (2, 3), aside=".replaced-x")]}
    where, holding = complete_versions(reports, 4)[3]
    assert holding.parts == old and where == {0: 0, 1: 0, 2: 1, 3: 1}
    # With both versions whole, the one in place on most nodes wins.
    reports[0] = [_held(3, new, (0, 1)), _held(3, old, (0, 1), aside=".replaced-y")]
    assert complete_versions(reports, 4)[3][1].parts == new
