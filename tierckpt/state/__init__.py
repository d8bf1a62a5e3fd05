"""Flatten a training state into array leaves and a msgpack-able skeleton, and rebuild it.

``flatten(state)`` walks dicts, lists and tuples. Every torch tensor and numpy array becomes a
:class:`Leaf` that holds the object itself (never a copy); everything else goes into a *skeleton* built
only from None, bool, int, float, str, bytes and lists, so msgpack stores it without maps, extension
types or pickle. ``unflatten(skeleton, arrays)`` rebuilds the state. Skeletons are read back from
manifests on disk, i.e. from untrusted bytes, so ``unflatten`` checks every node and raises
:class:`CorruptCheckpointError` rather than anything else.

Skeleton grammar (a node is a scalar or a ``[tag, payload]`` list; in memory, the skeleton ``save()``
makes has tuples where these have lists, which msgpack stores alike and ``unflatten`` takes too)::

    None | bool | int (-2**63 .. 2**64-1) | float | str | bytes    the value itself
    ["d", [[key, value], ...]]  dict             ["od", [[key, value], ...]]  OrderedDict, order kept
    ["l", [node, ...]]          list             ["t", [node, ...]]           tuple
    ["T", i] torch tensor leaf  ["N", i] numpy array leaf  ["n", i] numpy scalar (a 0-d array leaf)
    ["i", "-123..."] int outside the msgpack range
    ["dt", "float32"] torch.dtype                ["dev", "cuda:0"] torch.device

Known losses, by design: a sub-structure shared by two keys is stored twice (identity is not kept), a
``torch.nn.Parameter`` comes back as whatever array the caller passes (a plain tensor), and the
``_metadata`` attribute of a module state_dict is dropped (``load_state_dict`` works without it).

The package: :mod:`~tierckpt.state.walk` reads a state as ``save()`` needs it (:func:`survey`,
:func:`flatten`), :mod:`~tierckpt.state.leaves` holds :class:`Leaf` and the general walk,
:mod:`~tierckpt.state.pieces` finds a DTensor's local piece and where it lies (kept per mesh, placements
and shape), :mod:`~tierckpt.state.skeleton` decodes untrusted skeletons (:func:`unflatten`,
:func:`skeleton_leaf_count`, the limits), :mod:`~tierckpt.state.dtypes` names dtypes (:func:`torch_dtype`,
:func:`numpy_dtype`); each imports only those after it in this list.
"""

from __future__ import annotations

from tierckpt.state.dtypes import numpy_dtype, torch_dtype
from tierckpt.state.leaves import Leaf
from tierckpt.state.skeleton import (
    MAX_SKELETON_DEPTH,
    MAX_SKELETON_NODES,
    format_path,
    skeleton_leaf_count,
    unflatten,
)
from tierckpt.state.walk import Survey, flatten, survey

__all__ = [
    "MAX_SKELETON_DEPTH", "MAX_SKELETON_NODES", "Leaf", "Survey", "flatten", "survey", "unflatten", "skeleton_leaf_count", "format_path",
    "torch_dtype", "numpy_dtype",
]
