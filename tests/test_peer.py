"""The peer tier (Gemini-style in-memory redundancy) with real processes: 4 ranks as 2 simulated nodes
of 2 (``distributed.nodes: 2``), each node with a RAM-tier directory of its own on /dev/shm.

Each rank is tests/peer_worker.py (gloo on localhost). A lost node is its processes killed by SIGKILL
and its RAM directory wiped; then every rank is started again, as torchrun restarts a job.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from tierckpt import Checkpointer, ConfigError
from tierckpt.format import DATA_FILE, MANIFEST_FILE, Manifest
from tierckpt.testing import failures, flip_bits, launch_ranks

WORKER = Path(__file__).with_name("peer_worker.py")
WORLD = 4

pytestmark = pytest.mark.slow


@pytest.fixture
def root() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm: the RAM tier of these tests lives there")
    path = Path(tempfile.mkdtemp(prefix="tierckpt-peer-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(mode: str, root: Path, *, kill: bool = False, world: int = WORLD, **env: str) -> list[dict[str, Any]]:
    exits = launch_ranks([sys.executable, str(WORKER), mode, str(root)], world, env={"KILL": "1" if kill else "0"} | env, timeout_s=180)
    failed = failures(exits, expect_dead=range(world) if kill else ())
    assert not failed, failed
    return [json.loads((root / f"{mode}-{rank}.json").read_text()) for rank in range(world)]


def _flip_a_bit(version: Path, data: str) -> None:
    """One bit inside the first chunk of the version's data file that is over 100 bytes long."""
    manifest = Manifest.decode((version / MANIFEST_FILE).read_bytes())
    chunk = next(c for r in manifest.records for c in r.chunks if c is not None and c.stored > 100)
    flip_bits(version / data, chunk.offset + 100, 1)


def _saved_steps_1_to_3_and_killed(root: Path) -> None:
    saved = run("save", root, kill=True, STEPS="1,2,3")
    for rank, s in enumerate(saved):
        assert all(s[str(step)]["peer"] is True for step in (1, 2, 3)), s
        # keep: {last: 2} on the peer tier: each holder dropped its copies of step 1.
        assert s["versions"]["peer"] == [2, 3] and s["nvme"] == [2], s
        peer = rank + 2 if rank < 2 else rank - 2  # the same position on the other node
        assert s["held"] == [[peer, 2], [peer, 3]], s


def test_a_lost_node_is_restored_from_its_peers_memory_and_none_from_disk(root: Path) -> None:
    _saved_steps_1_to_3_and_killed(root)
    shutil.rmtree(root / "node-1")  # node 1 is replaced: its RAM (pools and the copies it held) is gone
    restored = run("restore", root, RESUME="4")
    assert [r["step"] for r in restored] == [3] * WORLD  # newer than the disk's step 2
    assert [r["tier"] for r in restored] == ["ram", "ram", "peer", "peer"]
    assert all(r["bitwise"] for r in restored), restored
    # Training resumed: step 4's copies are held, and the copies left from before (no version the peer
    # tier could still give every rank: node 1's were lost) are gone.
    for rank, r in enumerate(restored):
        peer = rank + 2 if rank < 2 else rank - 2
        assert r["resumed"] is True and r["versions"] == [4] and r["held"] == [[peer, 4]], r


def test_after_a_restart_with_every_node_whole_retention_goes_on_from_the_versions_held(root: Path) -> None:
    _saved_steps_1_to_3_and_killed(root)
    restored = run("restore", root, RESUME="4")
    assert [(r["step"], r["tier"]) for r in restored] == [(3, "ram")] * WORLD
    # Steps 2 and 3 were found held for every rank when the Checkpointers were built; keep: {last: 2}
    # then drops step 2 once step 4 is committed, on every holder.
    for rank, r in enumerate(restored):
        peer = rank + 2 if rank < 2 else rank - 2
        assert r["versions"] == [3, 4] and r["held"] == [[peer, 3], [peer, 4]], r


def test_a_rank_whose_own_ram_copy_is_damaged_reads_its_peers_copy_before_the_disk(root: Path) -> None:
    _saved_steps_1_to_3_and_killed(root)
    _flip_a_bit(root / "node-0" / "rank-00000" / "step-000000000003", DATA_FILE.format(rank=0))  # in rank 0's pool
    restored = run("restore", root)
    assert [(r["step"], r["tier"], r["bitwise"]) for r in restored] == [(3, "peer", True)] + [(3, "ram", True)] * 3


def test_a_damaged_copy_at_the_holder_is_refused_and_every_rank_falls_back_together(root: Path) -> None:
    _saved_steps_1_to_3_and_killed(root)
    shutil.rmtree(root / "node-1")
    _flip_a_bit(root / "node-0" / "peer-rank-00000" / "w00004-r00002" / "step-000000000003", "data-r00000.bin")
    restored = run("restore", root)
    # Rank 2's copy of step 3 fails its checksums when rank 2 reads it; step 2's copies are whole.
    assert [(r["step"], r["tier"], r["bitwise"]) for r in restored] == [(2, "ram", True)] * 2 + [(2, "peer", True)] * 2


def test_with_two_copies_two_of_three_nodes_lost_are_restored_from_the_third(root: Path) -> None:
    saved = run("save", root, kill=True, world=3, STEPS="1,2,3", NODES="3", COPIES="2")
    for rank, s in enumerate(saved):
        assert s["3"]["peer"] is True
        assert s["held"] == sorted([owner, step] for owner in range(3) if owner != rank for step in (2, 3)), s
    shutil.rmtree(root / "node-1")
    shutil.rmtree(root / "node-2")
    restored = run("restore", root, world=3, NODES="3", COPIES="2")
    assert [(r["step"], r["tier"], r["bitwise"]) for r in restored] == [(3, "ram", True), (3, "peer", True), (3, "peer", True)]


def test_a_rank_and_the_peer_holding_its_copy_both_lost_fall_back_together_to_the_disk(root: Path) -> None:
    _saved_steps_1_to_3_and_killed(root)
    shutil.rmtree(root / "node-1")
    shutil.rmtree(root / "node-0" / "peer-rank-00000")  # rank 0 held rank 2's copies
    restored = run("restore", root)
    assert [r["step"] for r in restored] == [2] * WORLD
    # Each rank reads step 2 from the cheapest place that has it: its own RAM, a peer's, or the disk.
    assert [r["tier"] for r in restored] == ["ram", "ram", "nvme", "peer"]
    assert all(r["bitwise"] for r in restored), restored


def test_a_dead_peer_fails_the_version_on_every_rank_naming_it(root: Path) -> None:
    exits = launch_ranks([sys.executable, str(WORKER), "save", str(root)], WORLD, env={"STEPS": "1,2", "DIE": "3", "TIMEOUT": "5s"}, timeout_s=180)
    failed = failures(exits, expect_dead=[3])
    assert not failed, failed
    for rank in range(3):
        saved = json.loads((root / f"save-{rank}.json").read_text())
        assert saved["1"]["peer"] is True
        # Rank 3 never reports its part, and held rank 1's copy: step 2 is committed nowhere. Rank 1
        # raises its own failure to send, the others rank 0's abandonment; both name rank 3.
        if rank == 1:
            assert "copying rank 1's step 2 failed (rank 3: the transfer with rank 3 broke off" in saved["2"]["error"], saved
        else:
            assert 3 in saved["2"]["ranks"] and "step 2 was abandoned" in saved["2"]["error"], saved


def test_copies_are_paced_under_the_bandwidth_cap(root: Path) -> None:
    capped = run("save", root, STEPS="1", MB="4", BANDWIDTH="8MiB/s")
    for s in capped:
        assert s["1"]["peer"] is True
        # 4 MiB sent at most at 8 MiB/s: the copy cannot have taken less than half a second.
        assert s["1"]["seconds"] >= 0.5 * 0.95 and s["slept_s"] > 0.3, s


def test_ranks_all_on_one_node_refuse_a_peer_tier_on_every_rank_and_hold_nothing(root: Path) -> None:
    refused = run("misplaced", root, world=2, NODES="1")
    for r in refused:
        assert r["error"].startswith("tiers.peer.copies: all ranks are on 1 node(s)") and "distributed.nodes" in r["error"], r


def test_a_peer_tier_needs_ranks_on_several_nodes(tmp_path: Path) -> None:
    config = {"tiers": [{"name": "ram", "type": "memory"}, {"name": "peer", "type": "peer"}]}
    with pytest.raises(ConfigError, match="peer tier .* needs torch.distributed"):
        Checkpointer(config)


def test_a_holder_out_of_ram_fails_that_version_and_the_next_copies_arrive_whole(root: Path) -> None:
    saved = run("save", root, STEPS="1,2,3", FULL="3")  # rank 3 holds rank 1's copies
    assert "rank 3: OSError: [Errno 28]" in saved[1]["1"]["error"] and "No space left on device" in saved[1]["1"]["error"], saved[1]
    assert all("1" not in s or "error" in s["1"] for s in saved)  # step 1 committed nowhere on the peer tier
    # Rank 3 took the refused copy off the wire: the copies after it are whole, on every rank.
    assert all(s[str(step)]["peer"] is True for s in saved for step in (2, 3)), saved
    assert saved[3]["held"] == [[1, 2], [1, 3]]


def test_a_peer_tier_below_a_busy_tier_gets_every_version_it_selects(root: Path) -> None:
    """Selection per tier with a peer tier: listed below an nvme tier that is always busy writing older
    saves, the peer tier (every_steps 2) commits every even step on every rank, from host memory."""
    results = run("selection", root, DISK_FIRST="1", MB="1")
    for r in results:
        assert [r[str(step)] for step in range(2, 13, 2)] == [True] * 6, r
        assert r["versions"]["peer"] == [10, 12], r  # keep: {last: 2}
