"""Export one stored version's consolidated state as a file tools without tierckpt read.

A version saved by one process or by many ranks (with DTensor shards) is written as the state a
consolidating restore returns: every DTensor whole, in its global shape; every other value as saved
rank 0 holds it. Two formats:

- ``safetensors``: the tensors by dotted key path (``{"model": {"layer.0.w": t}}`` gives
  ``"model.layer.0.w"``, list items by index: ``"optim.state.0.exp_avg"``). ``__metadata__`` holds
  ``"format": "pt"``, ``"tierckpt.step"``, the version's metadata as JSON (``"tierckpt.metadata"``)
  and the state's non-tensor values that are JSON (``"tierckpt.extra"``: ``{dotted name: value}``;
  bytes, NaN, dtypes and devices are left out).
- ``torch``: the whole state as saved (dicts, lists, tuples, plain CPU tensors, non-tensor values),
  for ``torch.load(path, weights_only=True)``; numpy arrays become tensors.

Memory is bounded by the largest tensor, not the state: one tensor at a time is read (every chunk
verified), written and dropped. The safetensors file is written here, header first (every shape and
dtype is known from the manifests), as ``safetensors.torch.save_file`` would need every tensor in
memory at once. ``torch.save`` does need the whole state, so each large tensor lands in a shared
mapping of an unlinked temporary file beside the output: the kernel can write its pages back and
reclaim them, and the save streams them from the page cache (the disk then briefly holds the state
twice).

Nothing is left behind on failure: the output is written to ``<out>.tmp-<random>`` and renamed into
place once complete and fsynced.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import secrets
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import torch

from tierckpt._buffers import align_up, tensor_bytes
from tierckpt.errors import CorruptCheckpointError, NoCheckpointError, UnsupportedStateError
from tierckpt.format import MANIFEST_FILE, TensorRecord, parse_version_dirname
from tierckpt.format.layout import SavedLayout, global_shape
from tierckpt.format.manifest import where
from tierckpt.restore.landing import Target
from tierckpt.restore.plan import plan as plan_load
from tierckpt.state import Leaf, format_path, numpy_dtype, skeleton_leaf_count, torch_dtype, unflatten
from tierckpt.tiers.fsread import filesystem_layout

__all__ = ["FORMATS", "ExportProgress", "ExportSummary", "export", "format_for"]

FORMATS = ("safetensors", "torch")

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
# torch.load(weights_only=True) does not recognise these (torch 2.13): "dtype torch.uint3 is not recognized".
_TORCH_UNLOADABLE = frozenset(f"{u}int{bits}" for u in ("", "u") for bits in range(1, 8))
# Tensors at least this large land in a file-backed mapping for torch.save; smaller ones (biases,
# norms, counters) stay in memory, so a state of many small tensors needs no file or mapping each.
_FILE_BACKED = 1 << 20


@dataclass(frozen=True)
class ExportProgress:
    """How far an export is: passed to ``progress`` after each tensor."""

    step: int
    tensors: int
    total_tensors: int
    nbytes: int
    total_nbytes: int


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export` wrote: ``tensors`` tensors of ``nbytes`` bytes in all, from ``step``, to ``path``."""

    step: int
    tensors: int
    nbytes: int
    path: Path
    to: str


def format_for(out: Path) -> str:
    """The format a file name asks for: ``torch`` for ``.pt``/``.pth``, else ``safetensors``."""
    return "torch" if out.suffix.lower() in (".pt", ".pth") else "safetensors"


def export(
    version_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    to: str | None = None,
    force: bool = False,
    threads: int = 2,
    progress: Callable[[ExportProgress], None] | None = None,
) -> ExportSummary:
    """Write the consolidated state of the version in ``version_dir`` to the file ``out`` (blocking).

    Args:
        version_dir: a ``step-<12 digits>`` directory of a filesystem tier (or a copy of one).
        out: the file to write; replaced only with ``force``.
        to: ``"safetensors"`` or ``"torch"`` (see the module docstring); None: :func:`format_for`.
        threads: threads reading and verifying chunks.
        progress: called after each tensor is written.

    Raises:
        NoCheckpointError: ``version_dir`` is missing or not a version directory.
        FileExistsError: ``out`` exists and ``force`` is false (or it is a directory).
        FileNotFoundError: the directory of ``out`` does not exist.
        UnsupportedStateError: the chosen format cannot hold a value (its dtype, or two values that
            get the same name); raised before anything is written.
        CorruptCheckpointError: the version is damaged (a manifest, a chunk's checksum); nothing is
            left at ``out``.
        OSError: the output could not be written.

    Example::

        export("ckpt/disk/step-000000001000", "model.safetensors")
    """
    version, out = Path(version_dir), Path(out)
    to = format_for(out) if to is None else to
    if to not in FORMATS:
        raise ValueError(f"to={to!r}: the formats are {', '.join(FORMATS)}")
    if threads < 1:
        raise ValueError(f"threads={threads}: at least 1")
    layout = _layout(version)
    if out.is_dir():
        raise FileExistsError(f"{out} is a directory; name the file to write")
    if os.path.lexists(out) and not force:
        raise FileExistsError(f"{out} exists; --force (force=True) replaces it")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent}: no such directory to write {out.name} in")
    writer: _Writer = _SafetensorsWriter(layout) if to == "safetensors" else _TorchWriter(layout)
    total = sum(_nbytes(r) for r in layout.records)
    tmp = out.with_name(f"{out.name}.tmp-{secrets.token_hex(4)}")
    # os.open with 0o666 lets the umask decide the mode, as for any new file (mkstemp would give 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f, concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-export") as pool:
            reader = _Reader(layout, pool, threads)
            try:
                writer.begin(f, out)
                done = 0
                for i, record in enumerate(layout.records):
                    writer.add(f, record, reader)
                    done += _nbytes(record)
                    if progress is not None:
                        progress(ExportProgress(layout.step, i + 1, len(layout.records), done, total))
                writer.finish(f)
            finally:
                writer.close()
                reader.close()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(out.parent)
    return ExportSummary(layout.step, len(layout.records), total, out, to)


def _layout(version: Path) -> SavedLayout:
    """The saved layout of ``version``, seen as rank 0 of a job consolidating it."""
    if not version.exists():
        raise NoCheckpointError(f"{version}: no such directory")
    if not version.is_dir():
        raise NoCheckpointError(f"{version}: not a directory")
    version = version.resolve()  # a link the user named (latest -> step-...) is their choice
    if not (version / MANIFEST_FILE).exists():
        steps = sorted(n for n in os.listdir(version) if parse_version_dirname(n) is not None)
        if steps:
            raise NoCheckpointError(f"{version} is a tier directory; name one of its versions, e.g. {version / steps[-1]}")
        raise NoCheckpointError(f"{version}: not a version directory (no {MANIFEST_FILE}: not one, or never committed)")
    # Messages then name the tier directory: "step 7 on tier '/ckpt/disk': data-r00000.bin: ...".
    layout = filesystem_layout(str(version.parent), version, 0, direct=False)
    try:
        leaves = skeleton_leaf_count(layout.skeleton)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"{where(layout.tier, layout.step)}: {MANIFEST_FILE}: {exc}", tier=layout.tier, step=layout.step, key=exc.key
        ) from None
    if leaves != len(layout.records) or any(r.index != i for i, r in enumerate(layout.records)):
        raise CorruptCheckpointError(
            f"{where(layout.tier, layout.step)}: {MANIFEST_FILE}: the skeleton does not match the {len(layout.records)} tensor records",
            tier=layout.tier,
            step=layout.step,
        )
    return layout


def _nbytes(record: TensorRecord) -> int:
    """Bytes of the record's whole (global) tensor."""
    dtype = torch_dtype(record.dtype) if record.kind == "torch" else numpy_dtype(record.dtype)
    return math.prod(global_shape(record)) * dtype.itemsize


def _little_endian(array: np.ndarray) -> np.ndarray:
    """``array`` in little-endian order, swapped in place: both formats store little-endian bytes."""
    if array.dtype.byteorder != ">":
        return array
    array.byteswap(inplace=True)
    return array.view(array.dtype.newbyteorder("<"))


class _Reader:
    """Reads one record's global tensor at a time from every piece of the version (one open source)."""

    def __init__(self, layout: SavedLayout, pool: concurrent.futures.Executor, threads: int) -> None:
        self.layout, self._pool, self._threads = layout, pool, threads
        pieces = {id(p.record): p.record for r in layout.records for p in layout.pieces(r)}
        self._source = layout.open(list(pieces.values()))

    def read(self, record: TensorRecord, into: memoryview | None = None) -> Target:
        """The record's global tensor, verified: in a new array, or staged in ``into`` (page-aligned,
        at least ``align_up`` of its bytes), whose bytes are then the tensor's."""
        templates: dict[str, Leaf] = {}
        if into is not None:
            shape = global_shape(record)
            templates[record.key] = Leaf(record.index, (), record.kind, None, record.dtype, shape, _nbytes(record))
        plan = plan_load(self.layout, templates, into, records=[record])
        (target,) = plan.run(self._source, self._pool, self._threads)
        return target

    def close(self) -> None:
        self._source.close()


class _Writer:
    """One format. Call order: ``begin(f, out)``; ``add(f, record, reader)`` for each of the layout's
    records in order; ``finish(f)``; and ``close()`` always, last, even after an error. Refusals
    (what the format cannot hold) are raised by the constructor, before anything is written."""

    def begin(self, f: BinaryIO, out: Path) -> None:
        pass

    def add(self, f: BinaryIO, record: TensorRecord, reader: _Reader) -> None:
        raise NotImplementedError

    def finish(self, f: BinaryIO) -> None:
        pass

    def close(self) -> None:
        pass


class _SafetensorsWriter(_Writer):
    """The header first, then each tensor's bytes as it is read, in header order."""

    def __init__(self, layout: SavedLayout) -> None:
        self.layout = layout
        self.dtypes = [_safetensors_dtype(r) for r in layout.records]  # refuses before anything is written
        self.names, self.extra = _names(layout)

    def begin(self, f: BinaryIO, out: Path) -> None:
        header: dict[str, Any] = {"__metadata__": self._metadata()}
        offset = 0
        for r, dtype in zip(self.layout.records, self.dtypes):
            shape = list(global_shape(r))
            if dtype == "F4":  # safetensors counts 4-bit values; torch's float4_e2m1fn_x2 holds two
                shape[-1] *= 2
            header[self.names[r.index]] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + _nbytes(r)]}
            offset += _nbytes(r)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        f.write(struct.pack("<Q", len(text)) + text)

    def _metadata(self) -> dict[str, str]:
        meta = {k: v for k, v in self.layout.metadata.items() if type(k) is str and _json(v) is not None}
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
        tag, payload = node if type(node) is list else (None, node)
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
    if type(node) is not list:
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
        if type(node) is not list:
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


def _fsync_dir(path: Path) -> None:
    """Make the rename durable (best effort: not every file system can sync a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
