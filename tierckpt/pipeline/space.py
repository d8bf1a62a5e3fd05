"""What a tier whose file system is full (ENOSPC) needs and has, for the flush error and its warning
(:class:`~tierckpt.errors.SpaceNeeded`): the size of a version, what its ``keep`` holds at the peak
(the kept versions and the one being written: retention runs only after a commit), and the free space.
"""

from __future__ import annotations

import os
import shutil
from typing import Sequence

from tierckpt.config import KeepPolicy
from tierckpt.errors import SpaceNeeded
from tierckpt.format.records import TensorRecord
from tierckpt.tiers.base import VersionInfo
from tierckpt.units import format_size

__all__ = ["space_needed"]


def space_needed(newest: VersionInfo | None, keep: KeepPolicy, path: str, written: Sequence[TensorRecord]) -> SpaceNeeded | None:
    """What the tier at ``path`` needs and has (blocking: ``statvfs`` of a network file system can
    block); None if its free space cannot be measured.

    A version's size is what ``newest`` (the newest version the tier holds) takes on the disk, else
    what ``written`` (the records of the version that failed) add up to as read.
    """
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    version = None if newest is None else (_blocks_in_use(newest.path) if newest.path else newest.nbytes)
    estimated = version is None and bool(written)
    if estimated:
        version = sum(r.stored for r in written)
    kept, open_ended = _kept(keep, version)
    return SpaceNeeded(path, free, version, estimated, _keep_words(keep), kept, open_ended)


def _blocks_in_use(directory: str) -> int | None:
    """Bytes the files under ``directory`` take on their file system (allocated blocks); None: unreadable."""
    try:
        return sum(os.lstat(os.path.join(top, name)).st_blocks * 512 for top, _, names in os.walk(directory) for name in names)
    except OSError:
        return None


def _kept(keep: KeepPolicy, version_bytes: int | None) -> tuple[int | None, bool]:
    """How many versions ``keep`` holds (None: every one), and whether its other rules may hold more."""
    if keep.keeps_all:
        return None, False
    kept = keep.last or 1  # the newest always stays
    open_ended = keep.every_steps is not None or keep.within_s is not None
    if keep.max_bytes is not None:
        if version_bytes:
            kept = max(kept, keep.max_bytes // version_bytes)
        else:
            open_ended = True
    return kept, open_ended


def _keep_words(keep: KeepPolicy) -> str:
    """``keep``'s rules as YAML writes them: ``{last: 2, every_steps: 100}``; "" when none is set."""
    rules = {
        "last": keep.last,
        "every_steps": keep.every_steps,
        "within": None if keep.within_s is None else f"{keep.within_s:g}s",
        "max_bytes": None if keep.max_bytes is None else format_size(keep.max_bytes),
    }
    words = [f"{name}: {value}" for name, value in rules.items() if value is not None]
    return "{" + ", ".join(words) + "}" if words else ""
