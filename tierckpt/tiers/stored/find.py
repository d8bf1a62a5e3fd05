"""What a directory is, from its names alone: a tier's directory, or a folder holding tier directories.

For the command line (:mod:`tierckpt.cli`), which is handed a path and has no config: ``./checkpoints``
may be a tier's directory or hold ``nvme/`` and ``pfs/``. A tier's directory is known by the names
only a tier writes there (:mod:`tierckpt.tiers.stored.sweep`, :mod:`tierckpt.tiers.memory.shm`): a version
(``step-<12 digits>``), a version being written, deleted or replaced (``.tmp-``, ``.trash-``,
``.replaced-``), a follower's sign (``.member-``), a memory tier's pool (``pool.msgpack``). An empty
directory is a tier's with no version yet. Nothing is opened but directories, to list them.
"""

from __future__ import annotations

import os
from pathlib import Path

from tierckpt.format import parse_version_dirname
from tierckpt.tiers.stored.sweep import MEMBER, REPLACED
from tierckpt.tiers.memory.shm import POOL_INFO

__all__ = ["holds_a_tier", "tier_dirs"]

_TIER_PREFIXES = (".tmp-", ".trash-", REPLACED, MEMBER)


def _entries(directory: Path) -> list[str] | None:
    try:
        return os.listdir(directory)
    except OSError:
        return None


def _is_tier_entry(name: str) -> bool:
    return parse_version_dirname(name) is not None or name == POOL_INFO or name.startswith(_TIER_PREFIXES)


def holds_a_tier(directory: Path) -> bool:
    """Whether ``directory`` is a tier's directory by what it holds (an empty one is: no version yet);
    False when it cannot be listed."""
    entries = _entries(directory)
    return entries is not None and (not entries or any(_is_tier_entry(n) for n in entries))


def tier_dirs(directory: Path) -> list[str]:
    """The names of the tier directories in ``directory``, sorted: each one holding what only a tier
    writes and, beside one such, each empty one (a tier no save has reached yet: ``pfs/`` before its
    first flush). [] when there is none: ``directory`` is no folder of tiers.

    Example: ``tier_dirs(Path("checkpoints"))`` is ``["nvme", "pfs"]`` after examples/train_demo.py.
    """
    found, empty = [], []
    for name in sorted(_entries(directory) or []):
        path = directory / name
        if _is_tier_entry(name) or not path.is_dir():
            continue
        entries = _entries(path)
        if entries == []:
            empty.append(name)
        elif entries and any(_is_tier_entry(n) for n in entries):
            found.append(name)
    return sorted(found + empty) if found else []
