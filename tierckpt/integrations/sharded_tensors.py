"""FSDP1's sharded state dicts as DTensors: :func:`as_dtensors`.

FSDP1 (``FullyShardedDataParallel``) without a device mesh gives its sharded state dicts
(``get_model_state_dict``, ``get_optimizer_state_dict``, ``SHARDED_STATE_DICT``) as ``ShardedTensor``s:
each parameter and moment cut along dim 0 into ``world_size`` chunks, ``torch.chunk``'s sizes, rank r
holding chunk r. That is the piece a DTensor with ``Shard(0)`` on a 1-D mesh of every rank holds. So
each ShardedTensor becomes that DTensor, over the same local tensor (no copy): stored and resharded on
load as FSDP2's are, whatever world size or FSDP version loads it. A restore into the DTensors writes
into the ShardedTensors' shards; :func:`with_originals` puts those back in the restored state, which
``set_model_state_dict``/``set_optimizer_state_dict`` then take (with the restored values that are
not tensors, an optimizer's ``param_groups``).

The DTensors' mesh (every rank, over the job's default group) and their specs (one per global shape
and dtype) are made once and kept in a dict the caller holds across saves (``meshes``). Made per
save, they cost ``init_device_mesh`` and ``DTensor.from_local`` (~80-200 µs a tensor), and the places
of pieces, kept per mesh (:mod:`tierckpt.state.pieces`), are worked out afresh (~70 µs a tensor):
450 ShardedTensors took 16 ms a save on 2 CPU ranks, 5 ms now.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from tierckpt.errors import UnsupportedStateError
from tierckpt.state import format_path
from tierckpt.state.pieces import placed

__all__ = ["as_dtensors", "with_originals"]


def as_dtensors(state: Any, originals: dict[int, Any] | None = None, meshes: dict[str, Any] | None = None) -> Any:
    """``state`` (nested dicts, lists and tuples) with each ShardedTensor as the DTensor of the same
    piece, sharing its storage; every other value as it is, the containers new where they hold one.
    ``originals``, if given, gets each such DTensor's ShardedTensor, by the DTensor's ``id``.
    ``meshes``: where the meshes are kept from one call to the next (a plugin's own dict; without
    it, this call's).

    Raises:
        UnsupportedStateError: a ShardedTensor that is not cut along dim 0 over every rank in
            ``torch.chunk``'s sizes (FSDP1's hybrid sharding without a device mesh): names its key.
    """
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # a torch without torch.distributed: there are none
        return state
    if meshes is None:
        meshes = {}

    def convert(value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, ShardedTensor):
            piece = _dtensor(value, path, meshes)
            if originals is not None:
                originals[id(piece)] = value
            return piece
        if isinstance(value, dict):
            items = [(k, convert(v, (*path, k))) for k, v in value.items()]
            if all(new is value[k] for k, new in items):
                return value
            return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            converted = [convert(v, (*path, i)) for i, v in enumerate(value)]
            if all(new is old for new, old in zip(converted, value)):
                return value
            return type(value)(converted)
        return value

    return convert(state, ())


def with_originals(state: Any, originals: dict[int, Any]) -> Any:
    """``state`` (restored into the template :func:`as_dtensors` made, so holding its DTensors) with
    each of those DTensors as the ShardedTensor it shares its storage with."""
    if not originals:
        return state
    if id(state) in originals:
        return originals[id(state)]
    if isinstance(state, OrderedDict):
        return OrderedDict((k, with_originals(v, originals)) for k, v in state.items())
    if isinstance(state, dict):
        return {k: with_originals(v, originals) for k, v in state.items()}
    if isinstance(state, (list, tuple)) and type(state) in (list, tuple):
        return type(state)(with_originals(v, originals) for v in state)
    return state


def _job_mesh(meshes: dict[str, Any], device_type: str, world: int) -> tuple[Any, dict[Any, Any]]:
    """The 1-D mesh of every rank on ``device_type``, and the DTensor specs made over it, from ``meshes``
    while the job's default group is the one it was made over (a job may destroy its group and start
    another)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    group = dist.group.WORLD
    kept = meshes.get(device_type)
    if kept is None or kept[0] is not group:
        kept = meshes[device_type] = (group, init_device_mesh(device_type, (world,)), {})
    return kept[1], kept[2]


def _on_mesh(local: torch.Tensor, mesh: Any, specs: dict[Any, Any], shape: tuple[int, ...]) -> torch.Tensor:
    """The DTensor whose piece ``local`` is: dim 0's chunk of ``shape`` over ``mesh``. Made on a spec kept
    per global shape and dtype in ``specs``: ~2 µs a tensor, where ``DTensor.from_local`` (an autograd
    function, its spec made anew) took 80-200 µs, a tensor every save."""
    from torch.distributed.tensor import DTensor, Shard

    key = (shape, local.dtype)
    spec = specs.get(key)
    if spec is None:
        stride = torch.empty(shape, device="meta").stride()
        try:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        except ImportError:  # torch < 2.5 kept it elsewhere: the public way, at its cost
            return DTensor.from_local(local, mesh, (Shard(0),), run_check=False, shape=torch.Size(shape), stride=stride)
        spec = specs[key] = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=local.requires_grad)


def _dtensor(sharded: Any, path: tuple[Any, ...], meshes: dict[str, Any]) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    def refuse(why: str) -> UnsupportedStateError:
        where = format_path(path)
        return UnsupportedStateError(f"cannot store the ShardedTensor at {where}: {why}", key=where)

    meta = sharded.metadata()
    shape, world, group = tuple(meta.size), dist.get_world_size(), sharded._process_group
    if group is not dist.group.WORLD and dist.get_world_size(group) != world:
        raise refuse(
            f"it is sharded over {dist.get_world_size(sharded._process_group)} of the job's {world} ranks (FSDP1's hybrid "
            "sharding); pass FSDP a device_mesh, which makes its state dicts DTensors"
        )
    shards = sharded.local_shards()
    if len(shards) > 1:
        raise refuse(f"this rank holds {len(shards)} pieces of it; FSDP1 gives each rank one")
    props = meta.tensor_properties
    if shards:
        local, offsets = shards[0].tensor, tuple(shards[0].metadata.shard_offsets)
    else:  # a tensor with fewer rows than ranks: this rank holds none of it
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        local, offsets = torch.empty((0, *shape[1:]), dtype=props.dtype, device=device), (0,) * len(shape)
    mesh, specs = _job_mesh(meshes, local.device.type, world)
    _, _, region, want_shape = placed(mesh, (Shard(0),), shape)  # worked out once per global shape
    want_offset = region.offset
    if not shape or tuple(want_shape) != tuple(local.shape) or (local.numel() and tuple(want_offset) != offsets):
        raise refuse(
            f"its piece here ({list(local.shape)} at {list(offsets)} of {list(shape)}) is not dim 0's chunk {dist.get_rank()} "
            f"of {world} ({list(want_shape)} at {list(want_offset)}), the cut FSDP1 makes"
        )
    return _on_mesh(local, mesh, specs, shape)
