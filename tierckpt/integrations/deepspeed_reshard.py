"""A DeepSpeed ZeRO save of N data-parallel ranks loaded by a job of M, with no offline step.

DeepSpeed's own load refuses another data-parallel size (only its offline ``ds_to_universal.py`` and
a universal-checkpoint load change it). A ZeRO optimizer file holds one rank's flat partitions of
each parameter group: ZeRO-1/2 one contiguous slice of the group's parameters laid end to end
(``single_partition_of_fp32_groups``, the padding at the end of the last rank's), ZeRO-3 a slice of
every parameter of the group (``fp32_flat_groups``, ``ceil(numel / N)`` elements of each). So:

1. ZeRO-1/2: the group's parameters lie in the same order in any number of ranks' partitions, end
   to end, the padding at the end, so this rank's new partition of each group (its size and padding
   the live optimizer's) is a slice of the saved partitions laid end to end: it reads the saved
   ranks whose partitions overlap it (:func:`tierckpt.export.part.read_part`, every chunk verified),
   and rank 0, whose partition gives their size.
2. ZeRO-3: every saved rank's optimizer file is read, each parameter's whole fp32 master and
   moments are put together from them in the order of the model states' ``param_shapes`` (as
   ``zero_to_fp32.py`` does), and this rank's slice of each is cut in the live sub-groups' order and
   sizes (ZeRO-3 forms its sub-groups from partition sizes: another number of ranks has others).
3. DeepSpeed loads the optimizer file so made, and the model states with ``dp_world_size`` set to
   M, through its own code, as a save of M ranks: the fp32 masters, the moments and the step count
   are the saved ones, bitwise.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tierckpt.errors import ConfigError, CorruptCheckpointError
from tierckpt.export.zero import stage3_whole

__all__ = ["resharded"]

_OPTIM = "optimizer_state_dict"


def resharded(engine: Any, model_states: dict[str, Any], read: Callable[[int], Mapping[str, Any]], world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model states and this rank's optimizer file for ``engine``'s data-parallel layout, from
    the ``model_states`` of the saved job's rank this rank restored and the optimizer files of the
    ``world`` saved ranks (``read(q)``: rank q's, decoded; called only for the ranks needed).

    Under ZeRO-1/2 the new partition is a slice of the saved ranks' partitions laid end to end (the
    same parameters in the same order, the padding at the end), so only the saved ranks whose
    partitions overlap it (and rank 0, whose partition gives their size) are read; under ZeRO-3
    every rank holds a slice of every parameter, and all are read.

    Raises:
        ConfigError: a layout this cannot reshard (parameter alignment padding, round-robin gradients).
        CorruptCheckpointError: the files do not add up (a group or parameter count that differs).
    """
    optimizer = engine.optimizer
    if getattr(optimizer, "round_robin_gradients", False):
        raise ConfigError("resharding a DeepSpeed ZeRO checkpoint onto another number of ranks needs zero_optimization.round_robin_gradients: false")
    shapes = model_states.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(g, Mapping) for g in shapes):
        raise CorruptCheckpointError("the DeepSpeed model states hold no param_shapes to reshard the optimizer state by")
    names = {id(p): n for n, p in engine.module.named_parameters()}
    first = read(0)
    home = first[_OPTIM]
    if any(any(p) for p in home.get("param_alignment_paddings", [])):
        raise ConfigError("resharding a DeepSpeed ZeRO-1/2 checkpoint saved with zero_optimization.parameter_alignment is not supported")
    new = dict(first)
    if engine.zero_optimization_stage() >= 3:
        full = _whole_stage3(shapes, [read(q)[_OPTIM] for q in range(world)])
        new[_OPTIM] = _partitions_stage3(optimizer, names, full, home)
    else:
        new[_OPTIM] = _file_stage12(optimizer, home, *_sliced_stage12(optimizer, names, shapes, read, world))
    states = dict(model_states)
    states["dp_world_size"] = int(engine.dp_world_size)
    return states, new


# -- whole parameters from the saved partitions -------------------------------------------------------

Whole = dict[str, dict[str, torch.Tensor]]  # parameter name -> "fp32" and each optimizer moment, whole


def _moments(state: Mapping[Any, Any], group: int) -> dict[str, torch.Tensor]:
    """The partition-shaped tensors of a base optimizer's state of ``group`` (Adam's exp_avg, exp_avg_sq)."""
    found = state.get(group, {}) if isinstance(state, Mapping) else {}
    return {k: v for k, v in found.items() if isinstance(v, torch.Tensor) and v.dim() > 0}


def _whole_stage3(shapes: list[Mapping[str, Any]], osds: Sequence[Mapping[str, Any]]) -> Whole:
    """Each parameter's fp32 master and moments, whole, from every saved rank's ZeRO-3 optimizer file."""
    per_rank = [[{"fp32": flat, **_moments(osd[_OPTIM]["state"], g)} for g, flat in enumerate(osd["fp32_flat_groups"])] for osd in osds]
    return stage3_whole(shapes, per_rank)


# -- this rank's partitions in the live layout ----------------------------------------------------------


def _param(full: Whole, names: Mapping[int, str], param: Any) -> dict[str, torch.Tensor]:
    name = names.get(id(param))
    if name is None or name not in full:
        raise CorruptCheckpointError(f"parameter {name or '<unnamed>'} is in the optimizer but not in the saved DeepSpeed checkpoint")
    return full[name]


def _base_state(home: Mapping[str, Any], key: str, groups: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """ZeRO-1/2's base optimizer state dict (one flat partition a parameter group, whatever the number
    of ranks): the saved one's scalars (the step count) and param groups (learning rate, betas) with
    this rank's new partitions of each moment."""
    saved = home[key]
    state = {}
    for g, partitions in enumerate(groups):
        kept = {k: v for k, v in saved["state"].get(g, {}).items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
        if partitions or kept:
            state[g] = {**copy.deepcopy(kept), **partitions}
    return {"state": state, "param_groups": copy.deepcopy(saved["param_groups"])}


Partitions = tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]  # per group: the lean fp32 partition, the moments'


def _sliced_stage12(optimizer: Any, names: Mapping[int, str], shapes: list[Mapping[str, Any]],
                    read: Callable[[int], Mapping[str, Any]], world: int) -> Partitions:
    """This rank's partitions cut straight from the overlapping saved partitions.

    Raises:
        CorruptCheckpointError: a live group holds other parameters, or in another order, than the saved ``param_shapes``.
    """
    rank = torch.distributed.get_rank(group=optimizer.dp_process_group)
    first = read(0)[_OPTIM]
    fp32, moments = [], []
    for g, params in enumerate(optimizer.round_robin_bit16_groups):
        if g >= len(shapes) or [names.get(id(p)) for p in params] != list(shapes[g]):
            raise CorruptCheckpointError(f"parameter group {g} holds other parameters, or in another order, than the saved DeepSpeed checkpoint's")
        total = sum(math.prod(shape) for shape in shapes[g].values())
        size = optimizer.single_partition_of_fp32_groups[g].numel()
        saved = first["single_partition_of_fp32_groups"][g].numel() if world > 1 else max(total, 1)  # rank 0's is never short
        begin, end = rank * size, min((rank + 1) * size, total)
        keys = ["fp32", *_moments(first["base_optimizer_state"]["state"], g)]
        chunks: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
        for q in range(begin // saved, (end - 1) // saved + 1) if end > begin else ():
            osd = read(q)[_OPTIM]
            held = {"fp32": osd["single_partition_of_fp32_groups"][g], **_moments(osd["base_optimizer_state"]["state"], g)}
            lo, hi = max(begin - q * saved, 0), end - q * saved
            for key in keys:
                chunks[key].append(held[key][lo:hi])
        parts = {}
        for key, pieces in chunks.items():
            flat = torch.cat(pieces) if pieces else torch.zeros(0)
            parts[key] = torch.nn.functional.pad(flat, (0, size - flat.numel())).clone()
        fp32.append(parts.pop("fp32")[: size - optimizer.groups_padding[g]])
        moments.append(parts)
    return fp32, moments


def _file_stage12(optimizer: Any, home: Mapping[str, Any], fp32: list[torch.Tensor], moments: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """A ZeRO-1/2 optimizer file of the live layout holding these partitions."""
    new = {k: v for k, v in home.items() if k not in ("single_partition_of_fp32_groups", "base_optimizer_state")}
    new.update(single_partition_of_fp32_groups=fp32, base_optimizer_state=_base_state(home, "base_optimizer_state", moments),
               group_paddings=list(optimizer.groups_padding), partition_count=list(optimizer.partition_count))
    # The live layout's, where this DeepSpeed keeps them (its load checks the alignment paddings against its own).
    for key, attribute in (("param_alignment_paddings", "round_robin_bit16_padding"), ("param_slice_mappings", "_param_slice_mappings")):
        if key in home and hasattr(optimizer, attribute):
            new[key] = copy.deepcopy(getattr(optimizer, attribute))
    return new


def _partitions_stage3(optimizer: Any, names: Mapping[int, str], full: Whole, home: Mapping[str, Any]) -> dict[str, Any]:
    rank = torch.distributed.get_rank(group=optimizer.dp_process_group)
    world = torch.distributed.get_world_size(group=optimizer.dp_process_group)
    fp32, moments = [], []
    for g, params in enumerate(optimizer.fp16_groups):
        keys = _param(full, names, params[0]).keys() if params else ()
        parts: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
        for p in params:
            size = p.partition_numel()
            for key, value in _param(full, names, p).items():
                flat = torch.nn.functional.pad(value.reshape(-1), (0, size * world - value.numel()))
                parts[key].append(flat[rank * size:(rank + 1) * size])
        joined = {key: torch.cat(chunks) for key, chunks in parts.items()}
        live = optimizer.fp32_partitioned_groups_flat[g].numel()
        if joined and joined["fp32"].numel() != live:
            raise CorruptCheckpointError(f"sub-group {g}: the saved parameters make a partition of {joined['fp32'].numel()} elements, the live one has {live}")
        fp32.append(joined.pop("fp32"))
        moments.append(joined)
    new = {k: v for k, v in home.items() if k not in ("fp32_flat_groups", _OPTIM)}
    new.update(fp32_flat_groups=fp32, partition_count=world)
    new[_OPTIM] = _base_state_stage3(optimizer, home[_OPTIM], moments)
    return new


def _base_state_stage3(optimizer: Any, saved: Mapping[str, Any], moments: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """ZeRO-3's base optimizer state for the live sub-groups. Its optimizer sees each parameter group
    as that group's sub-groups' flat partitions, state keyed by sub-group, and how many sub-groups a
    group has depends on the partition sizes, so on the number of ranks: each live sub-group takes
    the scalars (the step count) of its group's first saved sub-group, and the groups list the live ones."""
    groups = copy.deepcopy(saved["param_groups"])
    live = {j: [i for i in range(len(moments)) if optimizer.sub_group_to_group_id[i] == j] for j in range(len(groups))}
    state = {}
    for j, group in enumerate(groups):
        first = group["params"][0] if group["params"] else None
        kept = {k: v for k, v in saved["state"].get(first, {}).items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
        for i in live[j]:
            if moments[i] or kept:
                state[i] = {**copy.deepcopy(kept), **moments[i]}
        group["params"] = live[j]
    return {"state": state, "param_groups": groups}
