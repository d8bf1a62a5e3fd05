"""Many ranks, one checkpoint: real processes on localhost with gloo (tests/dist_worker.py is a rank).

World sizes 1, 2 and 4; per-rank and replicated state round trips bitwise; the dedup seen on disk;
a rank SIGKILLed in the middle of a flush; a corrupted file of one rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tierckpt.format import MANIFEST_FILE, version_dirname
from tierckpt.format.manifest import decode_document
from tierckpt.testing import failures, free_port, launch_ranks

WORKER = Path(__file__).with_name("dist_worker.py")
MODEL_BYTES = 300_000 * 4 + 7 * 2


def run_ranks(world: int, scenario: str, root: Path, env: dict[str, str] | None = None, *, expect_dead: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """Start ``world`` ranks of ``scenario``; returns each surviving rank's result (ranks in ``expect_dead`` must die by SIGKILL)."""
    exits = launch_ranks([sys.executable, str(WORKER), scenario, str(root)], world, env={"TEST_TIMEOUT": "30"} | (env or {}))
    failed = failures(exits, expect_dead)
    assert not failed, failed
    if not expect_dead:  # every rank ended its waits on the store before the store went: nothing printed of them
        noise = [e.rank for e in exits if "TCPStore.cpp" in e.output or "socket.cpp" in e.output]
        assert not noise, [e.output for e in exits if e.rank in noise]
    return [json.loads((root / f"result-{e.rank}.json").read_text()) for e in exits if e.rank not in expect_dead]


def _version(root: Path, step: int) -> Path:
    return root / "disk" / version_dirname(step)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_ranks_save_and_restore_bitwise_with_replicated_bytes_stored_once(tmp_path: Path, world: int) -> None:
    saved = run_ranks(world, "save", tmp_path, {"STEPS": "1,2,3", "REPLICATED": "1"})
    assert [r["committed"] for r in saved] == [[True, True, True]] * world
    assert all(r["ckpt_world"] == world for r in saved)
    version = _version(tmp_path, 3)
    marker = decode_document((version / MANIFEST_FILE).read_bytes())
    assert marker.world_size == world and len(marker.ranks) == world
    # The model is stored once, split across the ranks; each rank's own tensors once per rank.
    data = {p.name: p.stat().st_size for p in version.glob("data-r*.bin")}
    assert sorted(data) == [f"data-r{r:05d}.bin" for r in range(world)]
    own = sum(4 * (1000 + r) + 16 for r in range(world))
    assert sum(marker.ranks[r][2] for r in range(world)) < MODEL_BYTES + own + world * 3 * 4096
    shares = [marker.ranks[r][2] for r in range(world)]
    assert max(shares) - min(shares) < MODEL_BYTES / world  # about 1/world of the model each
    # A rank receives at most 512 KiB a batch: at world 4, the 1.2 MB model goes in several batches.
    restored = run_ranks(world, "restore", tmp_path, {"RECEIVE_BYTES": str(512 << 10)} if world == 4 else {})
    assert [r["step"] for r in restored] == [3] * world
    assert all(r["bitwise"] and r["template_filled"] for r in restored), restored
    assert all(r["warnings"] == [] for r in restored)
    # Each rank read only what it stored (its share of the model, its own tensors) and got the rest of
    # the model from the others: the model was read from disk once, not once per rank.
    assert all(r["read_bytes"] <= marker.ranks[r["rank"]][2] for r in restored), [(r["read_bytes"], marker.ranks) for r in restored]
    assert MODEL_BYTES + own <= sum(r["read_bytes"] for r in restored) < 2 * MODEL_BYTES
    # Each rank wrote its own events file (config events: .../events-{rank}.jsonl), in both jobs.
    for rank in range(world):
        events = [json.loads(line) for line in (tmp_path / f"events-{rank}.jsonl").read_text().splitlines()]
        assert {e["rank"] for e in events} == {rank}
        assert [(e["event"], e["step"]) for e in events if e["event"] in ("save", "flushed", "restored")] == [
            ("save", 1), ("flushed", 1), ("save", 2), ("flushed", 2), ("save", 3), ("flushed", 3), ("restored", 3),
        ], events  # each save waited for its commit before the next


@pytest.mark.slow
def test_without_replicated_every_rank_stores_its_own_copy(tmp_path: Path) -> None:
    run_ranks(2, "save", tmp_path, {"STEPS": "5"})
    marker = decode_document((_version(tmp_path, 5) / MANIFEST_FILE).read_bytes())
    assert all(marker.ranks[r][2] >= MODEL_BYTES for r in range(2))
    restored = run_ranks(2, "restore", tmp_path)
    assert [(r["step"], r["bitwise"]) for r in restored] == [(5, True), (5, True)]


def test_world_of_one_saves_as_a_single_process(tmp_path: Path) -> None:
    saved = run_ranks(1, "save", tmp_path, {"STEPS": "1,2", "REPLICATED": "1"})
    assert saved[0]["ckpt_world"] == 1
    manifest = decode_document((_version(tmp_path, 2) / MANIFEST_FILE).read_bytes())
    assert manifest.world_size == 1 and not hasattr(manifest, "ranks")
    restored = run_ranks(1, "restore", tmp_path)
    assert restored[0]["step"] == 2 and restored[0]["bitwise"]


@pytest.mark.slow
def test_a_corrupted_file_of_one_rank_makes_every_rank_fall_back_together(tmp_path: Path) -> None:
    run_ranks(2, "save", tmp_path, {"STEPS": "1,2,3", "REPLICATED": "1"})
    data = _version(tmp_path, 3) / "data-r00001.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    verify = subprocess.run([sys.executable, "-m", "tierckpt", "verify", str(tmp_path / "disk")], capture_output=True, text=True)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "step-000000000003  DAMAGED  data-r00001.bin: checksum mismatch" in verify.stdout
    assert "from 2 ranks" in verify.stdout and "3 versions: 2 OK, 1 damaged" in verify.stdout
    restored = run_ranks(2, "restore", tmp_path)
    assert [r["step"] for r in restored] == [2, 2]
    assert all(r["bitwise"] for r in restored)
    # Rank 0's part of step 3 verified and landed in its template: step 2 overwrote it.
    assert all(r["template_filled"] for r in restored)
    for r in restored:
        # Both ranks read rank 1's bytes (rank 0 for its shared chunks): each warns once, naming the file.
        assert len(r["warnings"]) == 1, r["warnings"]
        assert "step 3" in r["warnings"][0] and "data-r00001.bin" in r["warnings"][0]
        assert r["warnings"][0].endswith("; every rank falls back to step 2"), r["warnings"]  # the step it names is next


@pytest.mark.slow
def test_a_rank_whose_own_chunk_is_damaged_reads_a_lower_tier_and_the_others_read_its_share_themselves(tmp_path: Path) -> None:
    """The replicated model is read once between the ranks only if every rank reads its own share:
    rank 1's own tensor damaged on "disk", rank 1 takes step 3 from "pfs", and rank 0 reads rank 1's
    share of the model from "disk" itself (it verifies there)."""
    run_ranks(2, "save", tmp_path, {"STEPS": "1,2,3", "REPLICATED": "1", "PFS": "1"})
    version = _version(tmp_path, 3)
    part = decode_document((version / "manifest-r00001.msgpack").read_bytes())
    mine = next(r for r in part.records if r.key == "['mine']")
    data = version / "data-r00001.bin"
    raw = bytearray(data.read_bytes())
    raw[mine.chunk(0).offset + 8] ^= 0xFF
    data.write_bytes(bytes(raw))
    restored = run_ranks(2, "restore", tmp_path, {"PFS": "1"})
    assert [(r["step"], r["tier"], r["bitwise"]) for r in restored] == [(3, "disk", True), (3, "pfs", True)], restored
    assert all(r["read_bytes"] >= MODEL_BYTES for r in restored)  # each read the whole model itself
    # No step fell back; rank 1 alone names the copy it passed over, and where it read the step instead.
    assert restored[0]["warnings"] == [], restored[0]
    [said] = restored[1]["warnings"]
    assert said.startswith("tierckpt: rank 1: step 3 on tier 'disk' does not verify: data-r00001.bin: checksum mismatch in ['mine']"), said
    assert said.endswith("; trying step 3 on tier 'pfs' next"), said


@pytest.mark.slow
def test_when_no_step_verifies_on_every_rank_every_rank_says_its_template_was_written(tmp_path: Path) -> None:
    run_ranks(2, "save", tmp_path, {"STEPS": "1,2"})
    for step in (1, 2):
        data = _version(tmp_path, step) / "data-r00001.bin"
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0xFF
        data.write_bytes(bytes(raw))
    failed = run_ranks(2, "restore", tmp_path)
    for r in failed:
        kind, message, _ = r["error"]
        assert kind == "CorruptCheckpointError" and "no step verifies on every rank" in message, r
        # Step 2 fell back to step 1; step 1, the last, to nothing: no warning promises an older step then.
        assert [w.rsplit("; ", 1)[1] for w in r["warnings"]] == ["every rank falls back to step 1", "no older step is held for every rank"], r
        assert "partly overwritten by the copies that failed (on rank(s) 0" in message, message
        assert r["step"] is None
    assert not failed[0]["template_untouched"]  # rank 0's parts verified and landed, in vain
    # verify_first: no rank writes before every rank verified; nothing to restore, templates as passed.
    kept = run_ranks(2, "restore", tmp_path, {"VERIFY_FIRST": "1"})
    assert [(r["step"], r.get("error"), r["template_untouched"]) for r in kept] == [(None, None, True)] * 2


@pytest.mark.slow
def test_restore_of_one_step_loads_that_step_on_every_rank_or_fails_on_every_rank(tmp_path: Path) -> None:
    """restore(step) under torch.distributed: an older step comes back on both ranks; a step no tier
    holds is a NoCheckpointError on both, naming what there is; a step whose part on rank 1 is
    damaged is an error on both, never a fallback to another step."""
    run_ranks(2, "save", tmp_path, {"STEPS": "1,2,3", "REPLICATED": "1"})
    older = run_ranks(2, "restore", tmp_path, {"RESTORE_STEP": "2"})
    assert [(r["step"], r["bitwise"], r["template_filled"]) for r in older] == [(2, True, True)] * 2
    missing = run_ranks(2, "restore", tmp_path, {"RESTORE_STEP": "7"})
    for r in missing:
        kind, message, step = r["error"]
        assert (kind, step) == ("NoCheckpointError", 7), r
        assert "step 7 is not held for rank(s) 0, 1" in message and "disk: 1, 2, 3" in message, message
    data = _version(tmp_path, 3) / "data-r00001.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    damaged = run_ranks(2, "restore", tmp_path, {"RESTORE_STEP": "3"})
    for r in damaged:
        kind, message, step = r["error"]
        assert (kind, step) == ("CorruptCheckpointError", 3), r
        assert "step 3 does not verify on rank(s)" in message and "data-r00001.bin" in message, message
        assert r["step"] is None


@pytest.mark.slow
def test_every_rank_commits_each_version_a_lower_tier_selects_while_the_tier_above_is_busy(tmp_path: Path) -> None:
    """The leader's decisions follow selection per tier: with nvme busy writing older saves (each write
    0.4 s slower), pfs still gets steps 5, 10, 15 and 20 on both ranks, every part of each verified.
    Before, pfs was offered only what nvme committed, and nvme had taken newer saves instead."""
    saved = run_ranks(2, "selection", tmp_path)
    for r in saved:
        assert r["committed"] == {"5": True, "10": True, "15": True, "20": True}, r
        assert r["disk_versions"] == [5, 10, 15, 20], r
    verify = subprocess.run([sys.executable, "-m", "tierckpt", "verify", str(tmp_path / "disk")], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "4 versions: 4 OK" in verify.stdout, verify.stdout
    restored = run_ranks(2, "restore", tmp_path)
    assert [(r["step"], r["bitwise"]) for r in restored] == [(20, True), (20, True)]


def test_each_rank_drives_the_group_tier_through_its_roles_steps_in_order(tmp_path: Path) -> None:
    """The call order GroupTier documents: the leader writes, seals, commits (and deletes what its
    retention drops), or aborts when a follower failed; a follower writes, adopts and forgets what
    the leader deleted, and never seals, commits or deletes."""
    leader, follower = run_ranks(2, "group_calls", tmp_path)
    for r in (leader, follower):
        assert r["committed"] == [True, True, True] and r["disk_versions"] == [2, 3], r
    assert leader["failed"] == "RankFailureError" and follower["failed"] == "FlushError", (leader, follower)
    committing = [call for s in (1, 2, 3) for call in (("write", s), ("seal", s), ("commit", s))]
    assert [tuple(c) for c in leader["calls"]] == [*committing, ("delete", 1), ("write", 4), ("abort", 4)], leader["calls"]
    assert [tuple(c) for c in follower["calls"]] == [
        ("write", 1), ("adopt", 1), ("write", 2), ("adopt", 2), ("write", 3), ("adopt", 3), ("forget", 1), ("write", 4),
    ], follower["calls"]


def test_a_follower_behind_the_leader_lets_go_of_steps_the_leader_went_past(tmp_path: Path) -> None:
    """Rank 1 saves steps 2-4 only after the leader decided step 5: they can never go down, so they
    must not hold its two host slots, or its save of step 5 waits until the leader abandons it."""
    saved = run_ranks(2, "late_follower", tmp_path, {"TEST_TIMEOUT": "20"})
    for r in saved:
        assert r["first"] is True and r["committed"] == {"5": True}, r
    assert saved[1]["decision_seen"] is True
    assert [int(p.name.split("-")[1]) for p in sorted((tmp_path / "disk").glob("step-*"))] == [1, 5]


def test_a_step_saved_twice_in_a_row_commits_its_newest_save_on_every_rank(tmp_path: Path) -> None:
    """Before, the leader flushed both saves (it took the first before the second came) while rank 1
    had let the first go for the second: rank 1 wrote the second for the first decision, had nothing
    for the next one, and the step was abandoned after the timeout."""
    for r in run_ranks(2, "resave", tmp_path, {"TEST_TIMEOUT": "20"}):
        assert r["committed"][1] is True and r["bitwise"] is True, r


@pytest.mark.slow
def test_a_rank_killed_mid_flush_commits_nothing_and_the_others_go_on(tmp_path: Path) -> None:
    results = run_ranks(2, "kill", tmp_path, {"VICTIM": "1", "AT": "3", "TEST_TIMEOUT": "4"}, expect_dead=(1,))
    (leader,) = results
    assert leader["rank_failure"] and leader["ranks"] == [1], leader
    assert "rank(s) 1" in leader["error"]
    assert leader["raised_after_s"] < 4 + 10  # the timeout, plus the write
    assert leader["later"] != True  # noqa: E712 - abandoned too (rank 1 is gone), but returned
    assert not _version(tmp_path, 3).exists() and not _version(tmp_path, 4).exists()
    assert (_version(tmp_path, 2) / MANIFEST_FILE).exists()
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "disk").iterdir())


@pytest.mark.slow
def test_the_torchrun_example_trains_and_resumes_on_every_rank(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "distributed_train.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    first = subprocess.run([*torchrun, str(example), "--steps", "3", "--dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert re.search(r"trained to step 3; on disk: \[(1, |2, )?3\]", first.stdout), first.stdout
    torchrun[-1] = str(free_port())
    second = subprocess.run([*torchrun, str(example), "--steps", "5", "--dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "rank 0: resumed from step 3 (tier disk)" in second.stdout
    assert "rank 1: resumed from step 3 (tier disk)" in second.stdout
    assert re.search(r"trained to step 5; on disk: \[(3, |4, )?5\]", second.stdout), second.stdout


def test_replicated_dtensors_are_stored_once_without_being_named(tmp_path: Path) -> None:
    (a, b) = run_ranks(2, "dtensor", tmp_path)
    assert (a["step"], a["bitwise"], b["step"], b["bitwise"]) == (4, True, 4, True)
    marker = decode_document((_version(tmp_path, 4) / MANIFEST_FILE).read_bytes())
    assert sum(marker.ranks[r][2] for r in range(2)) < MODEL_BYTES + 3 * 4096 + 2 * 4 * 1001  # the weights once
