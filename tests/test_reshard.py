"""Universal checkpoints: saved in one parallel layout, restored into another, with real processes.

Each rank is tests/reshard_worker.py (gloo on localhost, CPU device meshes). The saved values are
DTensors whose global shapes no mesh here divides evenly, one of them larger than a stored chunk;
every restored piece is compared bitwise with the same piece cut from the global tensor.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tierckpt.testing import failures, launch_ranks

WORKER = Path(__file__).with_name("reshard_worker.py")
KEYS = ("w", "emb", "big", "norm")
BIG_BYTES = 2050 * 2100 * 4

pytestmark = pytest.mark.slow


def run(world: int, mode: str, root: Path, mesh: str, place: str = "S0", **env: str) -> list[dict[str, Any]]:
    """Run ``world`` ranks of the worker; returns each rank's result."""
    exits = launch_ranks([sys.executable, str(WORKER), mode, str(root)], world, env={"MESH": mesh, "PLACE": place} | env)
    failed = failures(exits)
    assert not failed, failed
    return [json.loads((root / f"result-{rank}.json").read_text()) for rank in range(world)]


def _all_right(results: list[dict[str, Any]], *, saved: int = 4, in_place: bool = True) -> None:
    for rank, r in enumerate(results):
        assert r["step"] == 7 and r["tier"] == "disk", r
        assert all(r[k] for k in KEYS), (rank, r)
        if in_place:
            assert all(r[f"{k}_in_place"] for k in KEYS), (rank, r)
        # Values that are not DTensors: the same rank's, or rank 0's where the saved job had fewer.
        assert r["rank_value"] == (rank if rank < saved else 0)


def test_four_ranks_restore_into_two_ranks_with_the_other_dimension_sharded_then_into_one_process(tmp_path: Path) -> None:
    assert [r["committed"] for r in run(4, "save", tmp_path, "4", "S0")] == [True] * 4
    two = run(2, "restore", tmp_path, "2", "S1")
    _all_right(two)
    # Shard(0) pieces into Shard(1) shards: each rank reads every piece of "big", never more than once.
    assert all(r["read_bytes"]["['model']['big']"] == BIG_BYTES for r in two)
    same_dim = run(2, "restore", tmp_path, "2", "S0")
    _all_right(same_dim)
    # Shard(0) into Shard(0) halves: a rank reads only the stored pieces (one chunk each, here) that
    # overlap its half. Rows of the four pieces: 0-512, 513-1025, 1026-1538, 1539-2049; of the halves:
    # 0-1024 (pieces 0, 1) and 1025-2049 (pieces 1, 2, 3).
    row = 2100 * 4
    assert [r["read_bytes"]["['model']['big']"] for r in same_dim] == [1026 * row, (513 + 1024) * row]
    # No torch.distributed at all: plain tensors in the template get the whole global tensors.
    (alone,) = run(1, "restore", tmp_path, "none", TEMPLATE="plain")
    _all_right([alone])
    (bare,) = run(1, "restore", tmp_path, "none", TEMPLATE="none")
    _all_right([bare], in_place=False)


def test_two_ranks_restore_into_four_and_three(tmp_path: Path) -> None:
    run(2, "save", tmp_path, "2", "S1")
    _all_right(run(4, "restore", tmp_path, "4", "S0"), saved=2)
    # Three ranks: every shape is uneven; the third rank has no saved rank of its own (rank 0's values).
    three = run(3, "restore", tmp_path, "3", "S1")
    for rank, r in enumerate(three):
        assert all(r[k] for k in KEYS), (rank, r)
    assert [r["rank_value"] for r in three] == [0, 1, 0]


def test_two_by_two_mesh_restores_into_one_dimensional_mesh_and_back(tmp_path: Path) -> None:
    save_2d = tmp_path / "2d"
    save_2d.mkdir()
    run(4, "save", save_2d, "2x2", "S0,R")
    # Replicate() over the second mesh dimension: each piece stored once between its two replicas.
    data = sum(p.stat().st_size for p in (save_2d / "disk").glob("step-*/data-r*.bin"))
    assert data < BIG_BYTES * 1.05 + 64 * 4096
    _all_right(run(4, "restore", save_2d, "4", "S1"))
    save_1d = tmp_path / "1d"
    save_1d.mkdir()
    run(4, "save", save_1d, "4", "S0")
    _all_right(run(4, "restore", save_1d, "2x2", "S1,S0"))


def test_cast_converts_a_dtype_only_when_asked(tmp_path: Path) -> None:
    run(2, "save", tmp_path, "2", "S0")
    _all_right(run(2, "restore", tmp_path, "2", "S1", CAST="1"), saved=2)


def test_a_template_of_another_global_shape_is_refused_on_every_rank_before_anything_is_written(tmp_path: Path) -> None:
    run(4, "save", tmp_path, "4", "S0")
    refused = run(2, "restore", tmp_path, "2", "S1", WRONG="1")
    for r in refused:
        # The rank whose own template is wrong names the key; the other hears it from that rank.
        assert "['model']['w']" in r["error"] and "float32[13, 10]" in r["error"] and "[13, 11]" in r["error"], r
        assert r["untouched"], r
