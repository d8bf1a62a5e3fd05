"""A snapshot: one saved state captured into a host slot, immutable once captured.

Planning is separate from copying: :func:`plan_entries` lays the state's leaves out in a slot
(pure arithmetic), the copier fills the slot, and every tier reads the same layout. Entries are
aligned to 4 KiB so a slot region can be written to disk with O_DIRECT as it is.
"""

from __future__ import annotations

import concurrent.futures
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tierckpt._buffers import align_up
from tierckpt.format import ALIGN
from tierckpt.state import Leaf, format_path

if TYPE_CHECKING:
    from tierckpt.capture.pool import Slot


@dataclass(frozen=True)
class Entry:
    """Where one array leaf lives inside a slot."""

    index: int
    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int


def plan_entries(leaves: Sequence[Leaf]) -> tuple[tuple[Entry, ...], int]:
    """Lay leaves out back to back at 4 KiB boundaries; returns the entries and the bytes needed."""
    entries = []
    offset = 0
    for leaf in leaves:
        entries.append(
            Entry(
                index=leaf.index,
                key=format_path(leaf.path),
                kind=leaf.kind,
                dtype=leaf.dtype,
                shape=tuple(leaf.shape),
                nbytes=leaf.nbytes,
                offset=offset,
            )
        )
        offset += align_up(leaf.nbytes, ALIGN)
    return tuple(entries), offset


class SnapshotState(enum.Enum):
    CAPTURING = "capturing"
    CAPTURED = "captured"
    FAILED = "failed"
    DROPPED = "dropped"


@dataclass(eq=False)
class Snapshot:
    """A state held in a host slot. Mutated only on the engine thread, except ``capture``."""

    seq: int  # 1, 2, ... in save order: the arrival number the first flusher counts
    step: int
    entries: tuple[Entry, ...]
    nbytes: int  # bytes of the slot in use
    skeleton: Any
    metadata: dict[str, Any]
    created: float
    slot: Slot
    capture: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    state: SnapshotState = SnapshotState.CAPTURING
    leases: int = 0
    report_failure: bool = True  # False when save() itself already raised the capture's failure
    # A memory tier with a path (its pool in a RAM-backed file): per entry, the xxh3 of each chunk,
    # and the version directory that makes the snapshot outlive the process (None: not written).
    checksums: tuple[tuple[int, ...], ...] | None = None
    persisted: Path | None = None
    restored: bool = False  # found by a new process: it was not captured here
    verified: bool = False  # a restored snapshot whose every chunk matched its checksum
