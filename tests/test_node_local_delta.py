"""Differential versions on a node-local tier (``scope: node`` with ``delta``), with real processes: 4 ranks
as 2 simulated nodes of 2 (tests/node_worker.py with ``DELTA``), as in tests/test_node_local.py.

Each node's ranks write their parts against their own parts of the base in their node's directory; a
part fetched by a rank on another node goes out standing alone; a base saved again stays aside on
every node while versions written against it are kept; a damaged base on one node makes every rank
fall back together.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt.format import DATA_FILE, MANIFEST_FILE, CommitMarker, Manifest, decode_document, version_dirname
from tierckpt.testing import flip_bits

from test_node_local import cli, run, steps_on

pytestmark = pytest.mark.slow

FROZEN = "['model']['frozen']"  # replicated, never changed: a reference after its base
TRAINED = "['optim']['trained']"  # each rank's, moved a little every step: an XOR frame after its base


def marker(root: Path, node: int, step: int) -> CommitMarker:
    head = decode_document((root / f"local-{node}" / "nvme" / version_dirname(step) / MANIFEST_FILE).read_bytes())
    assert isinstance(head, CommitMarker)
    return head


def part(root: Path, node: int, step: int, rank: int) -> Manifest:
    head = marker(root, node, step)
    return Manifest.decode((root / f"local-{node}" / "nvme" / version_dirname(step) / head.ranks[rank][0]).read_bytes())


def codecs(manifest: Manifest, key: str) -> list[str]:
    record = next(r for r in manifest.records if r.key == key)
    return [record.chunk_codec(i) for i, c in enumerate(record.chunks) if c is not None]


def test_each_node_writes_its_parts_against_its_own_part_of_the_base_and_a_damaged_base_fails_every_rank_over(tmp_path: Path) -> None:
    saved = run("save", tmp_path, STEPS="1,2,3,4,5,6", DELTA="3")
    for s in saved:
        # full_every 3: 4 is whole, 5 and 6 depend on it; keep last 2 keeps 5, 6 and their base.
        assert s["versions"]["nvme"] == [4, 5, 6] and s["versions"]["pfs"] == [2, 4, 6], s
    assert steps_on(tmp_path, 0) == steps_on(tmp_path, 1) == [4, 5, 6]
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        head = marker(tmp_path, node, 6)
        assert (head.base, head.chain, head.holds) == (4, 2, ranks), head
        for rank in ranks:
            manifest = part(tmp_path, node, 6, rank)
            assert manifest.base is not None and manifest.base[0] == 4
            assert codecs(manifest, TRAINED) == ["delta"], rank
            # The frozen value is stored once per node, its chunks in turn by the node's ranks: each
            # one a reference to the base's chunk stored by the same rank.
            assert codecs(manifest, FROZEN) == ["ref", "ref"], rank
    restored = run("restore", tmp_path, DELTA="3")
    for s in restored:
        assert s["step"] == 6 and s["tier"] == "nvme" and s["bitwise"] is True and not s["warnings"], s
    listed = cli("ls", tmp_path / "local-1" / "nvme")
    assert listed.returncode == 0 and listed.stdout.count("delta of step 4") == 2 and "base of 5, 6" in listed.stdout, listed.stdout
    assert cli("verify", tmp_path / "local-1" / "nvme").returncode == 0

    # One bit of node 1's copy of the frozen value in the base: 5 and 6 fail on node 1's ranks.
    owner = next(r for r in (2, 3) if codecs(part(tmp_path, 1, 4, r), FROZEN))
    chunk = next(c for r in part(tmp_path, 1, 4, owner).records if r.key == FROZEN for c in r.chunks if c is not None)
    flip_bits(tmp_path / "local-1" / "nvme" / version_dirname(4) / DATA_FILE.format(rank=owner), chunk.offset + 100, 1)
    restored = run("restore", tmp_path, DELTA="3")
    # Node 1's ranks read step 6 from pfs, each naming the copy it passed over; node 0's parts verify.
    assert [(s["step"], s["tier"], s["bitwise"]) for s in restored] == [(6, "nvme", True)] * 2 + [(6, "pfs", True)] * 2, restored
    assert not restored[0]["warnings"] and not restored[1]["warnings"], restored
    for rank, s in ((2, restored[2]), (3, restored[3])):
        said = s["warnings"]
        assert len(said) == 1 and f"rank {rank}: step 6 on tier 'nvme' does not verify: its base, step 4: " in said[0], said
        assert "['model']['frozen']" in said[0] and said[0].endswith("trying step 6 on tier 'pfs' next"), said


def test_ranks_requeued_onto_each_others_nodes_fetch_differential_parts_and_start_a_new_base(tmp_path: Path) -> None:
    # full_every 4: 5 is whole and 6 depends on it.
    run("save", tmp_path, STEPS="1,2,3,4,5,6", SIMULATE="0", DELTA="4")
    restored = run("restore", tmp_path, SIMULATE="0", SWAP="1", RESUME="7", DELTA="4")
    for s in restored:
        # Every rank's part of step 6, a differential one, is on the other node's disk: it came over
        # standing alone, its references and frames made whole on the serving node.
        assert s["step"] == 6 and s["tier"] == "nvme" and s["bitwise"] is True and not s["warnings"], s
        assert s["resumed"] is True and s["versions"]["nvme"] == [5, 6, 7], s
    assert not list(tmp_path.glob("local-*/nvme/.tmp-*")), "the fetched copies are gone after the restore"
    # Step 7 was due against 5, but no rank has its part of 5 on its node's disk now: 7 is whole, the
    # base of the versions after it, written where the ranks run now.
    for node, ranks in ((1, (0, 1)), (0, (2, 3))):
        head = marker(tmp_path, node, 7)
        assert (head.base, head.holds) == (None, ranks), head
    restored = run("restore", tmp_path, SIMULATE="0", SWAP="1", RESUME="8", DELTA="4")
    for s in restored:
        assert s["step"] == 7 and s["tier"] == "nvme" and s["bitwise"] is True and not s["warnings"], s
        assert s["resumed"] is True and s["versions"]["nvme"] == [7, 8], s
    for node, ranks in ((1, (0, 1)), (0, (2, 3))):
        assert (marker(tmp_path, node, 8).base, marker(tmp_path, node, 8).chain) == (7, 1)
        for rank in ranks:
            assert codecs(part(tmp_path, node, 8, rank), FROZEN) == ["ref", "ref"], rank


def test_a_base_saved_again_stays_aside_on_every_node_while_versions_written_against_it_are_kept(tmp_path: Path) -> None:
    run("save", tmp_path, STEPS="1,2,3,4,5", DELTA="3")  # 4 whole, 5 against it
    # The job goes back to step 4 and saves it again: the new 4 is whole, and 5 still needs the old one.
    restored = run("restore", tmp_path, RESUME="4", DELTA="3")
    for s in restored:
        assert s["step"] == 5 and s["bitwise"] is True and s["resumed"] is True and s["versions"]["nvme"] == [4, 5], s
    for node in (0, 1):
        assert len(list((tmp_path / f"local-{node}" / "nvme").glob(".replaced-step-000000000004-*"))) == 1, node
    # Saving 4 again left 5 in an abandoned direction (docs/index.md, "Rolling back"), kept by
    # keep.abandoned: 1. A new job resumes the new 4, finds the copies aside and keeps them (5 depends
    # on them). Step 6 is written against the new 4.
    restored = run("restore", tmp_path, RESUME="6", DELTA="3")
    for s in restored:
        assert s["step"] == 4 and s["tier"] == "nvme" and s["bitwise"] is True and not s["warnings"], s
        assert s["resumed"] is True and s["versions"]["nvme"] == [4, 5, 6], s
    assert marker(tmp_path, 1, 6).base == 4 and steps_on(tmp_path, 1) == [4, 5, 6]
    assert len(list((tmp_path / "local-1" / "nvme").glob(".replaced-step-000000000004-*"))) == 1
    # With keep.abandoned: 0, step 7 pushes the abandoned 5 out: nothing needs the old 4 any more, and
    # it goes on both nodes.
    restored = run("restore", tmp_path, RESUME="7", DELTA="3", ABANDONED="0")
    for s in restored:
        assert s["step"] == 6 and s["bitwise"] is True and not s["warnings"], s
        assert s["versions"]["nvme"] == [4, 6, 7], s
    assert not list(tmp_path.glob("local-*/nvme/.replaced-*"))


def test_a_keeper_killed_mid_commit_of_a_differential_version_leaves_the_one_before(tmp_path: Path) -> None:
    saved = run("save", tmp_path, dead=(2,), STEPS="1,2,3", DIE_MID_COMMIT="3", TIMEOUT="4s", DELTA="3")
    for s in saved:
        assert s["1"] is True and s["2"] is True and "error" in s["3"], s
    assert steps_on(tmp_path, 0) == [1, 2] and steps_on(tmp_path, 1) == [1, 2, 3]
    restored = run("restore", tmp_path, RESUME="4", DELTA="3")
    for s in restored:
        # Step 2 depends on 1; 3 was committed on node 1 only: not listed, and removed once 4 commits.
        assert s["step"] == 2 and s["tier"] == "nvme" and s["bitwise"] is True, s
        assert s["resumed"] is True and s["versions"]["nvme"] == [1, 2, 4], s
    assert steps_on(tmp_path, 0) == steps_on(tmp_path, 1) == [1, 2, 4]
    assert marker(tmp_path, 0, 4).base == 1 and marker(tmp_path, 0, 4).chain == 2
