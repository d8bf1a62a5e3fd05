"""A committed version of a filesystem tier as a saved layout: what each rank stored, by its manifests.

The restore planner (:func:`tierckpt.restore.plan.plan`) reads any parallel layout from this; the
manifests are read and verified as :mod:`tierckpt.tiers.stored.read` reads them, shared chunks resolved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tierckpt.format import Manifest, TensorRecord
from tierckpt.format.saved_layout import SavedLayout, home_rank
from tierckpt.format.source import VersionSource
from tierckpt.tiers.stored.read import find_base, read_head, read_rank_manifest, resolve_shared, version_files
from tierckpt.tiers.stored.source import StoreVersion

__all__ = ["filesystem_layout"]


def filesystem_layout(tier: str, path: Path | StoreVersion, rank: int, *, direct: bool) -> SavedLayout:
    """The layout of the committed version at ``path`` of a filesystem tier (blocking).

    Raises CorruptCheckpointError when a manifest does not verify or the pieces do not add up.
    """
    head = read_head(path, tier=tier, step=None)
    step = head.step
    if isinstance(head, Manifest):
        parts: dict[int, Manifest] = {0: head}
    else:
        parts = {q: read_rank_manifest(path, head, q, tier=tier) for q in range(head.world_size)}
        parts = {q: resolve_shared(path, head, m, tier=tier, manifests=parts) for q, m in parts.items()}
    home = home_rank(rank, len(parts))
    # A differential version's parts name one base (the tier chose it for every rank); a part written
    # whole names none. Its chunks say where in the base they lie, whichever rank's they are.
    # Where it is (in place, or kept aside since its step was saved again) is checked on one part's manifest.
    named = next((m for m in parts.values() if m.base is not None), None)
    base = named.base if named is not None else None
    base_files = find_base(version_files(path), named, tier=tier) if named is not None else None

    def open_pieces(records: Sequence[TensorRecord], shared: bool) -> VersionSource:
        manifest = Manifest(step, head.created, parts[home].skeleton, tuple(records), head.metadata, base=base)
        # Shared pieces overlap the destination only in part: some of their chunks are not read.
        return version_files(path).open_source(tier, manifest, direct=direct and not shared, every_chunk=not shared, base=base_files)

    return SavedLayout(
        tier=tier,
        step=step,
        created=head.created,
        metadata=dict(head.metadata),
        world=len(parts),
        parts=parts,
        home=home,
        complete=True,
        open=open_pieces,
    )
