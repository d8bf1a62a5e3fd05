"""Pointer files: a trainer's checkpoint path standing for one tierckpt step.

Trainers think in checkpoint files: Lightning's ``ModelCheckpoint`` keeps its top-k by path, finds
``last.ckpt`` by listing its directory, and resumes from ``ckpt_path=``. The state itself lives in
the tiers; at the trainer's path goes a small JSON document naming the step, so every path-based
feature keeps working and loading a path is ``restore(step)``. JSON, not pickle: a pointer is read
from a path the user passes, and nothing read on the restore path may run code.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

from tierckpt.errors import CorruptCheckpointError, NoCheckpointError
from tierckpt.storage.lock import process_alive
from tierckpt.storage.posix import replace_durably

__all__ = ["FORMAT", "aside_name", "read_pointer", "remove_leftovers", "restore_named", "write_pointer"]

FORMAT = "tierckpt-pointer"
_MAX_BYTES = 64 << 10  # a pointer is a few dozen bytes; anything large is not one
_TMP_PREFIX = ".tierckpt-pointer-"
# The host in a temporary file's name: on a shared file system only this host's leftovers are ours to judge.
_HOST = socket.gethostname().replace("-", "_")


def write_pointer(path: str | os.PathLike[str], step: int, tier: str) -> None:
    """Atomically (a temporary file, fsync, rename, fsync of the directory) make ``path`` name
    ``step``, which is durable on ``tier``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"format": FORMAT, "version": 1, "step": step, "tier": tier}).encode() + b"\n"
    # Not named after the pointer: a temporary file a crash left behind must not look like one
    # (Lightning finds last.ckpt by any name containing "last").
    replace_durably(path, body, path.with_name(aside_name(_TMP_PREFIX, f"{threading.get_ident()}.tmp")))
    remove_leftovers(path.parent, _TMP_PREFIX)


def aside_name(prefix: str, tail: str) -> str:
    """The name of something written aside before a rename: ``prefix``, this host, this process,
    ``tail``. Hidden, and not shaped like what it becomes, so a trainer listing its directory never
    takes a crash's leftover for a checkpoint."""
    return f"{prefix}{_HOST}-{os.getpid()}-{tail}"


def remove_leftovers(directory: str | os.PathLike[str], prefix: str) -> None:
    """Remove what writers on this host named by ``aside_name(prefix, ...)`` and then died before
    renaming it (a SIGKILLed job), files or directories, so restarts do not pile them up. Another
    host's are left: whether their writer lives cannot be told from here."""
    for leftover in Path(directory).glob(f"{prefix}{_HOST}-*"):
        pid = leftover.name[len(prefix) + len(_HOST) + 1 :].split("-", 1)[0]
        if not pid.isdigit() or process_alive(int(pid)):
            continue
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def read_pointer(path: str | os.PathLike[str]) -> int:
    """The step ``path`` names.

    Raises:
        NoCheckpointError: there is no file at ``path``.
        CorruptCheckpointError: the file is not a pointer (a ``torch.save`` checkpoint, say), or a damaged one.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        raise NoCheckpointError(f"{path}: no such checkpoint") from None
    except IsADirectoryError:
        raise NoCheckpointError(f"{path}: a directory, not a checkpoint written through tierckpt") from None
    try:
        doc = json.loads(raw) if len(raw) <= _MAX_BYTES else None
    except ValueError:
        doc = None
    step = doc.get("step") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorruptCheckpointError(
            f"{path}: not a checkpoint written through tierckpt (its pointer files are small JSON documents "
            f"naming a step; a torch.save checkpoint is loaded with the trainer's default checkpoint I/O)"
        )
    return step


def restore_named(ckpt: Any, path: str | os.PathLike[str], step: int, template: Any = None, *, instead: str, **options: Any) -> Any:
    """``ckpt.restore_sync(step, template, **options)`` for the trainer's checkpoint at ``path``, which names
    ``step``. When the step cannot be restored (every copy damaged or gone, on any rank), the error
    names ``path``, says which steps the tiers still hold, and how to resume from one (``instead``):
    the trainer asked for this step, and quietly loading another would not match its own state.

    Raises:
        CorruptCheckpointError, NoCheckpointError: as ``restore``, the message extended so.
    """
    try:
        return ckpt.restore_sync(step, template, **options)
    except (CorruptCheckpointError, NoCheckpointError) as exc:
        others = sorted({v.step for v in ckpt.versions()} - {step})
        held = f"the tiers also hold step(s) {', '.join(map(str, others[-5:]))}" if others else "the tiers hold no other step"
        message = f"{os.fspath(path)} names step {step}, which cannot be restored: {exc}. {held}: {instead}"
        raise type(exc)(message, tier=exc.tier, step=step, key=exc.key) from exc
