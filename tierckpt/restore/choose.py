"""Restore: find the newest committed version across tiers (or one step: :func:`restore_step`),
verify it, load it.

Candidates are every tier's committed versions, newest step first and, for one step, the fastest
tier first. A version that fails verification (damaged manifest, missing file, checksum mismatch)
gives a warning naming tier, step and key, and the next candidate is tried: the same step on a slower
tier, then older steps. A tier holding only part of a version this rank needs more of (one process's
host memory) is passed over the same way, with a log line. How one candidate is read:
:mod:`tierckpt.restore.read`; several ranks agreeing on one step: :mod:`tierckpt.restore.agree`.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from tierckpt.errors import CorruptCheckpointError, NoCheckpointError
from tierckpt.format.saved_layout import NotHere
from tierckpt.restore.landing import finish
from tierckpt.restore.read import in_thread, read_version
from tierckpt.state import Leaf, flatten, format_path
from tierckpt.tiers.base import Tier
from tierckpt.tiers.memory import MemoryTier

__all__ = ["Restored", "held_steps", "restore_latest", "restore_step", "template_leaves"]

log = logging.getLogger("tierckpt")


@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore_latest` returns."""

    step: int
    state: Any
    tier: str  # the tier it was read from
    metadata: dict[str, Any] = field(default_factory=dict)
    # With a template: its array keys the version lacks (left as they were; only with strict=False),
    # and the version's keys the template lacks (new arrays in ``state``).
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()


def template_leaves(template: Any) -> dict[str, Leaf]:
    if template is None:
        return {}
    return {format_path(leaf.path): leaf for leaf in flatten(template)[1]}


async def restore_latest(
    tiers: Sequence[Tier],
    template: Any,
    staging: MemoryTier | None = None,
    *,
    strict: bool = True,
    cast: bool = False,
) -> Restored | None:
    """The newest version that verifies, loaded (into ``template`` when given); None if none does.

    ``staging``: the memory tier whose free slots may hold the bytes staged for the template (see the
    docstring of :mod:`tierckpt.restore.read`); without it, or when they are too small, a fresh
    mapping does. ``strict`` and ``cast``: see :func:`~tierckpt.restore.read.check_keys` and
    :func:`tierckpt.restore.plan.plan`.
    """
    restored, _ = await _first_verified(tiers, template, staging, None, strict=strict, cast=cast)
    return restored


async def restore_step(
    tiers: Sequence[Tier],
    step: int,
    template: Any,
    staging: MemoryTier | None = None,
    *,
    strict: bool = True,
    cast: bool = False,
    listed: Sequence[Tier] | None = None,
) -> Restored:
    """Step ``step`` loaded from the first of ``tiers`` (fastest first) where it verifies; never
    another step.

    Raises:
        NoCheckpointError: none of ``tiers`` holds the step; names what each of ``listed`` (default:
            ``tiers``) holds.
        CorruptCheckpointError: every copy of the step failed verification; names each failure.
    """
    restored, failures = await _first_verified(tiers, template, staging, step, strict=strict, cast=cast)
    if restored is not None:
        return restored
    if not failures:
        raise NoCheckpointError(f"no tier holds step {step} ({held_steps(listed if listed is not None else tiers)})", step=step)
    raise CorruptCheckpointError(f"step {step}: no copy verifies ({'; '.join(failures)})", step=step)


def held_steps(tiers: Sequence[Tier]) -> str:
    """What each tier holds, for an error message: ``ram: 8, 10; nvme: 4, 8, 10; pfs: none``."""
    return "; ".join(f"{t.name}: {_steps([info.step for info in t.versions()])}" for t in tiers)


def _steps(steps: list[int], limit: int = 8) -> str:
    steps = sorted(set(steps))
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[-limit:]))
    return shown if len(steps) <= limit else f"{len(steps) - limit} older, {shown}"


async def _first_verified(
    tiers: Sequence[Tier], template: Any, staging: MemoryTier | None, only: int | None, *, strict: bool, cast: bool
) -> tuple[Restored | None, list[str]]:
    """The newest candidate (of step ``only`` when given) that verifies, loaded; and why each
    candidate tried before it did not."""
    by_path = template_leaves(template)
    candidates = sorted(
        ((info.step, i) for i, tier in enumerate(tiers) for info in tier.versions() if only is None or info.step == only),
        key=lambda c: (-c[0], c[1]),
    )
    failures: list[str] = []
    for step, i in candidates:
        tier = tiers[i]
        try:
            lease = tier.lease(step)
        except KeyError:
            continue  # evicted from memory since the list was made
        with contextlib.ExitStack() as held_open:
            held_open.callback(lease.release)
            try:
                read, targets, keys = await read_version(held_open, tier, step, by_path, staging, strict=strict, cast=cast)
            except NotHere as exc:
                log.info("tierckpt: %s; trying the next candidate", exc)
                continue
            except CorruptCheckpointError as exc:
                failures.append(f"tier {tier.name!r}: {exc}")
                message = f"tierckpt: step {step} on tier {tier.name!r} does not verify ({exc}); trying the next candidate"
                log.warning(message)
                warnings.warn(message, RuntimeWarning, stacklevel=3)
                continue
            state = await in_thread(finish, read, targets)
            return Restored(step, state, tier.name, dict(read.metadata), *keys), failures
    return None, failures
