"""Dtype names in a checkpoint: the torch and numpy dtypes whose bytes are their whole value, by name.

A :class:`~tierckpt.state.Leaf` records its dtype as a name (``"bfloat16"``, ``"<f4"``); manifests on
disk carry these names, so reading one back (:func:`torch_dtype`, :func:`numpy_dtype`) is a lookup that
trusts nothing: no ``getattr(torch, name)``, no ``np.dtype`` of free text. Kept apart from flattening
and decoding, which both use the tables, as does every module that lays out or reads tensor bytes.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from tierckpt.errors import CorruptCheckpointError

__all__ = ["torch_dtype", "numpy_dtype"]

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
# The msgpack scalars: a skeleton's plain values, and the values _short shows as themselves.
_SCALAR_NODES = (type(None), bool, int, float, str, bytes)


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


def _short(value: Any) -> str:
    """A bounded repr of an untrusted value for error messages."""
    try:
        text = repr(value) if type(value) in _SCALAR_NODES else f"<{type(value).__name__}>"
    except ValueError:  # an int past sys.get_int_max_str_digits()
        text = "<huge int>"
    return text if len(text) <= 40 else text[:37] + "..."
