"""A version's metadata (what ``save(metadata=...)`` stored with it), without its tensors.

A trainer integration needs a step's metadata before anything exists to restore its tensors into
(the Hugging Face integration writes a ``checkpoint-N`` directory from it before the Trainer wraps its
model): reading the step whole for it would allocate every tensor of the state. Only this rank's
copy's manifest is read, from the first tier holding it, verified as a restore verifies it; nothing
is exchanged between ranks.
"""

from __future__ import annotations

from typing import Any, Sequence

from tierckpt.format.lineage import head, user_metadata
from tierckpt.errors import ConfigError, CorruptCheckpointError, LayoutError, NoCheckpointError
from tierckpt.format.layout import after_where, checked_step
from tierckpt.restore.order import admitted, try_order
from tierckpt.restore.result import held_steps
from tierckpt.tiers.base import Tier

__all__ = ["read_metadata"]


async def read_metadata(tiers: Sequence[Tier], step: int, tier: str | None = None, *, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """The metadata of ``step`` from the first of ``tiers`` (or tier ``tier`` only) holding this rank's
    copy whose manifest verifies (on the engine's thread, which owns the tiers), in the order a
    restore tries them (a copy of the direction being trained first; one process: the newest save
    first, :mod:`tierckpt.restore.order`). A version
    saved by another number of ranks gives the metadata of the part a restore takes this rank's
    values from.

    Raises:
        TypeError, ValueError: ``step`` cannot name a version.
        ConfigError: there is no tier named ``tier``.
        NoCheckpointError: no tier (or not ``tier``) holds this rank's copy of the step.
        CorruptCheckpointError: no copy's manifest verifies; names each.
    """
    checked_step(step)
    if tier is not None and all(t.name != tier for t in tiers):
        raise ConfigError(f"metadata(tier={tier!r}): there is no such tier (the tiers are {', '.join(t.name for t in tiers)})")
    failed = []
    # The copy a restore of the step would read first: a live one before an abandoned one (this
    # rank's tiers decide: metadata is not collective).
    top = head(v for t in tiers for v in t.versions() if v.valid)
    live = admitted(step, tiers, top, explicit=True)
    order = try_order(step, tiers, world)
    for t in [tiers[i] for i in [*(i for i in order if i in live), *(i for i in order if i not in live)]]:
        if (tier is not None and t.name != tier) or not t.has_part(step):
            continue
        try:
            lease = t.lease(step)
        except KeyError:  # not (or no longer) held there
            continue
        try:
            try:
                source = await t.read(step)
            except LayoutError:  # saved by another number of ranks: its layout's (this rank's home part's)
                return user_metadata((await t.read_layout(step, rank)).metadata)
            try:
                return user_metadata(source.metadata)
            finally:
                source.close()
        except CorruptCheckpointError as exc:
            failed.append(f"tier {t.name!r}: {after_where(exc, t.name, step)}")
        finally:
            lease.release()
    if failed:
        raise CorruptCheckpointError(f"step {step}: no copy's manifest verifies ({'; '.join(failed)})", step=step)
    listed = [t for t in tiers if tier is None or t.name == tier]
    raise NoCheckpointError(f"no tier holds step {step} ({held_steps(listed)})", step=step)
