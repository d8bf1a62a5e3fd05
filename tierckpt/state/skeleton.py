"""Decoding a skeleton back into a state: :func:`unflatten` and :func:`skeleton_leaf_count`.

Skeletons are read back from manifests on disk, i.e. from untrusted bytes: every node is checked
against the grammar in :mod:`tierckpt.state` (no pickle, no msgpack maps or extension types), the work
is bounded by :data:`MAX_SKELETON_DEPTH` and :data:`MAX_SKELETON_NODES`, and anything wrong raises
:class:`~tierckpt.errors.CorruptCheckpointError`. The limits and :func:`format_path` live here because
flattening (:mod:`tierckpt.state.walk`, :mod:`tierckpt.state.leaves`) refuses to write what this
module would refuse to read.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tierckpt.errors import CorruptCheckpointError
from tierckpt.state.dtypes import _SCALAR_NODES, _TORCH_DTYPES, _short

__all__ = ["MAX_SKELETON_DEPTH", "MAX_SKELETON_NODES", "unflatten", "skeleton_leaf_count", "format_path"]

# msgpack 1.x packs and unpacks at most 1024 nested arrays/maps, and the manifest wraps the skeleton in a
# few levels of its own. A dict level costs 3 skeleton lists (tag, items, pair) and a list or tuple level 2,
# so this allows about 330 nested dicts or 500 nested lists: far beyond any real training state.
MAX_SKELETON_DEPTH = 1000
# Nodes (values, containers, dict keys, leaves) in one skeleton. Decoding an untrusted skeleton holds a
# task per node not yet visited, ~150 bytes each: this bounds that to ~600 MB, whatever the manifest
# says. A real state has ~10 nodes per tensor (an optimizer's per-parameter dict, its params list), so
# this allows ~400,000 tensors; a save past it is refused (store a long list of numbers as an array).
MAX_SKELETON_NODES = 1 << 22

_DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?")
_BIG_INT_RE = re.compile(r"-?[0-9]+")
_KEY_TAGS = frozenset({"t", "i", "dt", "dev"})  # what may appear in a dict key: hashable, no leaves
_PathLink = tuple[Any, Any] | None  # (parent link, key): built per node cheaply, rendered only on error


def format_path(path: tuple[Any, ...]) -> str:
    """Render a key path for messages: ``format_path(("optim", "state", 0))`` is ``"['optim']['state'][0]"``.

    The empty path (the state itself) is ``"<root>"``.
    """
    return "".join(f"[{key!r}]" for key in path) if path else "<root>"


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
        if kind is not list and kind is not tuple:  # a tuple: a node save() made in memory (never from msgpack)
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
            if type(payload) is not list and type(payload) is not tuple:
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
                if (type(pair) is not list and type(pair) is not tuple) or len(pair) != 2:
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
