"""Rollbacks, as a user meets them: every phase a new process (rollback_child.py), the crashes real
SIGKILLs. After going back to a past step and saving, "latest" is the new direction; retention keeps
the new saves and a documented number of the abandoned ones (tierckpt.format.lineage)."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import logged_warnings
from tierckpt import Checkpointer, CorruptCheckpointError
from tierckpt.format import DATA_FILE, version_dirname
from tierckpt.testing import failures, flip_bits, launch_ranks

CHILD = Path(__file__).with_name("rollback_child.py")


def _config(*, nvme_keep: dict[str, Any] | None = None, pfs: dict[str, Any] | None = None) -> dict[str, Any]:
    """ram -> nvme (the last 3) -> pfs (every 5th step, every one kept)."""
    return {
        "host": {"capacity": "1MiB", "snapshots": 2},
        "tiers": [
            {"name": "ram", "type": "memory", "keep": {"last": 1}},
            {"name": "nvme", "type": "filesystem", "path": "nvme", "keep": nvme_keep or {"last": 3}},
            {"name": "pfs", "type": "filesystem", "path": "pfs", "flush": {"every_steps": 5, "newest_only": False}, **(pfs or {})},
        ],
    }


def _phase(root: Path, config: dict[str, Any], ops: list[list[Any]], *, killed: bool = False) -> list[dict[str, Any]]:
    """Run ``ops`` in a new process (one rank of no job: launch_ranks forks it where the suite has a
    fork server); its JSON lines. ``killed``: the ops end in a SIGKILL."""
    logs = root / f"phase-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, str(CHILD), str(root), json.dumps(config), json.dumps(ops + ([["kill"]] if killed else []))]
    (done,) = launch_ranks(argv, 0, timeout_s=180, log_dir=logs)
    assert done.returncode == (-signal.SIGKILL if killed else 0), done.output
    return [json.loads(line) for line in (logs / "rank-0.log").read_text().splitlines() if line.startswith("{")]


def _saves(steps: range | tuple[int, ...], offset: int = 0) -> list[list[Any]]:
    return [["save", s, s + offset] for s in steps]


def _held(lines: list[dict[str, Any]]) -> dict[str, list[tuple[int, int, bool]]]:
    """From a ``versions`` line: per tier, (step, serial, abandoned)."""
    listed = next(line["versions"] for line in lines if "versions" in line)
    out: dict[str, list[tuple[int, int, bool]]] = {}
    for tier, step, serial, abandoned in listed:
        out.setdefault(tier, []).append((step, serial, abandoned))
    return out


def _restored(lines: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(line["restored"], line["value"]) for line in lines if "restored" in line]


@pytest.mark.slow
def test_a_rollback_to_a_step_only_pfs_holds_resumes_the_new_direction_and_keeps_its_saves(tmp_path: Path) -> None:
    config = _config()
    _phase(tmp_path, config, _saves(range(1, 14)), killed=True)  # nvme: 11-13; pfs: 5, 10
    # The rollback: back to step 5 (only pfs holds it), a new direction (values 1006-1008), killed.
    lines = _phase(tmp_path, config, [["restore", 5], *_saves((6, 7, 8), 1000)], killed=True)
    assert _restored(lines) == [(5, 5.0)]
    lines = _phase(tmp_path, config, [["latest"], ["restore", 6], ["restore", 7], ["versions"]])
    assert _restored(lines) == [(8, 1008.0), (6, 1006.0), (7, 1007.0)]
    held = _held(lines)
    # nvme keeps the new direction's last 3 and the newest abandoned version (keep.abandoned: 1 by default).
    assert held["nvme"] == [(6, 14, False), (7, 15, False), (8, 16, False), (13, 13, True)]
    assert held["pfs"] == [(5, 5, False), (10, 10, True)]
    # Training on: the new direction's step 10 replaces the abandoned one on pfs, and 13 goes from nvme
    # once the new direction saves it.
    lines = _phase(tmp_path, config, [["latest"], *_saves(range(9, 14), 1000), ["latest"], ["versions"]])
    assert _restored(lines) == [(8, 1008.0), (13, 1013.0)]
    held = _held(lines)
    assert held["nvme"] == [(11, 19, False), (12, 20, False), (13, 21, False)]
    assert held["pfs"] == [(5, 5, False), (10, 18, False)]


@pytest.mark.slow
def test_a_crash_between_the_rollbacks_restore_and_its_first_commit_resumes_as_if_it_had_not_happened(tmp_path: Path) -> None:
    config = _config()
    _phase(tmp_path, config, _saves(range(1, 14)), killed=True)
    before = sorted(p.name for p in (tmp_path / "nvme").iterdir()), sorted(p.name for p in (tmp_path / "pfs").iterdir())
    # Restored step 5, then killed before any save committed (the save of 6 may be in host memory only).
    lines = _phase(tmp_path, config, [["restore", 5]], killed=True)
    assert _restored(lines) == [(5, 5.0)]
    assert (sorted(p.name for p in (tmp_path / "nvme").iterdir()), sorted(p.name for p in (tmp_path / "pfs").iterdir())) == before
    lines = _phase(tmp_path, config, [["latest"], ["versions"]])
    assert _restored(lines) == [(13, 13.0)]
    assert not any(abandoned for tier in _held(lines).values() for _, _, abandoned in tier)


@pytest.mark.slow
def test_after_a_fallback_past_damaged_versions_the_new_saves_are_latest_and_kept(tmp_path: Path) -> None:
    config = _config()
    _phase(tmp_path, config, _saves(range(1, 25)), killed=True)  # nvme: 22-24; pfs: 5-20
    for step in (22, 23, 24):
        flip_bits(tmp_path / "nvme" / version_dirname(step) / DATA_FILE.format(rank=0), 8)
    lines = _phase(tmp_path, config, [["latest"], *_saves((21, 22), 1000)], killed=True)
    assert _restored(lines) == [(20, 20.0)]  # past the damaged 24, 23, 22
    lines = _phase(tmp_path, config, [["latest"], ["restore", 21], ["versions"]])
    assert _restored(lines) == [(22, 1022.0), (21, 1021.0)]
    # The good new 21 stays. The damaged 23 and 24 are abandoned too; the process whose restore found
    # them damaged neither counted nor deleted them (a later one keeps keep.abandoned of them).
    assert _held(lines)["nvme"] == [(21, 25, False), (22, 26, False), (23, 23, True), (24, 24, True)]
    lines = _phase(tmp_path, config, [["latest"], ["save", 23, 1023], ["versions"]])
    assert _restored(lines) == [(22, 1022.0)]
    assert _held(lines)["nvme"] == [(21, 25, False), (22, 26, False), (23, 27, False), (24, 24, True)]


@pytest.mark.slow
def test_a_flush_of_the_abandoned_direction_that_commits_after_the_rollback_is_not_latest(tmp_path: Path) -> None:
    config = _config(pfs={"gated": True})
    config["tiers"][2]["flush"] = {"every": 1}  # pfs takes every save
    ops = [
        ["allow", "pfs", 12], *_saves(range(1, 13)),
        ["save_nowait", 13, 13], ["committed", 13, "nvme"],  # pfs's write of 13 waits at its gate
        ["restore", 5], ["save_nowait", 6, 1006], ["committed", 6, "nvme"],
        ["open", "pfs"], ["committed", 13, "pfs"], ["committed", 6, "pfs"], ["versions"],
    ]
    lines = _phase(tmp_path, config, ops, killed=True)
    assert [line["ok"] for line in lines if "committed" in line] == [True, True, True, True]
    held = _held(lines)
    assert (13, 13, True) in held["pfs"] and (6, 14, False) in held["pfs"]
    lines = _phase(tmp_path, config, [["latest"], ["versions"]])
    assert _restored(lines) == [(6, 1006.0)]


@pytest.mark.slow
def test_restoring_an_abandoned_version_and_training_on_makes_its_direction_live_again(tmp_path: Path) -> None:
    config = _config(nvme_keep={"last": 3, "abandoned": 3})
    _phase(tmp_path, config, _saves(range(1, 14)), killed=True)
    _phase(tmp_path, config, [["restore", 5], *_saves((6, 7), 1000)], killed=True)
    # restore(step) of a step both directions hold loads the new one; an abandoned one still loads.
    lines = _phase(tmp_path, config, [["restore", 13], *_saves((14,)), ["latest"], ["versions"]])
    assert _restored(lines) == [(13, 13.0), (14, 14.0)]
    held = _held(lines)
    assert held["nvme"] == [(6, 14, True), (7, 15, True), (12, 12, False), (13, 13, False), (14, 16, False)]
    assert held["pfs"] == [(5, 5, False), (10, 10, False)]
    # And back again: the new direction's 7 is abandoned now, and still loads when asked for.
    lines = _phase(tmp_path, config, [["restore", 7], ["latest"]])
    assert _restored(lines) == [(7, 1007.0), (14, 14.0)]


@pytest.mark.slow
@pytest.mark.parametrize("step", [13, 5])
def test_saving_a_step_again_replaces_it(tmp_path: Path, step: int) -> None:
    config = _config()
    _phase(tmp_path, config, _saves(range(1, 14)), killed=True)
    lines = _phase(tmp_path, config, [["restore", step], ["save", step, 2000], ["latest"], ["restore", step]])
    assert _restored(lines) == [(step, float(step)), (step, 2000.0), (step, 2000.0)]


def test_a_copy_a_restore_found_damaged_is_not_tried_again_nor_counted_by_retention(tmp_path: Path) -> None:
    config = _config()
    for tier in config["tiers"]:
        if "path" in tier:
            tier["path"] = str(tmp_path / tier["path"])
    with Checkpointer(config) as ckpt:
        for step in range(1, 7):
            ckpt.save_sync(step, {"w": torch.full((64,), float(step))})
            ckpt.wait_sync()
    flip_bits(tmp_path / "nvme" / version_dirname(6) / DATA_FILE.format(rank=0), 8)  # nvme: 4, 5, 6; pfs: 5
    with Checkpointer(config) as ckpt:
        with logged_warnings("does not verify") as said:
            restored = ckpt.restore_latest_sync()
        assert restored is not None and (restored.step, restored.tier) == (5, "nvme")
        assert len(said) == 1 and "step 6 on tier 'nvme'" in said[0]
        assert [(v.tier, v.step) for v in ckpt.versions() if v.damaged] == [("nvme", 6)]
        with logged_warnings() as said:
            restored = ckpt.restore_latest_sync()  # straight to 5: nvme's 6 is known damaged
        assert [m for m in said if "does not verify" in m] == [] and restored is not None and restored.step == 5
        with logged_warnings("step 6 on tier 'nvme' does not verify"), pytest.raises(CorruptCheckpointError):
            ckpt.restore_sync(6)  # asked for outright: read again, and the damage named
        ckpt.save_sync(7, {"w": torch.full((64,), 7.0)})
        ckpt.wait_sync()
        # 7 descends from 5: 6 is abandoned, and damaged. keep: {last: 3} counts 4, 5 and 7; the
        # damaged 6 is neither counted nor deleted.
        listed = [(v.step, v.abandoned, v.damaged is not None) for v in ckpt.versions() if v.tier == "nvme"]
        assert listed == [(4, False, False), (5, False, False), (6, True, True), (7, False, False)]


def _ranks(root: Path, config: dict[str, Any], ops: list[list[Any]], phase: str, world: int, *, killed: bool = False) -> list[list[dict[str, Any]]]:
    """Run ``ops`` on every rank of a new job of ``world``; each rank's JSON lines."""
    argv = [sys.executable, str(CHILD), str(root), json.dumps(config), json.dumps(ops + ([["kill"]] if killed else []))]
    exits = launch_ranks(argv, world, env={"PHASE": phase}, timeout_s=240)
    assert [e.returncode for e in exits] == [-signal.SIGKILL if killed else 0] * world, failures(exits)
    return [[json.loads(line) for line in (root / f"{phase}-rank-{r}.jsonl").read_text().splitlines()] for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["shared", "node-local", "peer"])
def test_every_rank_resumes_the_new_direction_after_a_rollback(tmp_path: Path, shm: Path, where: str) -> None:
    config = _config() | {"distributed": {"timeout": "120s"}}
    local = where == "node-local"
    if where != "shared":  # two nodes of one rank each, simulated on this host
        config["distributed"]["nodes"] = 2
    if local:  # nvme on each node's own disk
        config["tiers"][1] |= {"scope": "node", "path": "local-{node}/nvme"}
    if where == "peer":  # host memory that outlives the process, and a copy of it on the other node
        config["tiers"][0] |= {"path": str(shm), "keep": {"last": 2}}
        config["tiers"].insert(1, {"name": "peer", "type": "peer", "keep": {"last": 2}})
    _ranks(tmp_path, config, _saves(range(1, 14)), "a", 2, killed=True)
    said = _ranks(tmp_path, config, [["restore", 5], *_saves((6, 7, 8), 1000)], "b", 2, killed=True)
    assert [_restored(lines) for lines in said] == [[(5, 5.0)], [(5, 5.25)]]
    if where == "peer":  # rank 0's host memory is gone: its part comes back from the copy rank 1 holds
        shutil.rmtree(shm / "rank-00000")
    said = _ranks(tmp_path, config, [["latest"], ["restore", 7], ["versions"]], "c", 2)
    assert [_restored(lines) for lines in said] == [[(8, 1008.0), (7, 1007.0)], [(8, 1008.25), (7, 1007.25)]]
    if where == "peer":
        assert [line["tier"] for line in said[0] if "restored" in line] == ["peer", "peer"]
    for lines in said:
        held = _held(lines)
        assert held["nvme"] == [(6, 14, False), (7, 15, False), (8, 16, False), (13, 13, True)]
        assert held["pfs"] == [(5, 5, False), (10, 10, True)]
        if where == "peer":  # the copies peers hold of the new direction, and none of the abandoned one
            assert [(step, abandoned) for step, _, abandoned in held["peer"]] == [(7, False), (8, False), (13, True)]
    if local:  # each node's directory holds its rank's part of the same versions
        for node in (0, 1):
            assert sorted(p.name for p in (tmp_path / f"local-{node}" / "nvme").glob("step-*")) == [version_dirname(s) for s in (6, 7, 8, 13)]
