"""What the export driver and both writers share: the version read as rank 0 of a consolidating job.

:func:`_layout` checks that a directory is one committed version and that its skeleton matches its
tensor records; :class:`_Reader` reads one record's global tensor at a time, every chunk verified;
:class:`_Writer` is the interface each format implements (its call order in its docstring).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from tierckpt.errors import CorruptCheckpointError, NoCheckpointError
from tierckpt.format import MANIFEST_FILE, TensorRecord, parse_version_dirname
from tierckpt.format.layout import where
from tierckpt.format.saved_layout import SavedLayout, global_shape
from tierckpt.restore.landing import Target
from tierckpt.restore.plan import plan as plan_load
from tierckpt.tiers.stored.layout import filesystem_layout
from tierckpt.state import Leaf, numpy_dtype, skeleton_leaf_count, torch_dtype


def _object_layout(url: str, endpoint: str | None) -> SavedLayout:
    """The saved layout of the version at ``url`` (``s3://bucket/prefix/step-...``) of an object tier."""
    from tierckpt.errors import ConfigError
    from tierckpt.tiers.object.read import list_versions, open_bucket

    try:
        bucket = open_bucket(url, endpoint)
    except ConfigError as exc:
        raise NoCheckpointError(f"{url}: {exc}") from None
    try:
        found = list_versions(bucket)
    except OSError as exc:
        raise NoCheckpointError(f"{url}: cannot be listed ({exc})") from None
    if parse_version_dirname(bucket.prefix.rpartition("/")[2]) is None or len(found) != 1:
        if found:
            raise NoCheckpointError(f"{url} is a tier prefix; name one of its versions, e.g. {bucket.url_of(found[-1][1].container)}")
        raise NoCheckpointError(f"{url}: not a committed version (no {MANIFEST_FILE})")
    (_, files), = found
    return _checked(filesystem_layout(bucket.url.rpartition("/")[0], files, 0, direct=False))


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
    return _checked(filesystem_layout(str(version.parent), version, 0, direct=False))


def _checked(layout: SavedLayout) -> SavedLayout:
    """``layout``, its skeleton checked against its tensor records."""
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
