"""Which restore a Checkpointer's ``restore`` or ``restore_latest`` runs, with its arguments checked.

Three restores exist (:func:`~tierckpt.restore.agree.restore_agreed` for several ranks,
:func:`~tierckpt.restore.choose.restore_step` and :func:`~tierckpt.restore.choose.restore_latest`
for one process); the API should not have to know which fits. The step and the tier name are checked
when the restore is asked for, before any of it runs, so that a bad one raises as it is and leaves no
coroutine unawaited.
"""

from __future__ import annotations

from typing import Any, Coroutine, Sequence

from tierckpt.errors import ConfigError
from tierckpt.format.layout import checked_step
from tierckpt.ranks.group import RankGroup
from tierckpt.restore.agree import restore_agreed
from tierckpt.restore.choose import Restored, restore_latest, restore_step
from tierckpt.tiers.base import Tier
from tierckpt.tiers.memory.tier import MemoryTier


def prepare_restore(
    group: RankGroup | None,
    tiers: Sequence[Tier],
    memory: MemoryTier,
    template: Any,
    *,
    strict: bool,
    cast: bool,
    verify_first: bool,
    step: int | None = None,
    tier: str | None = None,
) -> Coroutine[Any, Any, Any]:
    """The restore to run on the engine: of step ``step`` (else the newest that verifies), from tier
    ``tier`` only (else from any of ``tiers``, fastest first), collectively when ``group`` is given.
    Its result is a :class:`Restored`, or None when no step was asked for and no tier holds a version.

    Raises:
        TypeError, ValueError: ``step`` cannot name a version (:func:`~tierckpt.format.layout.checked_step`).
        ConfigError: there is no tier named ``tier``.
    """
    if step is not None:
        checked_step(step)
    only = None if tier is None else _named(tiers, tier)
    return _restore(group, tiers, memory, template, strict, cast, verify_first, step, only)


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
) -> Restored | None:
    tiers = listed if only is None else only
    if group is not None:
        work = restore_agreed(group, tiers, template, memory, strict=strict, cast=cast, verify_first=verify_first, only=step, listed=listed)
    elif step is not None:
        work = restore_step(tiers, step, template, memory, strict=strict, cast=cast, verify_first=verify_first, listed=listed)
    else:
        work = restore_latest(tiers, template, memory, strict=strict, cast=cast, verify_first=verify_first)
    # Faulting the host pool in the background would take cores from the restore, which every
    # rank of the job waits for: it waits until the restore is over.
    with memory.pool.paused():
        return await work
