"""Every error tierckpt raises, in one tree.

::

    TierckptError
    ├── ConfigError(ValueError)             a bad setting: names the key, the value, what is allowed
    ├── CapacityError(ValueError)           a state that does not fit a host slot: names the setting to raise
    ├── UnsupportedStateError(TypeError)    a value in the state that cannot be stored safely: names its key path
    ├── FlushError(OSError)                 a background flush or capture failed: names the tier, the step,
    │                                       and for an I/O error its errno and path (a full disk: the sizes)
    ├── CorruptCheckpointError(ValueError)  a manifest or a checksum does not verify: names tier, step and key
    │   └── FormatVersionError              a checkpoint written in a format this version cannot read
    ├── RestoreError(ValueError)            a checkpoint does not fit the template it is restored into
    ├── NoCheckpointError(FileNotFoundError) nothing to restore where something was required
    └── ClosedError(RuntimeError)           the Checkpointer was used after close()

Errors carry ``tier``, ``step`` and ``key`` attributes where they apply (``None`` otherwise). A failed
flush is raised by its save's ``handle.committed(tier)``, counted, kept as the tier's
``counters.last_error`` and logged; ``wait()``/``close()`` raise it once if that tier has committed
nothing since, and no later ``save()`` ever raises it: training goes on, the next save tries again. A
failed capture (a torn snapshot: a bug in the training loop) is also raised once by the next ``save``,
``wait`` or ``close``. Background failures keep their own type, chained to the original exception.

What is not raised is logged, on the ``tierckpt`` logger only, once per event: WARNING for what an
operator should know of though the call went on (a version that did not verify and was passed over,
naming tier, step, key, and the candidate tried next; a tier that could not be locked), INFO for
routine recovery (leftovers swept, a save skipped under ``host.on_full: skip``), ERROR for a
background failure, which is raised later as above. The package never calls :func:`warnings.warn`:
a restore that fell back did its job, so there is nothing in the caller's code to fix; Python shows a
warning once per place and text (a fallback in the next restore would be hidden), and turns it
into an exception under ``-W error``, in the middle of a fallback. A message names each tier and
step once and says what happens next only when something is left to try; it is built from
``str(error)``, not from a ``repr``.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TierckptError",
    "ConfigError",
    "CapacityError",
    "UnsupportedStateError",
    "FlushError",
    "RankFailureError",
    "LayoutError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "RestoreError",
    "NoCheckpointError",
    "ClosedError",
    "SpaceNeeded",
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
    """A state does not fit in one host slot (``host.capacity / host.snapshots``), or, without
    ``host.capacity``, a pool sized to it would take more than half of the host's memory."""


class UnsupportedStateError(TierckptError, TypeError):
    """A value in the state cannot be stored without pickle (its key path is in ``key``)."""


class FlushError(TierckptError, OSError):
    """Capturing a snapshot or writing a version to a tier failed in the background.

    When an I/O call failed (a full disk, a quota, an I/O error, a permission), ``errno`` and
    ``filename`` (also ``path``) are those of the call, and the message names them with the tier and
    the step: ``tier 'nvme': flushing step 2 failed with ENOSPC: [Errno 28] No space left on device
    (fallocate): '/ckpt/nvme/.tmp-step-000000000002-…/data-r00000.bin'``. The cause is chained.

    A full disk (ENOSPC) of a tier with a path also says what the tier needs and has: ``space``
    (:class:`SpaceNeeded`), whose sizes end the message. ``None`` for every other failure.
    """

    def __init__(
        self, message: str, *, errno: int | None = None, path: str | None = None, space: SpaceNeeded | None = None, **where: Any
    ) -> None:
        super().__init__(message, **where)  # tier, step, key: as every TierckptError
        # OSError's own attributes, so ``except OSError as e: e.errno`` works on it too.
        self.errno = errno
        self.strerror = os.strerror(errno) if errno else None
        self.filename = path
        self.space = space

    @property
    def path(self) -> str | None:
        """The file or directory the failed call was about, when there was one."""
        return self.filename

    def __str__(self) -> str:
        # OSError would print "[Errno n] strerror: filename" once errno is set, dropping tier and step.
        return str(self.args[0]) if self.args else ""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class SpaceNeeded:
    """What a tier whose file system is full (ENOSPC) needs and has: a :class:`FlushError`'s ``space``.

    Retention deletes only after a commit, so while a version is written the tier holds every version
    its ``keep`` holds, and the new one: ``keep_bytes`` is that.

    Attributes:
        path: the tier's directory, where ``free_bytes`` was measured.
        free_bytes: free on that file system (for this user) once the failed write gave its space back.
        version_bytes: one version on that disk: the newest the tier holds (blocks in use), else the one
            that failed as it was read (``estimated``: this tier's compression may store less, alignment
            more); ``None``: not known.
        estimated: ``version_bytes`` is the version as read, not as stored here.
        keep: the tier's keep rules as YAML writes them (``"{last: 3}"``; ``""``: none, it keeps every version).
        kept: how many versions ``keep`` holds (``None``: every one); with ``open_ended``, at least that many.
        open_ended: ``keep`` also holds versions beyond ``kept`` (``every_steps``, ``within``).

    Example:
        >>> print(SpaceNeeded("/ckpt/nvme", 20 << 20, 21 << 20, False, "{last: 3}", 3, False))
        a version needs 21.0 MiB; keep {last: 3} needs 84.0 MiB for 3 versions and the one being written; 20.0 MiB free in /ckpt/nvme
    """

    path: str
    free_bytes: int
    version_bytes: int | None
    estimated: bool
    keep: str
    kept: int | None
    open_ended: bool

    @property
    def keep_bytes(self) -> int | None:
        """What ``keep`` needs while a version is written (at least that, with ``open_ended``); None: unknown or unbounded."""
        if self.kept is None or self.version_bytes is None:
            return None
        return (self.kept + 1) * self.version_bytes

    def __str__(self) -> str:
        words = []
        if self.version_bytes is not None:
            words.append(f"a version needs {'about ' if self.estimated else ''}{_mib(self.version_bytes)}")
        if self.kept is None:
            words.append(f"keep {self.keep} holds every version" if self.keep else "no keep rule: the tier holds every version")
        else:
            versions = f"{self.kept} version{'s' if self.kept != 1 else ''} and the one being written"
            more = ", plus what its other rules keep" if self.open_ended else ""
            total = self.keep_bytes
            needs = "holds" if total is None else f"needs {'at least ' if self.open_ended else ''}{_mib(total)} for"
            words.append(f"keep {self.keep} {needs} {versions}{more}")
        words.append(f"{_mib(self.free_bytes)} free in {self.path}")
        return "; ".join(words)


class RankFailureError(FlushError):
    """A version several ranks save was abandoned: some ranks did not report their part durable in time,
    or reported a failure. ``ranks`` are those ranks; the message says what each one did."""

    def __init__(self, message: str, *, tier: str | None = None, step: int | None = None, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message, tier=tier, step=step)
        self.ranks = ranks


class LayoutError(TierckptError, ValueError):
    """A stored version was saved by another number of ranks than the job reading it has.

    ``restore_latest`` does not raise it: it reads such a version through its saved layout
    (:mod:`tierckpt.restore.reshard`). Reading one rank's part as it is (a flush) does.
    """


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


def io_cause(error: BaseException) -> OSError | None:
    """The failed I/O call behind ``error``: itself, or the first of its causes, that has an errno."""
    cause: BaseException | None = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno):
        cause = cause.__cause__
    return cause if isinstance(cause, OSError) else None


def flush_failure(tier: str, step: int | None, doing: str, error: BaseException, *, space: SpaceNeeded | None = None) -> FlushError:
    """``error`` as a FlushError naming the tier, the step, and the errno and path of the I/O call that
    failed; ``space``: what a full tier needs and has, said at the end."""
    if isinstance(error, FlushError):
        return error
    cause = io_cause(error)
    code = None if cause is None else cause.errno
    path = None if cause is None else cause.filename
    name = f" with {errno.errorcode.get(code, code)}" if code else ""
    sizes = "" if space is None else f" ({space})"
    failure = FlushError(
        f"tier {tier!r}: {doing} failed{name}: {error}{sizes}",
        tier=tier,
        step=step,
        errno=code,
        path=None if path is None else str(path),
        space=space,
    )
    failure.__cause__ = error
    return failure
