"""The torch writer: the state rebuilt from the skeleton around tensors read one by one, then one
``torch.save``, for ``torch.load(path, weights_only=True)``.

``torch.save`` needs the whole state, so each large tensor lands in a shared mapping of an unlinked
temporary file beside the output, whose pages the kernel can write back and reclaim. Dtypes that
``torch.load(weights_only=True)`` cannot read are refused before anything is written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from tierckpt._buffers import align_up, tensor_bytes
from tierckpt.errors import UnsupportedStateError
from tierckpt.export.reader import _little_endian, _nbytes, _Reader, _Writer
from tierckpt.format import TensorRecord
from tierckpt.format.saved_layout import SavedLayout, global_shape
from tierckpt.state import numpy_dtype, torch_dtype, unflatten

# torch.load(weights_only=True) does not recognise these (torch 2.13): "dtype torch.uint3 is not recognized".
_TORCH_UNLOADABLE = frozenset(f"{u}int{bits}" for u in ("", "u") for bits in range(1, 8))
# Tensors at least this large land in a file-backed mapping for torch.save; smaller ones (biases,
# norms, counters) stay in memory, so a state of many small tensors needs no file or mapping each.
_FILE_BACKED = 1 << 20


class _TorchWriter(_Writer):
    """The state rebuilt from the skeleton around tensors read one by one, then one ``torch.save``."""

    def __init__(self, layout: SavedLayout) -> None:
        self.layout = layout
        self.dtypes = [_torch_dtype(r) for r in layout.records]  # refuses before anything is written
        self.values: list[torch.Tensor] = []
        self._scratch: Path | None = None

    def begin(self, f: BinaryIO, out: Path) -> None:
        self._scratch = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))

    def add(self, f: BinaryIO, record: TensorRecord, reader: _Reader) -> None:
        dtype, nbytes, shape = self.dtypes[record.index], _nbytes(record), global_shape(record)
        if nbytes < _FILE_BACKED:
            value = reader.read(record).value
            if record.kind == "numpy":
                value = torch.from_numpy(_little_endian(value))
            self.values.append(value)
            return
        assert self._scratch is not None
        path = self._scratch / str(record.index)
        path.touch(exist_ok=False)
        try:
            os.truncate(path, align_up(nbytes))
            # Two shared mappings of the file: one page-aligned to read into, and the tensor kept, of
            # exactly its bytes (torch.save writes a storage whole). Unlinked at once: its blocks go
            # when the tensor does, whatever happens.
            staging = torch.from_file(str(path), shared=True, size=align_up(nbytes), dtype=torch.uint8)
            kept = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            path.unlink()
        target = reader.read(record, tensor_bytes(staging))
        if record.kind == "numpy":
            _little_endian(target.staged)
        del target, staging
        self.values.append(kept.view(dtype).view(shape))

    def finish(self, f: BinaryIO) -> None:
        torch.save(unflatten(_numpy_as_tensors(self.layout.skeleton), self.values), f)

    def close(self) -> None:
        self.values.clear()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)  # empty: every file was unlinked at once


def _torch_dtype(record: TensorRecord) -> torch.dtype:
    if record.kind == "torch":
        if record.dtype in _TORCH_UNLOADABLE:
            raise UnsupportedStateError(
                f"{record.key} is torch.{record.dtype}, which torch.load(weights_only=True) cannot read", key=record.key
            )
        return torch_dtype(record.dtype)
    dtype = numpy_dtype(record.dtype)
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("<"))).dtype
    except TypeError:
        raise UnsupportedStateError(f"{record.key} is a numpy {dtype.str} array, which torch has no dtype for", key=record.key) from None


def _numpy_as_tensors(skeleton: Any) -> Any:
    """A copy of ``skeleton`` whose numpy leaves are tensor leaves (the export gives them as tensors)."""
    root = [skeleton]
    stack: list[tuple[list[Any], int]] = [(root, 0)]
    while stack:
        parent, i = stack.pop()
        node = parent[i]
        if type(node) not in (list, tuple):
            continue
        tag, payload = node
        if tag in ("N", "n"):
            parent[i] = ["T", payload]
        elif tag in ("l", "t"):
            items = list(payload)
            parent[i] = [tag, items]
            stack.extend((items, j) for j in range(len(items)))
        elif tag in ("d", "od"):
            pairs = [[key, value] for key, value in payload]
            parent[i] = [tag, pairs]
            stack.extend((pair, 1) for pair in pairs)  # keys hold no leaves
    return root[0]
