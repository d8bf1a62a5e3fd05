"""What a previous process left in a pool that outlives it (:mod:`tierckpt.tiers.memory.shm`): each
version :meth:`~tierckpt.tiers.memory.shm.ShmStore.scan` found, placed back in its slot as a
captured snapshot, older than any save of this process. Not yet verified: the tier checks each whole
the first time it is read (:meth:`~tierckpt.tiers.memory.tier.MemoryTier.verify`)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tierckpt.format.lineage import Lineage, lineage_of
from tierckpt._buffers import align_up
from tierckpt.format import Manifest, version_dirname
from tierckpt.snapshot import Entry, Slot, Snapshot, SnapshotState


def leftover_snapshots(found: Sequence[tuple[Manifest, int | None]], free: Sequence[Slot], root: Path | None) -> list[Snapshot]:
    """The snapshots of ``found`` (a manifest and its slot index, None: any slot will do), each in a
    slot of ``free``, oldest step first with seqs up to 0; one with no slot index gets the lowest
    free slot left, or is left out when none is. ``root``: the directory their versions are in."""
    found = sorted(found, key=lambda f: f[0].step)
    by_index = {slot.index: slot for slot in free}
    placed = [(m, by_index.pop(i)) for m, i in found if i is not None]
    placed += [(m, by_index.pop(min(by_index))) for m, i in found if i is None and by_index]
    snapshots = []
    # In the order of their saves (tierckpt.format.lineage): after a rollback, not the order of their steps.
    ordered = sorted(((m, slot, lineage_of(m.metadata)) for m, slot in placed), key=lambda p: (_serial(p[2]), p[0].step))
    for seq, (manifest, slot, lineage) in enumerate(ordered, start=1 - len(placed)):
        entries = tuple(
            Entry(**r.identity(), offset=r.chunk(0).offset - slot.offset if r.chunks else 0)
            for r in manifest.records
        )
        snapshot = Snapshot(
            seq=seq,
            step=manifest.step,
            entries=entries,
            nbytes=max((align_up(e.offset + e.nbytes) for e in entries), default=0),
            skeleton=manifest.skeleton,
            metadata=manifest.metadata,
            created=manifest.created,
            slot=slot,
            state=SnapshotState.CAPTURED,
            checksums=tuple(tuple(c.checksum for c in r.all_chunks()) for r in manifest.records),
            persisted=root / version_dirname(manifest.step) if root is not None else None,
            restored=True,
            lineage=lineage,
        )
        snapshot.capture.set_result(None)
        snapshots.append(snapshot)
    return snapshots


def _serial(lineage: Lineage | None) -> int:
    return 0 if lineage is None else lineage.serial
