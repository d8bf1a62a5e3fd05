"""Which copy of a step one process tries first, when several tiers hold it.

The newest save of the step first, the fastest tier first among copies of the same save. A step saved
again (a job that went back and saves it anew) may be committed on a slower tier while a faster one
still holds the earlier save, its replacement cut short by a crash: the earlier save must not win.
One process stamps a save with one ``created`` that every tier keeps (a flush and a promotion copy
it), so equal stamps mean the same save. Of several ranks a tier's copy carries its leader's stamp
or the rank's own, which do not compare across tiers: they keep the tier order.
"""

from __future__ import annotations

from typing import Sequence

from tierckpt.tiers.base import Tier

__all__ = ["newest_save_first", "try_order"]


def newest_save_first(step: int, tiers: Sequence[Tier]) -> list[int]:
    """The indices of ``tiers`` in the order one process tries ``step`` on them: those holding it by
    the newest save first (stable: tier order among equal stamps), then the others, in tier order."""
    created = {i: max(v.created for v in held) for i, t in enumerate(tiers) if (held := [v for v in t.versions() if v.step == step])}
    return sorted(range(len(tiers)), key=lambda i: -created.get(i, float("-inf")))


def try_order(step: int, tiers: Sequence[Tier], world: int) -> Sequence[int]:
    """The indices of ``tiers`` in the order a rank of ``world`` tries ``step`` on them: one process by
    :func:`newest_save_first`, several ranks in tier order (see the module docstring)."""
    return newest_save_first(step, tiers) if world == 1 else range(len(tiers))
