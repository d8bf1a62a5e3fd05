"""Restore: find the newest committed version across tiers (or one step: :func:`restore_step`),
verify it, load it.

Candidates are every tier's committed versions, newest step first and, for one step, the fastest
tier first. A version that fails verification (damaged manifest, missing file, checksum mismatch)
is logged as a warning naming tier, step and key, and the next candidate, which the warning names,
is tried: the same step on a slower tier, then older steps. A tier holding only part of a version
this rank needs more of (one process's host memory) is passed over the same way, with an info line.
How one candidate is read: :mod:`tierckpt.restore.read`; several ranks agreeing on one step:
:mod:`tierckpt.restore.agree`.

Warnings go to the ``tierckpt`` logger only, once per event, never also through
:func:`warnings.warn` (the package's rule, in :mod:`tierckpt.errors`): a restore that falls back
went on and returned a version, so it is an event for the operator's log, not a fault in the
caller's code; and Python's warning filters would show it once per process (or raise it in the
middle of the fallback under ``-W error``).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from tierckpt.errors import CorruptCheckpointError, NoCheckpointError, RestoreError
from tierckpt.format.layout import after_where, where
from tierckpt.format.saved_layout import NotHere
from tierckpt.restore.landing import finish
from tierckpt.restore.read import in_thread, read_version, some_keys
from tierckpt.state import Leaf, flatten, format_path
from tierckpt.tiers.base import Tier
from tierckpt.tiers.memory.tier import MemoryTier

__all__ = ["Restored", "held_steps", "overwritten", "restore_latest", "restore_step", "template_leaves", "uncovered"]

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
    verify_first: bool = False,
) -> Restored | None:
    """The newest version that verifies, loaded (into ``template`` when given); None if none does.

    ``staging``: the memory tier whose free slots may hold the bytes staged for the template (see the
    docstring of :mod:`tierckpt.restore.read`); without it, or when they are too small, a fresh
    mapping does. ``strict``, ``cast`` and ``verify_first``: see
    :func:`~tierckpt.restore.read.check_keys` and :func:`tierckpt.restore.plan.plan`.

    Raises:
        CorruptCheckpointError: no candidate verifies, and one that failed half-way had written into
            the template (without ``verify_first``): the template is not as it was passed.
        RestoreError: as :func:`~tierckpt.restore.read.check_keys`; or a candidate that failed
            half-way wrote template tensors that the version restored instead lacks.
    """
    restored, failures, touched = await _first_verified(tiers, template, staging, None, strict=strict, cast=cast, verify_first=verify_first)
    if restored is None and touched:
        raise CorruptCheckpointError(f"no version verifies ({'; '.join(failures)}); {overwritten(touched)}")
    return restored


async def restore_step(
    tiers: Sequence[Tier],
    step: int,
    template: Any,
    staging: MemoryTier | None = None,
    *,
    strict: bool = True,
    cast: bool = False,
    verify_first: bool = False,
    listed: Sequence[Tier] | None = None,
) -> Restored:
    """Step ``step`` loaded from the first of ``tiers`` (fastest first) where it verifies; never
    another step.

    Raises:
        NoCheckpointError: none of ``tiers`` holds the step; names what each of ``listed`` (default:
            ``tiers``) holds.
        CorruptCheckpointError: every copy of the step failed verification; names each failure, and
            says so when the template was partly written (without ``verify_first``).
        RestoreError: as :func:`restore_latest`.
    """
    restored, failures, touched = await _first_verified(tiers, template, staging, step, strict=strict, cast=cast, verify_first=verify_first)
    if restored is not None:
        return restored
    if not failures:
        raise NoCheckpointError(f"no tier holds step {step} ({held_steps(listed if listed is not None else tiers)})", step=step)
    written = f"; {overwritten(touched)}" if touched else ""
    raise CorruptCheckpointError(f"step {step}: no copy verifies ({'; '.join(failures)}){written}", step=step)


def overwritten(whose: set[str] | str) -> str:
    """Says that copies which failed wrote into the template: ``whose`` keys, or whose template."""
    what = some_keys(sorted(whose)) if isinstance(whose, set) else f"on {whose}"
    return (
        f"the template was partly overwritten by the copies that failed ({what}); restore into a new "
        "template, or pass verify_first=True to keep a template as it is until a version verifies"
    )


def uncovered(touched: set[str], targets: Sequence[Any], step: int) -> RestoreError | None:
    """The error for template keys a failed attempt wrote and the version restored does not write
    again (only without ``strict``: its keys lack them), or None."""
    left = touched - {t.record.key for t in targets if t.template}
    if not left:
        return None
    return RestoreError(
        f"step {step} verified, but lacks template tensors that a copy which failed verification had "
        f"partly overwritten: {some_keys(sorted(left))} (restore with verify_first=True, or rebuild the template)",
        step=step,
    )


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
    tiers: Sequence[Tier], template: Any, staging: MemoryTier | None, only: int | None, *, strict: bool, cast: bool, verify_first: bool
) -> tuple[Restored | None, list[str], set[str]]:
    """The newest candidate (of step ``only`` when given) that verifies, loaded; why each candidate
    tried before it did not; and the template keys those failed attempts wrote into."""
    by_path = template_leaves(template)
    touched: set[str] = set()
    candidates = sorted(
        ((info.step, i) for i, tier in enumerate(tiers) for info in tier.versions() if only is None or info.step == only),
        key=lambda c: (-c[0], c[1]),
    )
    failures: list[str] = []
    for n, (step, i) in enumerate(candidates):
        tier = tiers[i]
        try:
            lease = tier.lease(step)
        except KeyError:
            continue  # evicted from memory since the list was made
        after = _next(candidates[n + 1 :], tiers, only)
        with contextlib.ExitStack() as held_open:
            held_open.callback(lease.release)
            attempted: set[str] = set()
            try:
                read, targets, keys = await read_version(
                    held_open, tier, step, by_path, staging, strict=strict, cast=cast, verify_first=verify_first, touched=attempted
                )
            except NotHere as exc:
                log.info("tierckpt: %s; %s", exc, after)
                continue
            except CorruptCheckpointError as exc:
                touched |= attempted
                why = after_where(exc, tier.name, step)
                failures.append(f"tier {tier.name!r}: {why}" if only is not None else f"{where(tier.name, step)}: {why}")
                log.warning("tierckpt: %s does not verify: %s; %s", where(tier.name, step), why, after)
                continue
            error = uncovered(touched, targets, step)
            if error is not None:
                raise error
            state = await in_thread(finish, read, targets)
            return Restored(step, state, tier.name, dict(read.metadata), *keys), failures, touched
    return None, failures, touched


def _next(left: Sequence[tuple[int, int]], tiers: Sequence[Tier], only: int | None) -> str:
    """What a restore does after a candidate failed: try the next of those ``left``, named, if any."""
    if left:
        step, i = left[0]
        return f"trying {where(tiers[i].name, step)} next"
    return f"no other copy of step {only} is left to try" if only is not None else "no other version is left to try"
