"""tierckpt: asynchronous, multi-tier checkpointing for PyTorch training.

``save()`` copies the state to host memory on copy threads and returns; a pipeline on the library's
own thread flushes it down configurable tiers (host RAM, local NVMe, a parallel file system) with a
retention and a flush policy each; ``restore_latest()`` loads the newest version that verifies,
``restore(step)`` one step.

The rest of the error tree (``ClosedError``, ``FormatVersionError``) is in
:mod:`tierckpt.errors`.
"""

from tierckpt._version import __version__  # not in __all__: a module attribute, not an API name
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
