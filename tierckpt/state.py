"""Flatten a training state into array leaves and a msgpack-able skeleton, and rebuild it.

``flatten(state)`` walks dicts, lists and tuples. Every torch tensor and numpy array becomes a
:class:`Leaf` that holds the object itself (never a copy); everything else goes into a *skeleton* built
only from None, bool, int, float, str, bytes and lists, so msgpack stores it without maps, extension
types or pickle. ``unflatten(skeleton, arrays)`` rebuilds the state. Skeletons are read back from
manifests on disk, i.e. from untrusted bytes, so ``unflatten`` checks every node and raises
:class:`CorruptCheckpointError` rather than anything else.

Skeleton grammar (a node is a scalar or a ``[tag, payload]`` list)::

    None | bool | int (-2**63 .. 2**64-1) | float | str | bytes    the value itself
    ["d", [[key, value], ...]]  dict             ["od", [[key, value], ...]]  OrderedDict, order kept
    ["l", [node, ...]]          list             ["t", [node, ...]]           tuple
    ["T", i] torch tensor leaf  ["N", i] numpy array leaf  ["n", i] numpy scalar (a 0-d array leaf)
    ["i", "-123..."] int outside the msgpack range
    ["dt", "float32"] torch.dtype                ["dev", "cuda:0"] torch.device

Known losses, by design: a sub-structure shared by two keys is stored twice (identity is not kept), a
``torch.nn.Parameter`` comes back as whatever array the caller passes (a plain tensor), and the
``_metadata`` attribute of a module state_dict is dropped (``load_state_dict`` works without it).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tierckpt.errors import CorruptCheckpointError, UnsupportedStateError
from tierckpt.format.manifest import Region

__all__ = [
    "MAX_SKELETON_DEPTH", "MAX_SKELETON_NODES", "Leaf", "flatten", "unflatten", "skeleton_leaf_count", "format_path",
    "torch_dtype", "numpy_dtype",
]

# msgpack 1.x packs and unpacks at most 1024 nested arrays/maps, and the manifest wraps the skeleton in a
# few levels of its own. A dict level costs 3 skeleton lists (tag, items, pair) and a list or tuple level 2,
# so this allows about 330 nested dicts or 500 nested lists: far beyond any real training state.
MAX_SKELETON_DEPTH = 1000
# Nodes (values, containers, dict keys, leaves) in one skeleton. Decoding an untrusted skeleton holds a
# task per node not yet visited, ~150 bytes each: this bounds that to ~600 MB, whatever the manifest
# says. A real state has ~10 nodes per tensor (an optimizer's per-parameter dict, its params list), so
# this allows ~400,000 tensors; a save past it is refused (store a long list of numbers as an array).
MAX_SKELETON_NODES = 1 << 22

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_PLAIN = (type(None), bool, float, bytes)  # stored as themselves, nothing to check
_CONTAINER_TAGS: dict[type, str] = {dict: "d", OrderedDict: "od", list: "l", tuple: "t"}
_SUPPORTED = (
    "supported types are dict, collections.OrderedDict, list, tuple, None, bool, int, float, str, "
    "bytes, torch.Tensor, torch.nn.Parameter, torch.dtype, torch.device, numpy.ndarray and numpy scalars"
)

# Every dtype torch defines, by canonical name ("float32", not the alias "float"). Read from vars() so a
# hostile name never reaches getattr(torch, ...), which can import submodules lazily.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
# Quantized values need a scale and a zero point besides their bytes. Every other torch 2.13 dtype
# (bf16, bool, complex, float8, sub-byte and bits types, uint16/32/64) can be created with torch.empty
# and viewed as uint8, so its bytes are the whole value; tests/test_state.py re-checks this probe.
# Beware: uint1..uint7 and int1..int7 have no copy kernel; copy them through .view(torch.uint8).
_QUANTIZED_DTYPES = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})
_STORABLE_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: d for name, d in _TORCH_DTYPES.items() if name not in _QUANTIZED_DTYPES
}
_TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {d: name for name, d in _TORCH_DTYPES.items()}

# The shapes numpy's dtype.str takes for plain dtypes: byte order, kind, item size, datetime unit. Checked
# before np.dtype() sees the text, which would otherwise also parse comma lists into structured dtypes.
_NUMPY_DTYPE_RE = re.compile(r"[<>|][biufcmMSUV][0-9]{1,12}(\[[0-9]{0,6}[a-zA-Z]{1,7}\])?")
_DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?")
_BIG_INT_RE = re.compile(r"-?[0-9]+")


@dataclass(frozen=True, slots=True)
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


def format_path(path: tuple[Any, ...]) -> str:
    """Render a key path for messages: ``format_path(("optim", "state", 0))`` is ``"['optim']['state'][0]"``.

    The empty path (the state itself) is ``"<root>"``.
    """
    return "".join(f"[{key!r}]" for key in path) if path else "<root>"


def torch_dtype(name: str) -> torch.dtype:
    """Return the storable torch dtype called ``name`` (a :attr:`Leaf.dtype`), e.g. ``"bfloat16"``.

    Raises:
        CorruptCheckpointError: ``name`` is not the canonical name of a dtype whose bytes are its value.
    """
    dtype = _STORABLE_TORCH_DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise CorruptCheckpointError(f"unknown or unstorable torch dtype {_short(name)}")
    return dtype


def numpy_dtype(name: str) -> np.dtype[Any]:
    """Parse a numpy ``dtype.str`` (a :attr:`Leaf.dtype`) such as ``"<f4"``, ``"|b1"`` or ``"<M8[ns]"``.

    Only canonical strings of plain dtypes are accepted: object, structured and sub-array dtypes, whose
    values are not just their bytes, are refused.

    Raises:
        CorruptCheckpointError: ``name`` is not such a string.
    """
    if type(name) is not str or not _NUMPY_DTYPE_RE.fullmatch(name):
        raise CorruptCheckpointError(f"invalid numpy dtype string {_short(name)}")
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"invalid numpy dtype string {name!r}") from exc
    if _numpy_problem(dtype) is not None or dtype.str != name:
        raise CorruptCheckpointError(f"unstorable or non-canonical numpy dtype string {name!r}")
    return dtype


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


def unflatten(skeleton: Any, arrays: Sequence[Any]) -> Any:
    """Rebuild the state that ``flatten`` split into ``skeleton`` and leaves.

    ``arrays[i]`` is the value for leaf ``i``: a ``torch.Tensor`` for tensor leaves, a ``np.ndarray`` for
    numpy leaves (0-d for numpy scalars). They are placed in the state as given, not copied. Every array
    must be used exactly once.

    Raises:
        CorruptCheckpointError: the skeleton is malformed (not the grammar above, an unknown tag, a leaf
            index out of range or used twice, an unhashable or duplicate dict key, nesting past
            MAX_SKELETON_DEPTH, more than MAX_SKELETON_NODES nodes), or it does not match ``arrays``.
    """
    state, used = _decode(skeleton, arrays)
    if len(used) != len(arrays):
        raise CorruptCheckpointError(f"the skeleton uses {len(used)} of the {len(arrays)} arrays given")
    return state


def skeleton_leaf_count(skeleton: Any) -> int:
    """Validate ``skeleton`` and return how many leaves it refers to (its indices are 0 .. count-1).

    Raises:
        CorruptCheckpointError: the skeleton is malformed, or its leaf indices are not 0 .. count-1.
    """
    _, used = _decode(skeleton, None)
    if used and max(used) != len(used) - 1:  # indices are unique, so this means they are 0 .. n-1
        raise CorruptCheckpointError(f"the skeleton's {len(used)} leaf indices are not 0..{len(used) - 1}")
    return len(used)


def _leaf_node(obj: Any, path: tuple[Any, ...], leaves: list[Leaf]) -> list[Any]:
    """Check one array, append its Leaf and return its skeleton node."""
    index = len(leaves)
    replicas: tuple[int, ...] = ()
    region = dtensor = None
    if isinstance(obj, torch.Tensor) and _is_dtensor(obj):
        dtensor = obj
        obj, replicas, region = _dtensor_piece(obj, path)
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


def _dtensor_piece(dtensor: Any, path: tuple[Any, ...]) -> tuple[torch.Tensor, tuple[int, ...], Region]:
    """A DTensor's local tensor, the global ranks holding the same piece, and where it lies."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = dtensor.device_mesh, tuple(dtensor.placements)
    for p in placements:
        if type(p) is not Shard and type(p) is not Replicate:
            why = (
                "it holds partial values still to be reduced; redistribute it to Replicate() or Shard() first"
                if p.is_partial()
                else "only Shard(dim) and Replicate() placements can be stored (strided or custom shardings cannot)"
            )
            raise _unsupported(dtensor, path, False, f"a DTensor with placements {placements}: {why}")
    local = dtensor.to_local()
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise _unsupported(dtensor, path, False, "this rank is not in the DTensor's device mesh")
    shape, offset = compute_local_shape_and_global_offset(dtensor.shape, mesh, placements)
    if tuple(shape) != tuple(local.shape):
        raise _unsupported(dtensor, path, False, f"its local tensor {list(local.shape)} is not the piece {list(shape)} its placements give")
    # The same piece lives on every rank that differs from this one only along Replicate() dimensions.
    index = tuple(slice(None) if p.is_replicate() else c for p, c in zip(placements, coordinate))
    replicas = tuple(sorted(int(r) for r in mesh.mesh[index].reshape(-1).tolist()))
    return local, replicas if len(replicas) > 1 else (), Region(tuple(dtensor.shape), tuple(int(o) for o in offset))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    cls = type(tensor)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


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


def _numpy_problem(dtype: np.dtype[Any]) -> str | None:
    """Why arrays of ``dtype`` cannot be stored as their raw bytes, or None if they can."""
    if dtype.hasobject:
        return f"numpy dtype {dtype} holds Python objects, which cannot be stored without pickle"
    if dtype.fields is not None or dtype.subdtype is not None:
        return f"structured numpy dtype {dtype} is not supported"
    try:
        if np.dtype(dtype.str) != dtype:
            return f"numpy dtype {dtype} is not described by its dtype string {dtype.str!r}"
    except TypeError:
        return f"numpy dtype {dtype} has no dtype string numpy can parse"
    return None


def _unsupported(obj: Any, path: tuple[Any, ...], in_key: bool, reason: str) -> UnsupportedStateError:
    where = f"a key of the dict at {format_path(path)}" if in_key else format_path(path)
    kind = type(obj)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return UnsupportedStateError(f"cannot store {name} at {where}: {reason}", key=format_path(path))


# --- decoding -----------------------------------------------------------------------------------------

_SCALAR_NODES = (type(None), bool, int, float, str, bytes)
_KEY_TAGS = frozenset({"t", "i", "dt", "dev"})  # what may appear in a dict key: hashable, no leaves
_PathLink = tuple[Any, Any] | None  # (parent link, key): built per node cheaply, rendered only on error


def _decode(skeleton: Any, arrays: Sequence[Any] | None) -> tuple[Any, set[int]]:
    """Validate and rebuild ``skeleton``; return the state and the leaf indices used.

    With ``arrays=None`` only validates (leaves decode to None). Works in post order on an explicit
    stack, so a hostile, deeply nested skeleton costs memory bounded by MAX_SKELETON_DEPTH, not a crash.
    """
    used: set[int] = set()
    values: list[Any] = []  # decoded children, waiting for their container to be built
    # ("visit", node, path, depth, in_key) decodes a node; ("build", tag, count, path) pops `count` values.
    work: list[tuple[Any, ...]] = [("visit", skeleton, None, 0, False)]
    nodes = 1  # visits pushed so far: checked before a container's children are pushed
    while work:
        task = work.pop()
        if task[0] == "build":
            _, tag, count, path = task
            start = len(values) - count
            items = values[start:]
            del values[start:]
            values.append(_build(tag, items, path))
            continue
        _, node, path, depth, in_key = task
        kind = type(node)
        if kind in _SCALAR_NODES:
            values.append(node)
            continue
        if kind is not list:
            found = "a msgpack map" if kind is dict else f"a {kind.__name__}"
            raise _corrupt(path, in_key, f"found {found} where a value node was expected")
        if len(node) != 2 or type(node[0]) is not str:
            raise _corrupt(path, in_key, "a list node is not a [tag, payload] pair")
        if depth >= MAX_SKELETON_DEPTH:
            raise _corrupt(path, in_key, f"the skeleton nests deeper than {MAX_SKELETON_DEPTH} lists")
        tag, payload = node
        if in_key and tag not in _KEY_TAGS:
            raise _corrupt(path, in_key, f"tag {_short(tag)} cannot appear in a dict key")
        if tag in ("l", "t", "d", "od"):
            if type(payload) is not list:
                raise _corrupt(path, in_key, f"the payload of tag {tag!r} is not a list")
            nodes += len(payload) if tag in ("l", "t") else 2 * len(payload)
            if nodes > MAX_SKELETON_NODES:
                raise _corrupt(path, in_key, f"the skeleton has more than {MAX_SKELETON_NODES} nodes")
            if tag in ("l", "t"):
                work.append(("build", tag, len(payload), path))
                for i in range(len(payload) - 1, -1, -1):
                    work.append(("visit", payload[i], path if in_key else (path, i), depth + 2, in_key))
                continue
            work.append(("build", tag, 2 * len(payload), path))
            for i in range(len(payload) - 1, -1, -1):
                pair = payload[i]
                if type(pair) is not list or len(pair) != 2:
                    raise _corrupt(path, in_key, f"item {i} of a dict is not a [key, value] pair")
                label = pair[0] if type(pair[0]) in (str, int) else f"<key #{i}>"
                work.append(("visit", pair[1], (path, label), depth + 3, in_key))
                work.append(("visit", pair[0], path, depth + 3, True))
        else:
            values.append(_decode_atom(tag, payload, path, in_key, arrays, used))
    return values[0], used


def _build(tag: str, items: list[Any], path: _PathLink) -> Any:
    """Build the container ``tag`` from its decoded children (keys and values alternate for dicts)."""
    if tag == "l":
        return items
    if tag == "t":
        return tuple(items)
    keys, values = items[0::2], items[1::2]
    try:
        result: dict[Any, Any] = dict(zip(keys, values)) if tag == "d" else OrderedDict(zip(keys, values))
    except TypeError:
        raise _corrupt(path, False, "a dict key is not hashable") from None
    if len(result) != len(keys):
        raise _corrupt(path, False, "a dict has the same key twice")
    return result


def _decode_atom(
    tag: str, payload: Any, path: _PathLink, in_key: bool, arrays: Sequence[Any] | None, used: set[int]
) -> Any:
    """Decode a tagged node that is not a container: a leaf, a big int, a dtype or a device."""
    if tag in ("T", "N", "n"):
        if type(payload) is not int:
            raise _corrupt(path, in_key, f"a leaf index is a {type(payload).__name__}, not an int")
        if payload < 0 or (arrays is not None and payload >= len(arrays)):
            raise _corrupt(path, in_key, f"leaf index {_short(payload)} is out of range")
        if payload in used:
            raise _corrupt(path, in_key, f"leaf index {payload} is used twice")
        used.add(payload)
        if arrays is None:
            return None
        value = arrays[payload]
        if tag == "T" and isinstance(value, torch.Tensor):
            return value
        if tag == "N" and isinstance(value, np.ndarray):
            return value
        if tag == "n" and isinstance(value, np.ndarray) and value.ndim == 0:
            return value[()]  # the numpy scalar of the array's dtype
        raise _corrupt(path, in_key, f"leaf {payload} (tag {tag!r}) was given a {type(value).__name__}")
    if tag not in ("i", "dt", "dev"):
        raise _corrupt(path, in_key, f"unknown tag {_short(tag)}")
    if type(payload) is not str:
        raise _corrupt(path, in_key, f"tag {tag!r} with a {type(payload).__name__} payload")
    if tag == "i" and _BIG_INT_RE.fullmatch(payload):
        try:
            return int(payload)
        except ValueError:  # past sys.get_int_max_str_digits(), which bounds quadratic decimal parsing
            raise _corrupt(path, in_key, "a big int has too many digits") from None
    if tag == "dt" and payload in _TORCH_DTYPES:
        return _TORCH_DTYPES[payload]
    if tag == "dev" and _DEVICE_RE.fullmatch(payload):
        try:
            return torch.device(payload)
        except RuntimeError:
            pass
    raise _corrupt(path, in_key, f"invalid {tag!r} payload {_short(payload)}")


def _corrupt(link: _PathLink, in_key: bool, message: str) -> CorruptCheckpointError:
    keys: list[Any] = []
    while link is not None:
        link, key = link
        keys.append(key)
    path = format_path(tuple(reversed(keys)))
    where = f"a key of the dict at {path}" if in_key else path
    return CorruptCheckpointError(f"malformed skeleton at {where}: {message}", key=path)


def _short(value: Any) -> str:
    """A bounded repr of an untrusted value for error messages."""
    try:
        text = repr(value) if type(value) in _SCALAR_NODES else f"<{type(value).__name__}>"
    except ValueError:  # an int past sys.get_int_max_str_digits()
        text = "<huge int>"
    return text if len(text) <= 40 else text[:37] + "..."
