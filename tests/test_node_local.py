"""Node-local tiers across nodes with real processes: 4 ranks as 2 simulated nodes of 2, each node with
its own ``nvme`` directory (``<root>/local-<node>/nvme``), plus a shared ``pfs`` directory.

Each rank is tests/node_worker.py (gloo on localhost). A lost node is its processes killed by SIGKILL
and its directory wiped; then every rank is started again, as torchrun restarts a job.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tierckpt.format import DATA_FILE, MANIFEST_FILE, CommitMarker, Manifest, decode_document, version_dirname
from tierckpt.testing import failures, flip_bits, launch_ranks

WORKER = Path(__file__).with_name("node_worker.py")
WORLD = 4

pytestmark = pytest.mark.slow


def run(mode: str, root: Path, *, dead: tuple[int, ...] = (), **env: str) -> list[dict[str, Any]]:
    exits = launch_ranks([sys.executable, str(WORKER), mode, str(root)], WORLD, env=env, timeout_s=240)
    failed = failures(exits, expect_dead=dead)
    assert not failed, failed
    return [json.loads((root / f"{mode}-{rank}.json").read_text()) for rank in range(WORLD) if rank not in dead]


def cli(command: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierckpt", command, str(path)], capture_output=True, text=True, timeout=120)


def damage(version: Path, *, rank: int) -> None:
    """One bit of ``rank``'s own tensor ``optim.m`` in its data file of ``version``."""
    marker = decode_document((version / MANIFEST_FILE).read_bytes())
    assert isinstance(marker, CommitMarker)
    manifest = Manifest.decode((version / marker.ranks[rank][0]).read_bytes())
    chunk = next(c for r in manifest.records if r.key == "['optim']['m']" for c in r.chunks if c is not None)
    flip_bits(version / DATA_FILE.format(rank=rank), chunk.offset + 100, 1)


def steps_on(root: Path, node: int) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (root / f"local-{node}" / "nvme").glob("step-*"))


@pytest.mark.parametrize("relay", ["off", "nodes"])
def test_each_node_commits_its_ranks_parts_and_retention_deletes_the_same_steps_on_both(tmp_path: Path, relay: str) -> None:
    """With relay: nodes, node 1's ranks commit through rank 2, which keeps node 1's copy too."""
    saved = run("save", tmp_path, STEPS="1,2,3,4,5", RELAY="1" if relay == "nodes" else "0")
    for s in saved:
        assert all(s[str(step)] is True for step in range(1, 6)), s
        assert s["versions"]["nvme"] == [4, 5] and s["versions"]["pfs"] == [2, 4], s
    assert steps_on(tmp_path, 0) == steps_on(tmp_path, 1) == [4, 5]
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        version = tmp_path / f"local-{node}" / "nvme" / version_dirname(5)
        marker = decode_document((version / MANIFEST_FILE).read_bytes())
        assert isinstance(marker, CommitMarker) and marker.holds == ranks and marker.world_size == WORLD
        assert sorted(p.name for p in version.glob("data-*")) == [DATA_FILE.format(rank=r) for r in ranks]
    restored = run("restore", tmp_path, RELAY="1" if relay == "nodes" else "0")
    for s in restored:
        assert s["step"] == 5 and s["tier"] == "nvme" and s["bitwise"] is True, s
        assert not s["warnings"], s
    listed = cli("ls", tmp_path / "local-1" / "nvme")
    assert listed.returncode == 0 and listed.stdout.count("yes, node 1's part: ranks 2, 3 of 4") == 2, listed.stdout
    verified = cli("verify", tmp_path / "local-0" / "nvme")
    assert verified.returncode == 0 and verified.stdout.count("node 0's part: ranks 0, 1 of 4 (complete)") == 2, verified.stdout


def test_a_replicated_value_is_stored_once_per_node(tmp_path: Path) -> None:
    run("save", tmp_path, STEPS="1")
    version = tmp_path / "local-1" / "nvme" / version_dirname(1)
    marker = decode_document((version / MANIFEST_FILE).read_bytes())
    assert isinstance(marker, CommitMarker)
    stored = {}
    for r in (2, 3):
        manifest = Manifest.decode((version / marker.ranks[r][0]).read_bytes())
        w = next(rec for rec in manifest.records if rec.key == "['model']['w']")
        assert w.shared is not None and set(w.shared) == {2, 3}, w.shared  # the node's ranks only
        stored[r] = sum(c.stored for c in w.chunks if c is not None)
    assert stored[2] + stored[3] == 4 << 20 and min(stored.values()) > 0, stored


def test_a_lost_node_is_restored_by_every_rank_from_pfs_and_training_goes_on(tmp_path: Path) -> None:
    run("save", tmp_path, dead=(2, 3), STEPS="1,2,3,4,5", KILL_NODE="1", TIMEOUT="4s")
    shutil.rmtree(tmp_path / "local-1")
    restored = run("restore", tmp_path, RESUME="6")
    for s in restored:
        assert s["step"] == 4 and s["tier"] == "pfs" and s["bitwise"] is True, s
        assert s["resumed"] is True and s["versions"]["nvme"] == [6], s
    # Node 0's steps 4 and 5 were committed on no other node any more: gone once step 6 committed.
    assert steps_on(tmp_path, 0) == steps_on(tmp_path, 1) == [6]


def test_a_shared_tier_below_takes_each_ranks_part_from_the_node_local_tier(tmp_path: Path) -> None:
    # Compressed alike, pfs copies nvme's stored chunks instead of compressing the host slot again.
    run("save", tmp_path, STEPS="1,2,3,4", COMPRESS="1")
    shutil.rmtree(tmp_path / "local-0")
    shutil.rmtree(tmp_path / "local-1")
    version = tmp_path / "pfs" / version_dirname(4)
    marker = decode_document((version / MANIFEST_FILE).read_bytes())
    assert isinstance(marker, CommitMarker) and marker.holds is None
    for r in range(WORLD):
        manifest = Manifest.decode((version / marker.ranks[r][0]).read_bytes())
        w = next(rec for rec in manifest.records if rec.key == "['model']['w']")
        # Stored once across all 4 ranks on pfs, as saved (not per node, as on nvme).
        assert w.shared is not None and sorted(w.shared) == [0, 1, 2, 3] and w.codec == "zstd", (r, w.shared, w.codec)
    restored = run("restore", tmp_path)
    for s in restored:
        assert s["step"] == 4 and s["tier"] == "pfs" and s["bitwise"] is True and not s["warnings"], s


def test_a_keeper_killed_mid_commit_leaves_no_version_and_later_saves_commit(tmp_path: Path) -> None:
    saved = run("save", tmp_path, dead=(2,), STEPS="1,2,3", DIE_MID_COMMIT="3", TIMEOUT="4s")
    for rank, s in zip((0, 1, 3), saved):
        assert s["1"] is True and s["2"] is True, s
        assert "error" in s["3"] and 2 in s["3"]["ranks"], s
    assert "not committed on node 1" in saved[0]["3"]["error"], saved[0]
    assert steps_on(tmp_path, 0) == [1, 2]  # rank 0 took its copy back
    assert steps_on(tmp_path, 1) == [1, 2, 3]  # its keeper died after the rename: nobody could
    restored = run("restore", tmp_path, RESUME="4")
    for s in restored:
        assert s["step"] == 2 and s["tier"] == "nvme" and s["bitwise"] is True, s
        assert s["resumed"] is True and s["versions"]["nvme"] == [2, 4], s
    assert steps_on(tmp_path, 0) == steps_on(tmp_path, 1) == [2, 4]


def test_ranks_requeued_onto_each_others_nodes_fetch_their_parts_from_the_other_node(tmp_path: Path) -> None:
    run("save", tmp_path, STEPS="1,2,3", SIMULATE="0")
    restored = run("restore", tmp_path, SIMULATE="0", SWAP="1", RESUME="4")
    for s in restored:
        # Every rank's part of step 3 is on the other node's disk now, and pfs holds only step 2.
        assert s["step"] == 3 and s["tier"] == "nvme" and s["bitwise"] is True and not s["warnings"], s
        assert s["resumed"] is True and s["versions"]["nvme"] == [3, 4], s
    # Step 4's parts are where their ranks run now: ranks 0 and 1 on the disk that held 2 and 3.
    marker = decode_document((tmp_path / "local-1" / "nvme" / version_dirname(4) / MANIFEST_FILE).read_bytes())
    assert isinstance(marker, CommitMarker) and marker.holds == (0, 1) and marker.node == "1"
    assert not list(tmp_path.glob("local-*/nvme/.tmp-*")), "the fetched copies are gone after the restore"


def test_a_damaged_part_on_the_serving_node_makes_every_rank_fall_back_together(tmp_path: Path) -> None:
    run("save", tmp_path, STEPS="1,2,3", SIMULATE="0")
    damage(tmp_path / "local-1" / "nvme" / version_dirname(3), rank=3)
    restored = run("restore", tmp_path, SIMULATE="0", SWAP="1")
    for s in restored:
        # Rank 3's part of step 3 came over damaged (its server sent zeros for the chunk it could not
        # read): every rank takes step 2, each fetched from the other node again.
        assert s["step"] == 2 and s["tier"] == "nvme" and s["bitwise"] is True, s
        said = [w for w in s["warnings"] if "step 3" in w]
        assert len(said) == 1 and "rank(s) 3" in said[0] and "fetched from node 1" in said[0], s


def test_a_step_saved_again_whose_commit_a_keeper_cut_short_keeps_its_committed_save(tmp_path: Path) -> None:
    run("save", tmp_path, STEPS="1,2,3")
    # The job resumes from step 2 and saves step 3 again; node 1's keeper dies in its commit.
    saved = run("save", tmp_path, dead=(2,), STEPS="3", DIE_MID_COMMIT="3", TIMEOUT="4s")
    for s in saved:
        assert "error" in s["3"], s
    # Node 1's keeper died with the new save in place and the committed one moved aside.
    assert [p.name.startswith(".replaced-") for p in (tmp_path / "local-1" / "nvme").glob(".replaced-*")] == [True]
    restored = run("restore", tmp_path)
    for s in restored:
        assert s["step"] == 3 and s["tier"] == "nvme" and s["bitwise"] is True and not s["warnings"], s
    assert steps_on(tmp_path, 0) == steps_on(tmp_path, 1) == [2, 3]
    assert not list((tmp_path / "local-1" / "nvme").glob(".replaced-*")), "put back in place"


def test_rank_0_killed_once_every_node_committed_leaves_the_version_whole_on_both(tmp_path: Path) -> None:
    saved = run("save", tmp_path, dead=(0,), STEPS="1,2,3", DIE_COMMITTED="3", TIMEOUT="4s")
    for s in saved:
        assert s["1"] is True and s["2"] is True and "error" in s["3"], s  # no outcome came
    # Node 1's keeper heard nothing after it committed: it kept its copy rather than unmake a version
    # rank 0 may have committed (it had), and the next start finds step 3 whole on both nodes. (Step 1
    # is still there: rank 0 died before its retention ran.)
    assert steps_on(tmp_path, 0) == steps_on(tmp_path, 1) == [1, 2, 3]
    restored = run("restore", tmp_path)
    for s in restored:
        assert s["step"] == 3 and s["tier"] == "nvme" and s["bitwise"] is True, s


def test_one_nodes_damaged_part_makes_every_rank_fall_back_with_one_warning(tmp_path: Path) -> None:
    run("save", tmp_path, STEPS="1,2,3")
    damage(tmp_path / "local-1" / "nvme" / version_dirname(3), rank=3)
    restored = run("restore", tmp_path)
    for s in restored:
        assert s["step"] == 2 and s["tier"] == "nvme" and s["bitwise"] is True, s
        said = [w for w in s["warnings"] if "step 3" in w]
        assert len(said) == 1, s
        assert "rank(s) 3" in said[0] and DATA_FILE.format(rank=3) in said[0] and "node 1" in said[0], said
    verified = cli("verify", tmp_path / "local-1" / "nvme")
    assert verified.returncode != 0 and "step-000000000003  DAMAGED" in verified.stdout, verified.stdout
    assert cli("verify", tmp_path / "local-0" / "nvme").returncode == 0  # node 0's part of step 3 is whole


def test_with_a_peer_tier_a_lost_node_comes_back_newer_from_its_peers_copies(tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm: the RAM tiers of this test live there")
    root = Path(tempfile.mkdtemp(prefix="tierckpt-node-", dir="/dev/shm"))
    try:
        run("save", root, dead=(2, 3), STEPS="1,2,3,4,5", KILL_NODE="1", TIMEOUT="4s", PEER="1")
        shutil.rmtree(root / "local-1")
        shutil.rmtree(root / "ram-1")  # the node is lost: its RAM and its disk
        restored = run("restore", root, RESUME="6", PEER="1")
        # Newer than pfs (step 4): node 0's ranks from their own RAM, node 1's from the copies node 0 holds.
        assert [(s["step"], s["tier"], s["bitwise"]) for s in restored] == [(5, "ram", True), (5, "ram", True), (5, "peer", True), (5, "peer", True)], restored
        for s in restored:
            assert s["resumed"] is True and s["versions"]["nvme"] == [6], s
        assert steps_on(root, 0) == steps_on(root, 1) == [6]
    finally:
        shutil.rmtree(root, ignore_errors=True)
