"""Every error tierckpt raises, in one tree.

::

    TierckptError
    ├── ConfigError(ValueError)             a bad setting: names the key, the value, what is allowed
    ├── CapacityError(ValueError)           a state that does not fit a host slot: names the setting to raise
    ├── UnsupportedStateError(TypeError)    a value in the state that cannot be stored safely: names its key path
    ├── FlushError(OSError)                 a background flush or capture failed: names the tier and the step
    ├── CorruptCheckpointError(ValueError)  a manifest or a checksum does not verify: names tier, step and key
    │   └── FormatVersionError              a checkpoint written in a format this version cannot read
    ├── RestoreError(ValueError)            a checkpoint does not fit the template it is restored into
    ├── NoCheckpointError(FileNotFoundError) nothing to restore where something was required
    └── ClosedError(RuntimeError)           the Checkpointer was used after close()

Errors carry ``tier``, ``step`` and ``key`` attributes where they apply (``None`` otherwise). A background
failure is re-raised at the next call that can report it (``save``, ``wait``, ``close``), with its own
type, chained to the original exception.
"""

from __future__ import annotations

__all__ = [
    "TierckptError",
    "ConfigError",
    "CapacityError",
    "UnsupportedStateError",
    "FlushError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "RestoreError",
    "NoCheckpointError",
    "ClosedError",
]


class TierckptError(Exception):
    """Base of every tierckpt error; carries ``tier``, ``step`` and ``key`` where they apply."""

    def __init__(
        self,
        message: str,
        *,
        tier: str | None = None,
        step: int | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(message)
        self.tier = tier
        self.step = step
        self.key = key


class ConfigError(TierckptError, ValueError):
    """A configuration value is missing, unknown or out of range."""


class CapacityError(TierckptError, ValueError):
    """A state does not fit in one host slot (``host.capacity / host.snapshots``)."""


class UnsupportedStateError(TierckptError, TypeError):
    """A value in the state cannot be stored without pickle (its key path is in ``key``)."""


class FlushError(TierckptError, OSError):
    """Capturing a snapshot or writing a version to a tier failed in the background."""


class CorruptCheckpointError(TierckptError, ValueError):
    """A stored version fails verification: unreadable manifest, missing file, checksum mismatch."""


class FormatVersionError(CorruptCheckpointError):
    """A stored version uses a format name or version this release cannot read."""


class RestoreError(TierckptError, ValueError):
    """A stored version cannot be loaded into the given template (shape, dtype or structure)."""


class NoCheckpointError(TierckptError, FileNotFoundError):
    """No committed version exists where one was required."""


class ClosedError(TierckptError, RuntimeError):
    """The Checkpointer was used after ``close()``."""
