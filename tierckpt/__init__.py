"""tierckpt: asynchronous, multi-tier checkpointing for PyTorch training.

``save()`` copies the state to host memory on copy threads and returns; a pipeline on the library's
own thread flushes it down configurable tiers (host RAM, local NVMe, a parallel file system) with a
retention and a flush policy each; ``restore_latest()`` loads the newest version that verifies,
``restore(step)`` one step.

The rest of the error tree (``ClosedError``, ``FormatVersionError``) is in
:mod:`tierckpt.errors`.

The names below are imported at their first use (PEP 562), not with the package: importing any
``tierckpt`` module runs this file first, and ``tierckpt --version`` (:mod:`tierckpt.cli`) should
not wait seconds for torch. ``from tierckpt import Checkpointer`` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tierckpt._version import __version__  # not in __all__: a module attribute, not an API name

if TYPE_CHECKING:
    from tierckpt.checkpointer import Checkpointer, SaveHandle
    from tierckpt.config import Config
    from tierckpt.errors import (
        CapacityError,
        ConfigError,
        CorruptCheckpointError,
        FlushError,
        LayoutError,
        NoCheckpointError,
        RankFailureError,
        RestoreError,
        TierckptError,
        UnsupportedStateError,
    )
    from tierckpt.restore import Restored
    from tierckpt.tiers.base import VersionInfo

__all__ = [
    "CapacityError",
    "Checkpointer",
    "Config",
    "ConfigError",
    "CorruptCheckpointError",
    "FlushError",
    "LayoutError",
    "NoCheckpointError",
    "RankFailureError",
    "RestoreError",
    "Restored",
    "SaveHandle",
    "TierckptError",
    "UnsupportedStateError",
    "VersionInfo",
]

# Where each name of __all__ lives; tests/test_imports.py checks that this and the TYPE_CHECKING
# imports above agree with __all__.
_HOMES = {
    "Checkpointer": "tierckpt.checkpointer",
    "SaveHandle": "tierckpt.checkpointer",
    "Config": "tierckpt.config",
    "CapacityError": "tierckpt.errors",
    "ConfigError": "tierckpt.errors",
    "CorruptCheckpointError": "tierckpt.errors",
    "FlushError": "tierckpt.errors",
    "LayoutError": "tierckpt.errors",
    "NoCheckpointError": "tierckpt.errors",
    "RankFailureError": "tierckpt.errors",
    "RestoreError": "tierckpt.errors",
    "TierckptError": "tierckpt.errors",
    "UnsupportedStateError": "tierckpt.errors",
    "Restored": "tierckpt.restore",
    "VersionInfo": "tierckpt.tiers.base",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tierckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
