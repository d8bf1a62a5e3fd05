"""The export driver: :func:`export` checks its arguments and the version, then streams the records
through one writer into ``<out>.tmp-<random>``, fsyncs it and renames it into place.

The formats' writers are in :mod:`tierckpt.export.safetensors_writer` and
:mod:`tierckpt.export.torch_writer`; reading the version is :mod:`tierckpt.export.reader`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from tierckpt.export.reader import _object_layout, _layout, _nbytes, _Reader, _Writer
from tierckpt.export.safetensors_writer import _SafetensorsWriter, write_tensors
from tierckpt.export.torch_writer import _TorchWriter
from tierckpt.export.zero import is_deepspeed, zero_fp32_weights
from tierckpt.format.saved_layout import SavedLayout
from tierckpt.storage.posix import fsync_dir

__all__ = ["FORMATS", "ExportProgress", "ExportSummary", "OutputExistsError", "export", "format_for"]

FORMATS = ("safetensors", "torch")


class OutputExistsError(FileExistsError):
    """``out`` exists and ``force`` is false. Its message names the Python argument; ``path`` lets
    the command line name its own flag (``--force``) instead."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} exists; force=True replaces it")
        self.path = path


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
    endpoint: str | None = None,
) -> ExportSummary:
    """Write the consolidated state of the version in ``version_dir`` to the file ``out`` (blocking).

    Args:
        version_dir: a ``step-<12 digits>`` directory of a filesystem tier (or a copy of one), or the
            URL of a version of an object tier (``s3://bucket/prefix/step-...``).
        out: the file to write; replaced only with ``force``.
        to: ``"safetensors"`` or ``"torch"`` (see :mod:`tierckpt.export`); None: :func:`format_for`.
        threads: threads reading and verifying chunks.
        progress: called after each tensor is written.
        endpoint: the S3-compatible server of an ``s3://`` URL (None: AWS).

    Raises:
        NoCheckpointError: ``version_dir`` is missing or not a version directory.
        FileExistsError: ``out`` is a directory; :class:`OutputExistsError` (a FileExistsError): ``out``
            exists and ``force`` is false.
        FileNotFoundError: the directory of ``out`` does not exist.
        UnsupportedStateError: the chosen format cannot hold a value (its dtype, or two values that
            get the same name); raised before anything is written.
        CorruptCheckpointError: the version is damaged (a manifest, a chunk's checksum); nothing is
            left at ``out``.
        OSError: the output could not be written.

    Example::

        export("ckpt/disk/step-000000001000", "model.safetensors")
    """
    url = str(version_dir) if str(version_dir).startswith("s3://") else None
    version, out = Path(version_dir), Path(out)
    to = format_for(out) if to is None else to
    if to not in FORMATS:
        raise ValueError(f"to={to!r}: the formats are {', '.join(FORMATS)}")
    if threads < 1:
        raise ValueError(f"threads={threads}: at least 1")
    layout = _object_layout(url, endpoint) if url is not None else _layout(version)
    if out.is_dir():
        raise FileExistsError(f"{out} is a directory; name the file to write")
    if os.path.lexists(out) and not force:
        raise OutputExistsError(out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent}: no such directory to write {out.name} in")
    if is_deepspeed(layout.metadata):
        return _export_zero(version, url, layout, out, to, progress)
    writer: _Writer = _SafetensorsWriter(layout) if to == "safetensors" else _TorchWriter(layout)
    total = sum(_nbytes(r) for r in layout.records)

    def write(f: BinaryIO) -> None:
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-export") as pool:
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

    _write_atomically(out, write)
    return ExportSummary(layout.step, len(layout.records), total, out, to)


def _export_zero(version: Path, url: str | None, layout: SavedLayout, out: Path, to: str, progress: Callable[[ExportProgress], None] | None) -> ExportSummary:
    """A DeepSpeed ZeRO version: its consolidated fp32 weights by parameter name (:mod:`tierckpt.export.zero`)."""
    if url is not None:
        raise ValueError(f"{url}: a DeepSpeed version is exported from a filesystem tier (its fp32 partitions are put together from every rank's part)")
    weights = zero_fp32_weights(version, layout.metadata)
    total = sum(t.numel() * t.element_size() for t in weights.values())

    def write(f: BinaryIO) -> None:
        if to == "safetensors":
            write_tensors(f, weights, {"format": "pt", "tierckpt.step": str(layout.step), "tierckpt.deepspeed": "fp32 weights"})
        else:
            torch.save(weights, f)

    _write_atomically(out, write)
    if progress is not None:
        progress(ExportProgress(layout.step, len(weights), len(weights), total, total))
    return ExportSummary(layout.step, len(weights), total, out, to)


def _write_atomically(out: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write`` into ``<out>.tmp-<random>``, fsync it, rename it to ``out``; nothing is left at ``out`` if it fails."""
    tmp = out.with_name(f"{out.name}.tmp-{secrets.token_hex(4)}")
    # os.open with 0o666 lets the umask decide the mode, as for any new file (mkstemp would give 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # best effort: not every file system can sync a directory
        fsync_dir(out.parent)
