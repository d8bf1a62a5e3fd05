"""One rank of tests/test_sharded_tensors.py: ``python sharded_tensor_worker.py <dir>`` (RANK, WORLD_SIZE 2).

Builds ShardedTensors as FSDP1's sharded state dicts hold them, and others that it does not make,
passes each through :func:`tierckpt.integrations.sharded_tensors.as_dtensors`, and writes what came
of each to ``<dir>/result-<rank>.json``: the DTensor's piece and whether it shares the shard's memory,
or the error's type, message and key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

from tierckpt.integrations.sharded_tensors import as_dtensors, with_originals
from tierckpt.testing.ranks import end_job


def sharded(rows: list[tuple[int, int]], cols: int, group: Any = None) -> ShardedTensor:
    """A ShardedTensor of ``sum(rows)`` x ``cols``: this rank holds rows ``rows[rank]`` (start, count)."""
    rank = dist.get_rank(group)  # in the group; placements name global ranks
    start, count = rows[rank]
    local = torch.arange(count * cols, dtype=torch.float32).reshape(count, cols) + 100 * rank
    shard = Shard(local, ShardMetadata([start, 0], [count, cols], f"rank:{dist.get_rank()}/cpu"))
    total = max(s + c for s, c in rows)
    return ShardedTensor._init_from_local_shards([shard], total, cols, process_group=group)


def outcome(value: Any) -> dict[str, Any]:
    originals: dict[int, Any] = {}
    try:
        converted = as_dtensors({"opt": {"state": {"w": {"exp_avg": value, "step": torch.tensor(3.0)}}}}, originals)
    except Exception as exc:  # noqa: BLE001 - the test asserts which
        return {"error": type(exc).__name__, "message": str(exc), "key": getattr(exc, "key", None)}
    piece = converted["opt"]["state"]["w"]["exp_avg"]
    local = piece.to_local()
    back = with_originals(converted, originals)["opt"]["state"]["w"]["exp_avg"]
    shard = value.local_shards()[0].tensor
    return {
        "type": type(piece).__name__, "placements": [str(p) for p in piece.placements], "shape": list(piece.shape),
        "local": local.tolist(), "shares_memory": local.data_ptr() == shard.data_ptr(), "back_is_original": back is value,
    }


def kept_across_calls() -> dict[str, Any]:
    """Two conversions with one ``meshes`` dict, as a trainer plugin's saves: the same mesh and spec each
    time, and the DTensor ``DTensor.from_local`` makes of the same piece (whole, it gathers alike)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as Dim0

    meshes: dict[str, Any] = {}
    value = sharded([(0, 3), (3, 2)], 4)
    first, second = (as_dtensors({"w": value}, meshes=meshes)["w"] for _ in range(2))
    alone = as_dtensors({"w": value})["w"]  # a call of its own: its own mesh
    public = DTensor.from_local(value.local_shards()[0].tensor, first.device_mesh, (Dim0(0),), run_check=False, shape=first.shape, stride=first.stride())
    return {
        "same_mesh": second.device_mesh is first.device_mesh, "same_spec": second._spec is first._spec,
        "own_mesh_alone": alone.device_mesh is not first.device_mesh,
        "as_from_local": first.shape == public.shape and first.stride() == public.stride() and first.placements == public.placements
        and first.dtype == public.dtype and first.requires_grad == public.requires_grad,
        "whole": first.full_tensor().tolist(), "whole_from_local": public.full_tensor().tolist(),
    }


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = [dist.new_group([0]), dist.new_group([1])]  # every rank makes every group
    results = {
        "chunks": outcome(sharded([(0, 3), (3, 2)], 4)),  # 5 rows: torch.chunk gives 3 and 2, as FSDP1 cuts
        "other_cut": outcome(sharded([(0, 1), (1, 4)], 4)),  # 1 and 4: not the chunk a DTensor holds
        "part_of_the_ranks": outcome(sharded([(0, 2)], 4, groups[rank])),  # each rank alone: hybrid sharding's shape
        "kept": kept_across_calls(),
    }
    (out / f"result-{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_job()  # DTensors on gloo may abort at the interpreter's exit otherwise (pytorch#190489)
