"""The consolidated fp32 weights of a DeepSpeed ZeRO version, as DeepSpeed's ``zero_to_fp32.py``
gives them from its own files.

A version saved through :mod:`tierckpt.integrations.deepspeed` holds DeepSpeed's files as its state
(``{"files": {file name: state dict}, "kinds": ...}``): the model states (the module's weights in the
training dtype, ``param_shapes``, ``buffer_names``, ``shared_params``) and each data-parallel rank's
optimizer file, which holds its flat fp32 partitions. Each parameter's fp32 master is put together
from every rank's partition, in the order of ``param_shapes``:

- ZeRO-1/2: a parameter group's partitions, laid end to end in rank order, are the group's
  parameters end to end (the padding at the end);
- ZeRO-3: every rank holds ``ceil(numel / ranks)`` elements of each parameter of a sub-group, end
  to end in the rank's flat partition of that sub-group (:func:`stage3_whole`).

Buffers come from rank 0's model states (as float32, as ``zero_to_fp32.py`` gives them), and a tied
parameter (``shared_params``) under both its names. Every rank's part is read from a filesystem tier
(:func:`~tierckpt.export.part.read_part`, every chunk verified) and only the fp32 partitions of the
optimizer files are read; nothing of DeepSpeed is imported.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from tierckpt.errors import CorruptCheckpointError, UnsupportedStateError
from tierckpt.export.part import read_part

__all__ = ["is_deepspeed", "stage3_whole", "zero_fp32_weights"]

_PARTITIONS = {1: "single_partition_of_fp32_groups", 2: "single_partition_of_fp32_groups", 3: "fp32_flat_groups"}


def is_deepspeed(metadata: Mapping[str, Any]) -> bool:
    """Whether a version's metadata says tierckpt.integrations.deepspeed saved it."""
    return isinstance(metadata.get("deepspeed"), Mapping)


def zero_fp32_weights(version: Path, metadata: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master, whole, and the module's buffers, by name, of the DeepSpeed
    version at ``version`` (a step directory of a filesystem tier) whose metadata is ``metadata``.

    Raises:
        UnsupportedStateError: frozen parameters (``requires_grad=False``), which this does not put together yet.
        CorruptCheckpointError: the files do not add up (no model states, partitions shorter than
            their parameters), or a chunk does not verify.
    """
    meta = metadata["deepspeed"]
    stage, world = int(meta.get("zero_stage", 0)), int(meta.get("dp_world_size", 1))
    if stage not in _PARTITIONS:
        raise CorruptCheckpointError(f"{version}: DeepSpeed metadata names ZeRO stage {stage}; tierckpt saves stages 1 to 3")
    key = _PARTITIONS[stage]
    first = read_part(version, 0, keep=lambda path: f"['{key}']" in path or "optim_states" not in path)
    model = _file(first, "model_states.pt", version, 0)
    if any(model.get("frozen_param_shapes") or ()):
        raise UnsupportedStateError(f"{version}: the model has frozen parameters; exporting their fp32 weights is not supported yet", key="frozen_param_shapes")
    shapes = model.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(group, Mapping) for group in shapes):
        raise CorruptCheckpointError(f"{version}: the DeepSpeed model states hold no param_shapes")
    partitions = [_partitions(first if q == 0 else read_part(version, q, keep=lambda path: f"['{key}']" in path), key, version, q) for q in range(world)]
    weights = _stage3(shapes, partitions, version) if stage == 3 else _stage12(shapes, partitions, version)
    module = model.get("module") or {}
    for name in model.get("buffer_names") or ():
        if isinstance(module.get(name), torch.Tensor):
            weights[name] = module[name].float()
    for alias, original in model.get("shared_params") or ():
        if original in weights:
            weights[alias] = weights[original].clone()
    return weights


def _file(part: Any, suffix: str, version: Path, rank: int) -> dict[str, Any]:
    files = part.get("files") if isinstance(part, Mapping) else None
    found = [state for name, state in sorted((files or {}).items()) if name.endswith(suffix)]
    if not found or not isinstance(found[0], Mapping):
        raise CorruptCheckpointError(f"{version}: rank {rank}'s part holds no DeepSpeed file *{suffix}: not a version tierckpt.integrations.deepspeed saved")
    return dict(found[0])


def _partitions(part: Any, key: str, version: Path, rank: int) -> list[torch.Tensor]:
    optimizer = _file(part, "optim_states.pt", version, rank).get("optimizer_state_dict")
    flat = optimizer.get(key) if isinstance(optimizer, Mapping) else None
    if not isinstance(flat, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in flat):
        raise CorruptCheckpointError(f"{version}: rank {rank}'s DeepSpeed optimizer file holds no {key}")
    return [t.reshape(-1) for t in flat]


def _take(flat: torch.Tensor, offset: int, numel: int, what: str, version: Path | str) -> torch.Tensor:
    if offset + numel > flat.numel():
        raise CorruptCheckpointError(f"{version}: the fp32 partitions hold {flat.numel()} elements, {what} needs {offset + numel}")
    return flat.narrow(0, offset, numel)


def _stage12(shapes: list[Mapping[str, Any]], partitions: list[list[torch.Tensor]], version: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for g, group in enumerate(shapes):
        if any(g >= len(p) for p in partitions):
            raise CorruptCheckpointError(f"{version}: parameter group {g} has no fp32 partition on every rank")
        flat, offset = torch.cat([p[g] for p in partitions]), 0
        for name, shape in group.items():
            numel = math.prod(shape)
            weights[name] = _take(flat, offset, numel, name, version).clone().view(*shape)
            offset += numel
    return weights


def _stage3(shapes: list[Mapping[str, Any]], partitions: list[list[torch.Tensor]], version: Path) -> dict[str, torch.Tensor]:
    whole = stage3_whole(shapes, [[{"fp32": t} for t in p] for p in partitions], version)
    return {name: values["fp32"] for name, values in whole.items()}


def stage3_whole(shapes: Sequence[Mapping[str, Any]], per_rank: Sequence[Sequence[Mapping[str, torch.Tensor]]],
                 version: Path | str = "the version") -> dict[str, dict[str, torch.Tensor]]:
    """ZeRO-3's whole parameters from every rank's flat partitions: ``per_rank[q][g]`` maps each kind
    (the fp32 master, each optimizer moment) to rank q's flat partition of sub-group g, in which each
    parameter of ``shapes[g]`` has ``ceil(numel / ranks)`` elements; each parameter's kinds, by name,
    whole (also what a resharding load cuts its new partitions from).

    Raises:
        CorruptCheckpointError: a sub-group missing on a rank, or partitions shorter than their parameters.
    """
    world, whole = len(per_rank), {}
    for g, group in enumerate(shapes):
        if any(g >= len(groups) for groups in per_rank):
            raise CorruptCheckpointError(f"{version}: sub-group {g} has no fp32 partition on every rank")
        kinds, offset = per_rank[0][g].keys(), 0
        for name, shape in group.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            whole[name] = {kind: torch.cat([_take(groups[g][kind].reshape(-1), offset, part, name, version) for groups in per_rank])[:numel].clone().view(*shape)
                           for kind in kinds}
            offset += part
    return whole
