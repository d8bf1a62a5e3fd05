"""The array leaves of a state (:class:`Leaf`), and the general walk that finds them in any state.

Every tensor and numpy array becomes a :class:`Leaf` holding the object itself (never a copy), after
checks that its raw bytes are its whole value (dense, strided, not quantized, a storable dtype); a
DTensor gives its local piece, the ranks that hold the same piece, and where it lies. Anything that
could not be stored without pickle raises :class:`~tierckpt.errors.UnsupportedStateError` naming its
key path. The skeleton follows the grammar in :mod:`tierckpt.state` and the limits of
:mod:`tierckpt.state.skeleton`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tierckpt.errors import UnsupportedStateError
from tierckpt.format.records import Region
from tierckpt.state.dtypes import _STORABLE_TORCH_DTYPES, _TORCH_DTYPE_NAMES, _numpy_problem
from tierckpt.state.pieces import PieceProblem, is_dtensor_type, local_piece
from tierckpt.state.skeleton import MAX_SKELETON_DEPTH, MAX_SKELETON_NODES, format_path

__all__ = ["Leaf"]

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_PLAIN = (type(None), bool, float, bytes)  # stored as themselves, nothing to check
_CONTAINER_TAGS: dict[type, str] = {dict: "d", OrderedDict: "od", list: "l", tuple: "t"}
_SUPPORTED = (
    "supported types are dict, collections.OrderedDict, list, tuple, None, bool, int, float, str, "
    "bytes, torch.Tensor, torch.nn.Parameter, torch.dtype, torch.device, numpy.ndarray and numpy scalars"
)


@dataclass(slots=True)  # not frozen: made per tensor (a frozen init costs 5x), though save() makes them only for a new layout
class Leaf:
    """One array of a flattened state.

    ``index`` is the leaf's position in the list ``flatten`` returns and the number its skeleton node
    refers to; ``path`` is the keys and list indices from the root; ``value`` is the caller's tensor or
    array itself (a numpy scalar becomes a 0-d array). ``dtype`` is the torch dtype name ("bfloat16") for
    ``kind == "torch"`` and ``dtype.str`` ("<f4") for ``kind == "numpy"``; ``nbytes`` is numel * item size.
    """

    index: int
    path: tuple[Any, ...]
    kind: str
    value: Any = field(compare=False, repr=False)
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    # A DTensor's local tensor (``value``, ``shape``): the global ranks that hold the same piece
    # (those differing from this one only along its Replicate() mesh dimensions; () if none does), and
    # where the piece lies in the global tensor. Replicas store it once between them.
    replicas: tuple[int, ...] = ()
    region: Region | None = None
    dtensor: Any = field(default=None, compare=False, repr=False)  # the DTensor whose local tensor is ``value``


# -- the general walk: any state, every check, no recursion ----------------------------------------


def _flatten_any(state: Any) -> tuple[Any, list[Leaf]]:
    leaves: list[Leaf] = []
    root: list[Any] = []
    ancestors: set[int] = set()  # ids of the containers being walked, to catch cycles
    # A task (obj, path, sink, depth, in_key) appends obj's node to the list sink; `depth` counts the
    # skeleton lists around that node. A bare int task marks leaving the container with that id. An
    # explicit stack, not recursion, so a deep state never meets Python's recursion limit.
    stack: list[Any] = [(state, (), root, 0, False)]
    nodes = 1  # pushed so far, as _decode counts them
    while stack:
        task = stack.pop()
        if type(task) is int:
            ancestors.discard(task)
            continue
        obj, path, sink, depth, in_key = task
        kind = type(obj)  # exact types: a subclass (IntEnum, defaultdict, namedtuple) would not come back
        if kind is torch.Tensor and not in_key and depth < MAX_SKELETON_DEPTH:  # the common case first
            sink.append(_leaf_node(obj, path, leaves))
        elif kind in _PLAIN:
            sink.append(obj)
        elif kind is str:
            if not obj.isascii():
                try:
                    obj.encode("utf-8")  # lone surrogates cannot become a msgpack str
                except UnicodeEncodeError:
                    raise _unsupported(obj, path, in_key, "it is not valid UTF-8") from None
            sink.append(obj)
        elif kind is int and _INT_MIN <= obj <= _INT_MAX:
            sink.append(obj)
        elif depth >= MAX_SKELETON_DEPTH:  # every node below is a list at level depth + 1
            raise _unsupported(obj, path, in_key, f"nested deeper than {MAX_SKELETON_DEPTH} skeleton lists")
        elif kind is int:
            try:
                sink.append(["i", str(obj)])
            except ValueError:  # more digits than sys.get_int_max_str_digits()
                raise _unsupported(obj, path, in_key, "the int has too many digits") from None
        elif kind is torch.dtype:
            sink.append(["dt", _TORCH_DTYPE_NAMES[obj]])
        elif kind is torch.device:
            sink.append(["dev", str(obj)])
        elif kind in _CONTAINER_TAGS:
            if id(obj) in ancestors:
                raise _unsupported(obj, path, in_key, "it is one of its own containers (a cycle)")
            nodes += len(obj) if kind is list or kind is tuple else 2 * len(obj)
            if nodes > MAX_SKELETON_NODES:
                raise _unsupported(
                    obj, path, in_key, f"the state has more than {MAX_SKELETON_NODES} values outside arrays; "
                    "store long lists of numbers as a tensor or numpy array"
                )
            ancestors.add(id(obj))
            stack.append(id(obj))
            children: list[Any] = []
            sink.append([_CONTAINER_TAGS[kind], children])
            if kind is list or kind is tuple:
                for i in range(len(obj) - 1, -1, -1):  # pushed in reverse so they pop in order
                    # Inside a dict key, errors name the dict: a key has no key path of its own.
                    stack.append((obj[i], path if in_key else (*path, i), children, depth + 2, in_key))
            else:
                items = list(obj.items())
                pairs: list[list[Any]] = [[] for _ in items]
                children.extend(pairs)
                for (key, value), pair in zip(reversed(items), reversed(pairs)):
                    stack.append((value, (*path, key), pair, depth + 3, in_key))
                    stack.append((key, path, pair, depth + 3, True))
        elif isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
            if in_key:
                raise _unsupported(obj, path, in_key, "arrays cannot be dict keys")
            sink.append(_leaf_node(obj, path, leaves))
        else:
            raise _unsupported(obj, path, in_key, _SUPPORTED)
    return root[0], leaves


def _leaf_node(obj: Any, path: tuple[Any, ...], leaves: list[Leaf]) -> list[Any]:
    """Check one array, append its Leaf and return its skeleton node."""
    index = len(leaves)
    replicas: tuple[int, ...] = ()
    region = dtensor = None
    if isinstance(obj, torch.Tensor) and is_dtensor_type(type(obj)):
        dtensor = obj
        try:
            obj, replicas, region = local_piece(obj)
        except PieceProblem as exc:
            raise _unsupported(dtensor, path, False, str(exc)) from None
    if isinstance(obj, torch.Tensor):
        problem = _tensor_problem(obj)
        if problem is not None:
            raise _unsupported(obj, path, False, problem)
        dtype, nbytes = _TORCH_DTYPE_NAMES[obj.dtype], obj.numel() * obj.element_size()
        leaves.append(Leaf(index, path, "torch", obj, dtype, tuple(obj.shape), nbytes, replicas, region, dtensor))
        return ["T", index]
    if type(obj) is np.ndarray:
        array, tag = obj, "N"
    elif isinstance(obj, np.generic) and obj.dtype.type is type(obj):
        array, tag = np.asarray(obj), "n"
    else:
        raise _unsupported(obj, path, False, f"numpy subclasses are not supported (np.asarray); {_SUPPORTED}")
    problem = _numpy_problem(array.dtype)
    if problem is not None:
        raise _unsupported(obj, path, False, problem)
    leaves.append(Leaf(index, path, "numpy", array, array.dtype.str, array.shape, array.nbytes))
    return [tag, index]


def _tensor_problem(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` cannot be stored as its raw bytes, or None if it can."""
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        return "tensor subclasses other than torch.nn.Parameter (e.g. DTensor) are not supported yet"
    if tensor.is_nested:
        return "nested tensors are not supported"
    if tensor.layout is not torch.strided:
        return f"layout {tensor.layout} is not supported (only dense, strided tensors; try .to_dense())"
    if tensor.device.type == "meta":
        return "meta tensors have no data to store"
    if tensor.is_quantized:
        return "quantized tensors are not supported (their scale and zero point are not in their bytes)"
    if _TORCH_DTYPE_NAMES.get(tensor.dtype) not in _STORABLE_TORCH_DTYPES:
        return f"dtype {tensor.dtype} cannot be stored as raw bytes"
    return None


def _unsupported(obj: Any, path: tuple[Any, ...], in_key: bool, reason: str) -> UnsupportedStateError:
    where = f"a key of the dict at {format_path(path)}" if in_key else format_path(path)
    kind = type(obj)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return UnsupportedStateError(f"cannot store {name} at {where}: {reason}", key=format_path(path))
