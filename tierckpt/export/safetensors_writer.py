"""The safetensors writer: the header first (every shape and dtype is known from the manifests), then
each tensor's bytes as it is read, so memory holds one tensor, not the state.

Tensors are named by dotted key path; the state's JSON-able non-tensor values go in ``__metadata__``
(``"tierckpt.extra"``). Dtypes safetensors has no name for, and two values that would get the same
name, are refused before anything is written.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import torch

from tierckpt.format.lineage import user_metadata
from tierckpt.errors import UnsupportedStateError
from tierckpt.export.reader import _little_endian, _nbytes, _Reader, _Writer
from tierckpt.format import TensorRecord
from tierckpt.format.saved_layout import SavedLayout, global_shape
from tierckpt.state import format_path, numpy_dtype

# Torch dtype name -> safetensors dtype, as safetensors 0.8 reads them back. complex128, complex32,
# the bits types and the sub-byte ints have none.
_SAFETENSORS_TORCH = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "complex64": "C64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4",
}
# Little-endian numpy dtype string -> safetensors dtype.
_SAFETENSORS_NUMPY = {
    "<f8": "F64", "<f4": "F32", "<f2": "F16", "<i8": "I64", "<i4": "I32", "<i2": "I16", "|i1": "I8", "|u1": "U8",
    "|b1": "BOOL", "<u2": "U16", "<u4": "U32", "<u8": "U64", "<c8": "C64",
}


class _SafetensorsWriter(_Writer):
    """The header first, then each tensor's bytes as it is read, in header order."""

    def __init__(self, layout: SavedLayout) -> None:
        self.layout = layout
        self.dtypes = [_safetensors_dtype(r) for r in layout.records]  # refuses before anything is written
        self.names, self.extra = _names(layout)

    def begin(self, f: BinaryIO, out: Path) -> None:
        entries = []
        for r, dtype in zip(self.layout.records, self.dtypes):
            shape = list(global_shape(r))
            if dtype == "F4":  # safetensors counts 4-bit values; torch's float4_e2m1fn_x2 holds two
                shape[-1] *= 2
            entries.append((self.names[r.index], dtype, shape, _nbytes(r)))
        _write_header(f, self._metadata(), entries)

    def _metadata(self) -> dict[str, str]:
        meta = {k: v for k, v in user_metadata(self.layout.metadata).items() if type(k) is str and _json(v) is not None}
        return {
            "format": "pt",
            "tierckpt.step": str(self.layout.step),
            "tierckpt.metadata": json.dumps(meta, allow_nan=False),
            "tierckpt.extra": json.dumps(self.extra, allow_nan=False),
        }

    def add(self, f: BinaryIO, record: TensorRecord, reader: _Reader) -> None:
        target = reader.read(record)
        if record.kind == "numpy":
            _little_endian(target.value)  # in place: target.out is its bytes
        f.write(target.out)


def write_tensors(f: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """A safetensors file of whole tensors held in memory, by name, in order (an export that puts
    tensors together rather than streaming stored ones: :mod:`tierckpt.export.zero`).

    Raises:
        UnsupportedStateError: a dtype safetensors has no name for; nothing is written.
    """
    entries = []
    for name, tensor in tensors.items():
        dtype = _SAFETENSORS_TORCH.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None or dtype == "F4":
            raise UnsupportedStateError(f"{name} is {tensor.dtype}, which this export cannot write to safetensors", key=name)
        entries.append((name, dtype, list(tensor.shape), tensor.numel() * tensor.element_size()))
    _write_header(f, dict(metadata), entries)
    for tensor in tensors.values():
        # safetensors is little-endian: like the streamed writer, this takes the host to be (every platform torch ships for is)
        f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _write_header(f: BinaryIO, metadata: dict[str, str], entries: list[tuple[str, str, list[int], int]]) -> None:
    """safetensors' header: its length, then the JSON of ``metadata`` and each ``(name, dtype, shape,
    nbytes)``, whose bytes follow in that order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(text)) + text)


def _safetensors_dtype(record: TensorRecord) -> str:
    if record.kind == "torch":
        name = _SAFETENSORS_TORCH.get(record.dtype)
        if name == "F4" and not global_shape(record):
            name = None  # a 0-d pair of 4-bit values has no safetensors shape
        what = f"torch.{record.dtype}"
    else:
        dtype = numpy_dtype(record.dtype)
        name = _SAFETENSORS_NUMPY.get(dtype.newbyteorder("<").str)
        what = f"numpy {dtype.str}"
    if name is None:
        raise UnsupportedStateError(
            f"{record.key} is {what}{list(global_shape(record))}, which safetensors cannot hold; --to torch (to='torch') can",
            key=record.key,
        )
    return name


def _names(layout: SavedLayout) -> tuple[dict[int, str], dict[str, Any]]:
    """Each leaf's dotted name by index, and the JSON-able non-tensor values by dotted name.

    Raises UnsupportedStateError when two values get the same name (``{"a.b": x, "a": {"b": y}}``).
    """
    names: dict[int, str] = {}
    extra: dict[str, Any] = {}
    owners: dict[str, tuple[Any, ...]] = {}
    stack: list[tuple[Any, tuple[Any, ...]]] = [(layout.skeleton, ())]
    while stack:
        node, path = stack.pop()
        tag, payload = node if type(node) in (list, tuple) else (None, node)
        if tag in ("d", "od"):
            stack.extend((value, (*path, _key(key))) for key, value in reversed(payload))
            continue
        if tag in ("l", "t"):
            stack.extend((payload[i], (*path, i)) for i in range(len(payload) - 1, -1, -1))
            continue
        name = ".".join(str(k) for k in path)
        if name in owners:
            raise UnsupportedStateError(
                f"{format_path(owners[name])} and {format_path(path)} would both be named {name!r} in safetensors; "
                "--to torch (to='torch') keeps the structure",
                key=format_path(path),
            )
        owners[name] = path
        if tag in ("T", "N", "n"):
            names[payload] = name
        elif tag == "i":
            extra[name] = int(payload)
        elif tag is None and _json(payload) is not None:
            extra[name] = payload
    return names, extra


def _key(node: Any) -> Any:
    """A dict key of the skeleton as a value (a tuple key as a tuple, a dtype or device by its name)."""
    if type(node) not in (list, tuple):
        return node
    tag, payload = node
    if tag == "t":
        return tuple(_key(k) for k in payload)
    return int(payload) if tag == "i" else payload


def _json(value: Any) -> str | None:
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return None
