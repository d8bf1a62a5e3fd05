"""Which restore a Checkpointer's ``restore`` or ``restore_latest`` runs, with its arguments checked.

One restore serves one process and several ranks alike (:func:`~tierckpt.restore.fallback.restore_versions`);
this module checks the step and the tier name when the restore is asked for, before any of it runs,
so that a bad one raises as it is and leaves no coroutine unawaited, keeps the host pool's
background preparation paused while it runs, and reports how it ended as an event.
"""

from __future__ import annotations

import time
from typing import Any, Coroutine, Sequence

from tierckpt.errors import ConfigError
from tierckpt.format.layout import checked_step
from tierckpt.observe.events import Events
from tierckpt.pipeline.direction import Direction
from tierckpt.ranks.group import RankGroup
from tierckpt.restore.fallback import restore_versions
from tierckpt.restore.result import Restored
from tierckpt.tiers.base import Tier
from tierckpt.tiers.memory.tier import MemoryTier


def prepare_restore(
    group: RankGroup | None,
    tiers: Sequence[Tier],
    memory: MemoryTier,
    events: Events,
    template: Any,
    *,
    strict: bool,
    cast: bool,
    verify_first: bool,
    step: int | None = None,
    tier: str | None = None,
    replicas_once: bool = True,
    direction: Direction | None = None,
) -> Coroutine[Any, Any, Any]:
    """The restore to run on the engine: of step ``step`` (else the newest that verifies), from tier
    ``tier`` only (else from any of ``tiers``, fastest first), collectively when ``group`` is given.
    Rank 0 (or the one process) shows a progress bar per copy it reads, when stderr is a terminal
    (:mod:`tierckpt.observe.progress`). Its result is a :class:`Restored`, or None when no step was
    asked for and no tier holds a version. How it ends is reported on ``events``: ``restored`` (step,
    tier, bytes, seconds since this call) or ``restore_failed`` (step, error). ``replicas_once``: a
    value stored once between ranks is read once between them (``distributed.read_replicated``).
    ``direction``: told of the version restored, which the next save descends from.

    Raises:
        TypeError, ValueError: ``step`` cannot name a version (:func:`~tierckpt.format.layout.checked_step`).
        ConfigError: there is no tier named ``tier``.
    """
    began = time.monotonic()
    if step is not None:
        checked_step(step)
    only = None if tier is None else _named(tiers, tier)
    work = _restore(group, tiers, memory, template, strict, cast, verify_first, step, only, replicas_once)
    return _reported(work, tiers, events, step, began, direction)


def _named(tiers: Sequence[Tier], name: str) -> list[Tier]:
    found = [t for t in tiers if t.name == name]
    if not found:
        raise ConfigError(f"restore(tier={name!r}): there is no such tier (the tiers are {', '.join(t.name for t in tiers)})")
    return found


async def _restore(
    group: RankGroup | None,
    listed: Sequence[Tier],
    memory: MemoryTier,
    template: Any,
    strict: bool,
    cast: bool,
    verify_first: bool,
    step: int | None,
    only: list[Tier] | None,
    replicas_once: bool,
) -> Restored | None:
    tiers = listed if only is None else only
    # One bar per copy tried, on rank 0 only: every rank drawing its own would garble the terminal.
    show = group is None or group.rank == 0
    work = restore_versions(
        group, tiers, template, memory, strict=strict, cast=cast, verify_first=verify_first, only=step, listed=listed, show_progress=show,
        replicas_once=replicas_once,
    )
    # Faulting the host pool in the background would take cores from the restore, which every
    # rank of the job waits for: it waits until the restore is over.
    with memory.pool.paused():
        return await work


async def _reported(
    work: Coroutine[Any, Any, Restored | None], tiers: Sequence[Tier], events: Events, step: int | None, began: float, direction: Direction | None
) -> Restored | None:
    """``work``, a restore, reported as a ``restored`` or ``restore_failed`` event, and to ``direction``
    (on the engine's thread, which owns what the tiers hold and the pipeline's direction)."""
    try:
        restored = await work
    except Exception as exc:
        events.emit("restore_failed", step=step, error=exc)
        raise
    if restored is not None:
        if direction is not None:
            direction.restored(restored.step, restored.lineage)
        held = next((v.nbytes for t in tiers if t.name == restored.tier for v in t.versions() if v.step == restored.step), None)
        events.emit("restored", step=restored.step, tier=restored.tier, bytes=held, seconds=time.monotonic() - began)
    return restored
