"""One rank of tests/test_dtensor_survey.py: ``python dtensor_survey_worker.py <dir>`` (RANK, WORLD_SIZE 4).

Surveys a state of DTensors on a 2 x 2 mesh (every placement pair of Shard and Replicate, an uneven
cut, an empty piece, one shape many times, a Parameter) twice: as ``save()`` does (the common-case walk
with its cache of pieces) and through the general walk with the cache emptied before each DTensor. It
writes both to ``<dir>/result-<rank>.json``, with what a Partial placement raises.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tierckpt.errors import UnsupportedStateError
from tierckpt.state import pieces, survey
from tierckpt.state.leaves import Leaf, _flatten_any
from tierckpt.state.walk import _as_lists
from tierckpt.testing.ranks import end_job


def described(leaves: list[Leaf], rows: list[Any] | None) -> list[dict[str, Any]]:
    out = []
    for i, leaf in enumerate(leaves):
        out.append({
            "path": [str(k) for k in leaf.path], "dtype": leaf.dtype, "shape": list(leaf.shape),
            "region": None if leaf.region is None else [list(leaf.region.global_shape), list(leaf.region.offset)],
            "replicas": list(leaf.replicas), "is_dtensor": leaf.dtensor is not None,
            "local_is_the_dtensors": leaf.dtensor is None or leaf.value.data_ptr() == leaf.dtensor.to_local().data_ptr(),
            "row_len": None if rows is None else len(rows[i]),
        })
    return out


class Uncached(dict):  # type: ignore[type-arg]
    """pieces._PLACES that never keeps anything: every DTensor worked out afresh."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same global tensors on every rank
    S0, S1, R = Shard(0), Shard(1), Replicate()
    state = {
        "model": {f"layer{i}.w": distribute_tensor(torch.randn(4, 6), mesh, [S0, S1]) for i in range(3)},
        "mixed": {
            "rep_shard": distribute_tensor(torch.randn(4, 6), mesh, [R, S0]),
            "shard_rep": distribute_tensor(torch.randn(4, 6), mesh, [S0, R]),
            "both_rep": distribute_tensor(torch.randn(4, 6), mesh, [R, R]),
            "uneven": distribute_tensor(torch.randn(5, 3), mesh, [S0, R]),
            "empty_piece": distribute_tensor(torch.randn(1, 2).to(torch.bfloat16), mesh, [R, S0]),
            "param": torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [S0, S1])),
            "plain": torch.arange(3),
        },
        "list": [distribute_tensor(torch.randn(4, 6), mesh, [S0, S1]), 7],
    }
    pieces._PLACES.clear()
    fast = survey(state)
    again = survey(state)  # every piece from the cache now
    saved = pieces._PLACES
    pieces._PLACES = Uncached()
    try:
        skeleton, leaves = _flatten_any(state)
    finally:
        pieces._PLACES = saved
    try:
        survey({"opt": {"grad": DTensor.from_local(torch.ones(2, 6), mesh, [S0, Partial()])}})  # a gradient not yet reduced
        partial: dict[str, Any] = {"error": None}
    except UnsupportedStateError as exc:
        partial = {"error": type(exc).__name__, "message": str(exc), "key": exc.key}
    result = {
        "rank": rank, "coordinate": list(mesh.get_coordinate() or []),
        "fast": described(fast.leaves(), fast.rows), "general": described(leaves, None),
        "same_skeleton": _as_lists(fast.skeleton) == skeleton, "rows_repeat": fast.rows == again.rows,
        "versions_equal": fast.versions == [leaf.value._version for leaf in leaves], "cached_places": len(saved),
        "partial": partial,
    }
    (out / f"result-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_job()  # DTensors on gloo may abort at the interpreter's exit otherwise (pytorch#190489)
