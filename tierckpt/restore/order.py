"""Which copies of a step a restore reads, and in which order, when several tiers hold it.

Which copies: those of the direction being trained (:func:`~tierckpt.format.lineage.is_live` of the
newest save any rank holds: :func:`admitted`) that no restore of this process found damaged (but
``restore(step)`` reads a damaged one again). A copy of the step saved in a direction a rollback
left is never read by ``restore_latest()``; ``restore(step)`` reads one only where no live copy of
the step is held (loading an abandoned version explicitly).

In which order: one process, the newest save of the step first (its serial, which every tier keeps
with the version), the fastest tier first among copies of the same save. A step saved again (a job
that went back and saves it anew) may be committed on a slower tier while a faster one still holds
the earlier save, its replacement cut short by a crash: the earlier save must not win. Several ranks
go down the tiers in tier order, which is the same on every rank: each calls every tier's fetch from
the others at the same place (:class:`~tierckpt.tiers.base.Recovery`); :func:`admitted` already
leaves out what they must not read.
"""

from __future__ import annotations

from typing import Sequence

from tierckpt.format.lineage import Lineage, is_live, order_key
from tierckpt.tiers.base import Tier, VersionInfo

__all__ = ["admitted", "known_damage", "newest_save_first", "try_order"]


def admitted(step: int, tiers: Sequence[Tier], top: Lineage | None, *, explicit: bool) -> set[int]:
    """The indices of ``tiers`` whose copy of this rank's part of ``step`` a restore may read: those
    of ``top``'s direction that no restore of this process found damaged. With ``explicit`` (the step
    was asked for outright) the damaged ones too, read again so that the restore says why each fails,
    and where no live copy is held, the abandoned ones."""
    held = {i: [v for v in tiers[i].versions() if v.step == step] for i, t in enumerate(tiers) if t.has_part(step)}
    live = {i for i, found in held.items() if any(is_live(v, top) and (explicit or tiers[i].damage_of(v) is None) for v in found)}
    if live or not explicit:
        return live
    return {i for i, found in held.items() if found}


def known_damage(step: int, tier: Tier, top: Lineage | None) -> VersionInfo | None:
    """``tier``'s live copy of ``step`` when it is known to be damaged (found so by a restore of this
    process, or marked so by ``tierckpt verify``: :meth:`~tierckpt.tiers.base.Tier.damage_of` says
    why), which :func:`admitted` left out; None: not known so."""
    return next((v for v in tier.versions() if v.step == step and is_live(v, top) and tier.damage_of(v) is not None), None)


def newest_save_first(step: int, tiers: Sequence[Tier]) -> list[int]:
    """The indices of ``tiers`` in the order one process tries ``step`` on them: those holding it by
    the newest save first (stable: tier order among copies of one save), then the others, in tier order."""
    newest = {i: max(order_key(v) for v in held) for i, t in enumerate(tiers) if (held := [v for v in t.versions() if v.step == step])}
    return sorted(range(len(tiers)), key=lambda i: (i not in newest, tuple(-x for x in newest.get(i, (0, 0, 0.0)))))


def try_order(step: int, tiers: Sequence[Tier], world: int) -> Sequence[int]:
    """The indices of ``tiers`` in the order a rank of ``world`` tries ``step`` on them: one process by
    :func:`newest_save_first`, several ranks in tier order (see the module docstring)."""
    return newest_save_first(step, tiers) if world == 1 else range(len(tiers))
