"""What ``save()`` reads of a state on the training thread: :func:`survey`, and :func:`flatten` built on it.

A :class:`Survey` is the skeleton, each array leaf's value, and one small row a leaf that says where it
lies and what it is (key path, kind, dtype, shape, and a DTensor piece's place). A training loop saves
the same layout every time: the rows of two saves compare equal, and the slot layout planned for the
first is reused (:class:`~tierckpt.snapshot.LayoutCache`). The :class:`~tierckpt.state.leaves.Leaf`
objects that planning needs are made only then, so a save whose layout did not change makes none.
The common case (dicts with str or int keys, lists, tuples, dense tensors and DTensors, numpy values,
plain scalars) takes a recursive walk 2-3x faster than the general one (:mod:`tierckpt.state.leaves`),
which any other state takes, with every check and error.
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tierckpt.state.dtypes import _STORABLE_TORCH_DTYPES, _TORCH_DTYPE_NAMES
from tierckpt.state.leaves import _CONTAINER_TAGS, _INT_MAX, _INT_MIN, Leaf, _flatten_any, _leaf_node
from tierckpt.state.pieces import is_dtensor_type, local_piece
from tierckpt.state.skeleton import MAX_SKELETON_NODES

__all__ = ["Survey", "flatten", "survey"]

# One leaf's place and type. From the common-case walk, (parent path, key, dtype name, shape): the
# leaf's path is parent + (key,), or parent itself when key is _WHOLE (a list item, the root), a
# tensor's shape is its torch.Size (equal to the tuple) and its kind follows from the value's type;
# a path tuple a tensor was a tenth of the walk. From the general walk, (path with each key's type,
# kind, dtype, shape, region, replicas): its keys may be bools and floats, and True == 1 == 1.0 would
# make two states that name their arrays differently compare equal. A DTensor's row from the
# common-case walk is (path, _WHOLE, dtype name, local shape, (region, replicas)). Rows of the two walks
# never compare equal: a state that changes walk re-plans.
Row = tuple[Any, ...]
_WHOLE = object()


@dataclass(slots=True)
class Survey:
    """A state as ``save()`` reads it: ``skeleton`` (msgpack-able; the common-case walk makes its
    nodes tuples, not lists: see below), ``values`` (each array leaf itself, a DTensor's local tensor,
    in skeleton order) and ``rows`` (the leaves' places and types, as :data:`Row`). Two surveys with
    equal rows lay their leaves out alike.

    Read in the same pass, for the capture's checks: ``versions``, each leaf's in-place version
    counter (-1 for numpy values and inference tensors, which have none), and ``on_device``, the
    indices of the leaves on a CUDA device.
    """

    skeleton: Any
    values: list[Any]
    rows: list[Row]
    versions: list[int]
    on_device: list[int]
    _leaves: list[Leaf] | None = field(default=None, repr=False)
    _dtensors: dict[int, Any] | None = field(default=None, repr=False)  # leaf index -> the DTensor whose local tensor it is

    def leaves(self) -> list[Leaf]:
        """The :class:`Leaf` of each value (made at the first call)."""
        if self._leaves is None:  # a survey of the common-case walk (the general walk's has them)
            leaves = self._leaves = []
            dtensors = self._dtensors or {}
            for i, (value, row) in enumerate(zip(self.values, self.rows)):
                parent, key, dtype, shape = row[:4]
                path = parent if key is _WHOLE else (*parent, key)
                kind = "numpy" if type(value) is np.ndarray else "torch"
                if len(row) == 5:  # a DTensor's local piece
                    region, replicas = row[4]
                    leaves.append(Leaf(i, path, kind, value, dtype, tuple(shape), value.nbytes, replicas, region, dtensors[i]))
                else:
                    leaves.append(Leaf(i, path, kind, value, dtype, tuple(shape), value.nbytes))
        return self._leaves

    @classmethod
    def of_leaves(cls, skeleton: Any, leaves: list[Leaf]) -> Survey:
        found = cls(skeleton, [], [], [], [], leaves)
        for leaf in leaves:
            value = leaf.value
            found.values.append(value)
            path = tuple((type(k), k) for k in leaf.path)
            found.rows.append((path, leaf.kind, leaf.dtype, leaf.shape, leaf.region, leaf.replicas))
            version = -1
            if leaf.kind == "torch":
                try:
                    version = value._version
                except RuntimeError:  # an inference tensor: it has no version counter
                    pass
                if value.is_cuda:
                    found.on_device.append(leaf.index)
            found.versions.append(version)
        return found


def survey(state: Any) -> Survey:
    """The :class:`Survey` of ``state`` (nothing copied or moved); raises as :func:`flatten` does."""
    # The walk makes a few objects per value: thousands for a model and its optimizer, which would
    # run the collector several times inside save() (measured: 0.15-0.3 ms of a 1.5 ms call for 600
    # tensors). Paused, it runs once afterwards, and its older generations far more rarely.
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        try:
            return _flatten_common(state)
        except Exception:  # noqa: BLE001 - any surprise: the general walk handles it, and names any problem
            pass
        return Survey.of_leaves(*_flatten_any(state))
    finally:
        if paused:
            gc.enable()


def flatten(state: Any) -> tuple[Any, list[Leaf]]:
    """Split ``state`` into a msgpack-able skeleton and its array leaves (neither copied nor moved).

    Leaves are numbered in depth-first order, dict keys before values. The same tensor object reached
    twice gives two leaves.

    Example::

        skeleton, leaves = flatten({"model": model.state_dict(), "step": 7})
        state = unflatten(skeleton, [leaf.value for leaf in leaves])

    Raises:
        UnsupportedStateError: a value cannot be stored without pickle (an unsupported type, a sparse,
            quantized, meta or nested tensor, a tensor subclass, a numpy object array, a cycle, a state
            nested past MAX_SKELETON_DEPTH or with more than MAX_SKELETON_NODES values). The message and
            ``key`` name its key path.
    """
    found = survey(state)
    return _as_lists(found.skeleton), found.leaves()


def _as_lists(node: Any) -> Any:
    """``node`` with its tuple nodes as lists: the grammar's own form, as msgpack reads it back."""
    if type(node) is not tuple:
        return node
    tag, payload = node
    if tag in ("d", "od"):
        return [tag, [[_as_lists(k), _as_lists(v)] for k, v in payload]]
    if tag in ("l", "t"):
        return [tag, [_as_lists(v) for v in payload]]
    return [tag, payload]


# -- the common case: save() calls survey on the training thread, so its cost per tensor is the call's --
#
# Its skeleton's nodes are tuples, ("d", ((key, node), ...)), not lists: msgpack stores them alike, and
# unflatten takes both. A tuple of strings, numbers and such tuples is one Python's collector stops
# tracking the first time it looks at it; a list stays tracked. A snapshot keeps its skeleton (a
# thousand nodes for 600 tensors) for several saves: as lists, each save's were promoted to the oldest
# generation and set off a full collection every ~250 saves (measured: 0.5-0.7 ms a save, on the
# training thread, with only torch imported); as tuples, none.

_FAST_DEPTH = 200  # nesting the recursive walk takes; deeper states go to the general walk (no recursion)
_STRIDED = torch.strided
_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_STORABLE_NAMES = {d: name for d, name in _TORCH_DTYPE_NAMES.items() if name in _STORABLE_TORCH_DTYPES}
_SCALARS = (type(None), bool, float, bytes)
_DTENSOR_KINDS: set[type] = set()  # DTensor, once a walk has met it (found by name: nothing of torch.distributed imported)


# The skeleton node of tensor leaf i, ("T", i), made once and shared by every skeleton: one object a
# tensor fewer for each walk to make (measured: 0.05 ms of a 0.56 ms walk of 600 tensors, with the
# collection it set off when nodes were lists).
_SHARED_LEAF_NODES = 1 << 16  # leaves past this many get nodes of their own
_LEAF_NODES: list[tuple[str, int]] = []
_GROWING = threading.Lock()  # two threads' walks must not grow it at once: node i must stay at i


def _shared_node(index: int) -> tuple[str, int]:
    """``("T", index)``: the shared node, the shared list grown to reach it (up to its bound)."""
    if index >= _SHARED_LEAF_NODES:
        return ("T", index)
    with _GROWING:
        have = len(_LEAF_NODES)
        if index >= have:
            _LEAF_NODES.extend([("T", i) for i in range(have, min(_SHARED_LEAF_NODES, max(2 * have, index + 1, 1024)))])
    return _LEAF_NODES[index]


class _Unusual(Exception):
    """Something the common-case walk leaves to the general one."""


def _flatten_common(state: Any) -> Survey:
    """:func:`survey` of a state made of dicts with str or int keys, lists, tuples, dense tensors of
    storable dtypes (with version counters: not inference tensors) and DTensors of such local tensors
    whose placements can be stored, numpy values and plain scalars,
    nested at most ``_FAST_DEPTH`` deep: the same survey as the general walk's. Raises on anything
    else (:func:`survey` then takes the general walk)."""
    found = Survey(None, [], [], [], [])
    counted = [1]  # values walked, as the general walk counts them (MAX_SKELETON_NODES)
    found.skeleton = _node(state, (), found, 0, counted)
    if counted[0] > MAX_SKELETON_NODES:
        raise _Unusual
    return found


def _node(obj: Any, path: tuple[Any, ...], found: Survey, depth: int, counted: list[int]) -> Any:
    kind = type(obj)
    if kind is dict or kind is OrderedDict:  # first: dict values that are tensors or scalars are taken inline
        if depth > _FAST_DEPTH:
            raise _Unusual
        counted[0] += 2 * len(obj)
        pairs: list[tuple[Any, Any]] = []
        append = pairs.append
        values, rows, versions = found.values, found.rows, found.versions
        for key, value in obj.items():
            kk = type(key)
            if not ((kk is str and key.isascii()) or (kk is int and _INT_MIN <= key <= _INT_MAX)):
                raise _Unusual
            # The values a state holds most (tensors, then plain scalars) without a call deeper: a
            # call a value was a good part of the walk's cost. A tensor: _tensor_node, inlined, its
            # row naming this dict's path and its key, not a path of its own.
            vk = type(value)
            if vk is _TENSOR or vk is _PARAMETER:
                name = _STORABLE_NAMES.get(value.dtype)
                if name is None or value.layout is not _STRIDED:  # a strided nested tensor raises at .shape below
                    raise _Unusual
                index = len(values)
                if not value.is_cpu:
                    if value.is_meta:
                        raise _Unusual
                    if value.is_cuda:
                        found.on_device.append(index)
                versions.append(value._version)  # an inference tensor raises: the general walk takes it
                values.append(value)
                rows.append((path, key, name, value.shape))
                try:
                    node = _LEAF_NODES[index]
                except IndexError:
                    node = _shared_node(index)
                append((key, node))
            elif vk in _SCALARS or (vk is int and _INT_MIN <= value <= _INT_MAX):
                append((key, value))
            elif vk in _DTENSOR_KINDS:  # FSDP2's weights and moments: straight to their node
                append((key, _dtensor_node(value, (*path, key), found)))
            else:
                append((key, _node(value, (*path, key), found, depth + 3, counted)))
        return (_CONTAINER_TAGS[kind], tuple(pairs))
    if kind is _TENSOR or kind is _PARAMETER:
        return _tensor_node(obj, path, found)
    if kind in _SCALARS or (kind is str and obj.isascii()) or (kind is int and _INT_MIN <= obj <= _INT_MAX):
        return obj
    if depth > _FAST_DEPTH:
        raise _Unusual
    if kind is list or kind is tuple:
        counted[0] += len(obj)
        items: list[Any] = []
        add = items.append
        for i, value in enumerate(obj):
            vk = type(value)
            if vk in _SCALARS or (vk is int and _INT_MIN <= value <= _INT_MAX):
                add(value)
            else:
                add(_node(value, (*path, i), found, depth + 2, counted))
        return (_CONTAINER_TAGS[kind], tuple(items))
    if kind is torch.dtype:
        return ("dt", _TORCH_DTYPE_NAMES[obj])
    if kind is torch.device:
        return ("dev", str(obj))
    if kind is np.ndarray or isinstance(obj, np.generic):
        leaves: list[Leaf] = []
        tag = _leaf_node(obj, path, leaves)[0]  # "N" or "n", with the general walk's checks
        leaf = leaves[0]
        found.values.append(leaf.value)
        found.rows.append((path, _WHOLE, leaf.dtype, leaf.shape))
        found.versions.append(-1)
        return (tag, len(found.values) - 1)
    if is_dtensor_type(kind):
        _DTENSOR_KINDS.add(kind)
        return _dtensor_node(obj, path, found)
    raise _Unusual


def _tensor_node(obj: torch.Tensor, path: tuple[Any, ...], found: Survey, piece: Any = None) -> tuple[str, int]:
    """The skeleton node of a plain tensor or Parameter that passes every check, its value, row and
    version recorded; else raises. A tensor in a dict takes the same lines inlined in :func:`_node`.
    ``piece``: (region, replicas) when ``obj`` is a DTensor's local tensor (its row has it as a fifth field)."""
    name = _STORABLE_NAMES.get(obj.dtype)  # quantized dtypes are not storable: no is_quantized needed
    if name is None or obj.layout is not _STRIDED:  # a strided nested tensor raises at .shape below
        raise _Unusual
    index = len(found.values)
    if not obj.is_cpu:
        if obj.is_meta:
            raise _Unusual
        if obj.is_cuda:
            found.on_device.append(index)
    found.versions.append(obj._version)
    found.values.append(obj)
    found.rows.append((path, _WHOLE, name, obj.shape) if piece is None else (path, _WHOLE, name, obj.shape, piece))
    try:
        return _LEAF_NODES[index]
    except IndexError:
        return _shared_node(index)


def _dtensor_node(obj: Any, path: tuple[Any, ...], found: Survey) -> tuple[str, int]:
    """:func:`_tensor_node` of a DTensor: its local piece is the leaf, the DTensor kept beside it. A
    DTensor that cannot be stored raises here and the general walk names the problem."""
    local, replicas, region = local_piece(obj)
    if type(local) is not _TENSOR and type(local) is not _PARAMETER:  # a subclass inside (Float8 and the like)
        raise _Unusual
    node = _tensor_node(local, path, found, (region, replicas))
    if found._dtensors is None:
        found._dtensors = {}
    found._dtensors[node[1]] = obj
    return node
