"""Node relays (distributed.relay: nodes): the ranks of a node commit through their node's first rank,
which alone talks to the leader's store. Real jobs of 4 ranks on 2 simulated nodes (gloo on 127.0.0.1):
the same versions, bitwise, as without relays; a rank killed behind a relay, or the relay itself,
is named in the error every rank raises, and nothing half-written is committed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tierckpt.config import Config
from tierckpt.errors import ConfigError
from tierckpt.format import MANIFEST_FILE, version_dirname
from tierckpt.ranks.nodestore import relayed_nodes
from tierckpt.testing import failures, launch_ranks
from tierckpt.testing.simranks import simulate_saves

from test_distributed import WORKER, run_ranks

RELAY = {"RELAY_NODES": "2"}


def _version(root: Path, step: int) -> Path:
    return root / "disk" / version_dirname(step)


def test_every_node_but_the_leaders_relays_unless_it_has_one_rank() -> None:
    assert relayed_nodes([[0, 1], [2, 3], [4], [5, 6, 7]]) == {1: (2, 3), 3: (5, 6, 7)}
    assert relayed_nodes([[0, 1, 2, 3]]) == {}


def test_a_bad_relay_setting_names_its_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"distributed\.relay"):
        Config.from_dict({"tiers": [{"name": "ram", "type": "memory"}], "distributed": {"relay": "always"}})


def test_a_relayed_save_asks_the_leaders_store_3_requests_a_node_and_the_node_store_the_rest() -> None:
    """Simulated, 64 ranks on 8 nodes: the leader's store serves 3 requests for each relayed node
    (its head's read of the round, its node's reports in one value, its read of the outcome), 3 for
    each rank of the leader's own node and the leader's 3; each node's store the rest."""
    plain, relayed = simulate_saves(64, 3)[-1], simulate_saves(64, 3, per_node=8)[-1]
    assert plain.total == 3 * 64 and not plain.node_by_key
    assert relayed.total == 3 * 7 + 3 * 8  # 7 relayed nodes; the leader's node of 8, the leader included
    assert relayed.by_key["set tier/shared/report/#/node/#"] == 7
    assert sum(relayed.node_by_key.values()) == 7 * (3 * 8 + 3)  # each rank's 3, and its head's relay forwarding 3
    assert relayed.marker_bytes == plain.marker_bytes  # the same commit: every rank's part


def test_a_rank_that_cannot_reach_its_nodes_store_fails_every_ranks_construction_naming_it(tmp_path: Path) -> None:
    """As a rank on another host than its node's head (distributed.nodes not matching the hosts): every
    rank's constructor raises the same ConfigError naming it, and no rank starts relaying."""
    exits = launch_ranks([sys.executable, str(WORKER), "relay_unreachable", str(tmp_path)], 4, env={"TEST_TIMEOUT": "30"} | RELAY)
    assert not failures(exits), failures(exits)  # rank 3's own client prints its failed connect: not checked for noise
    for r in (json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in range(4)):
        assert r["error"] is not None and "distributed.relay: rank 3 cannot reach its node's store (rank 2" in r["error"], r


@pytest.mark.slow
def test_ranks_behind_a_relay_save_and_restore_bitwise(tmp_path: Path) -> None:
    saved = run_ranks(4, "save", tmp_path, {"STEPS": "1,2,3", "REPLICATED": "1"} | RELAY)
    assert [r["committed"] for r in saved] == [[True, True, True]] * 4
    marker = (_version(tmp_path, 3) / MANIFEST_FILE)
    assert marker.exists()
    restored = run_ranks(4, "restore", tmp_path, RELAY)
    assert [(r["step"], r["bitwise"]) for r in restored] == [(3, True)] * 4
    assert all(r["warnings"] == [] for r in restored)


@pytest.mark.slow
def test_a_rank_killed_behind_a_relay_is_named_by_every_rank(tmp_path: Path) -> None:
    """Rank 3 (on node 1, whose head is rank 2) dies mid-write: its head reports it missing, and the
    leader abandons the step naming rank 3 alone."""
    results = run_ranks(4, "kill", tmp_path, {"VICTIM": "3", "AT": "3", "TEST_TIMEOUT": "4"} | RELAY, expect_dead=(3,))
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert r["ranks"] == [3], r
        assert "rank(s) 3" in r["error"], r
    assert "did not report to its node's head" in results[0]["error"]
    assert not _version(tmp_path, 3).exists()
    assert (_version(tmp_path, 2) / MANIFEST_FILE).exists()
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "disk").iterdir())


@pytest.mark.slow
def test_a_killed_relay_is_named_for_its_node_and_its_rank_fails_naming_it(tmp_path: Path) -> None:
    """Rank 2, node 1's head, dies mid-write: the leader names both ranks it relayed for; rank 3 loses
    its node's store and names rank 2; no version of that step is committed."""
    results = run_ranks(4, "kill", tmp_path, {"VICTIM": "2", "AT": "3", "TEST_TIMEOUT": "4"} | RELAY, expect_dead=(2,))
    by_rank = {r["rank"]: r for r in results}
    assert by_rank[0]["ranks"] == [2, 3] and "its node's head (rank 2)" in by_rank[0]["error"], by_rank[0]
    assert by_rank[1]["ranks"] == [2, 3], by_rank[1]
    assert by_rank[3]["ranks"] == [2] and "rank 2" in by_rank[3]["error"], by_rank[3]
    assert by_rank[3]["later"] != True  # noqa: E712 - nothing more commits through a dead relay
    assert not _version(tmp_path, 3).exists()
    assert (_version(tmp_path, 2) / MANIFEST_FILE).exists()


@pytest.mark.slow
def test_the_leader_killed_is_named_by_the_ranks_behind_a_relay_too(tmp_path: Path) -> None:
    """Rank 0 dies mid-write, and its store with it: node 1's head tells its ranks as the outcome they
    wait for, and every surviving rank fails the step naming rank 0 (not the head that relayed it)."""
    results = run_ranks(4, "kill", tmp_path, {"VICTIM": "0", "AT": "3", "TEST_TIMEOUT": "4"} | RELAY, expect_dead=(0,))
    assert [r["rank"] for r in results] == [1, 2, 3]
    for r in results:
        assert r["ranks"] == [0] and "rank(s) 0" in r["error"], r
        assert r["raised_after_s"] < 4 + 10, r  # at the news, not after waiting out an outcome
    assert not _version(tmp_path, 3).exists()
