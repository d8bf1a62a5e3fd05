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
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tierckpt._buffers import align_up
from tierckpt.format import ALIGN, CHUNK_BYTES, Region
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
    # A value every rank holds alike (``save(replicated=...)``): these ranks store its chunks in turn.
    shared: tuple[int, ...] | None = None
    region: Region | None = None  # a DTensor's piece: where it lies in the global tensor

    @property
    def chunk_bytes(self) -> int:
        """Bytes per chunk: a shared value is cut so that each of its ranks stores about an equal part."""
        if self.shared is None:
            return CHUNK_BYTES
        return min(CHUNK_BYTES, max(ALIGN, align_up(-(-self.nbytes // len(self.shared)), ALIGN)))


def plan_entries(leaves: Sequence[Leaf], shared: Callable[[str], tuple[int, ...] | None] = lambda key: None) -> tuple[tuple[Entry, ...], int]:
    """Lay leaves out back to back at 4 KiB boundaries; returns the entries and the bytes needed.

    ``shared(key)`` names the ranks that store the leaf at ``key`` in turn, or None for this rank's own.
    """
    entries = []
    offset = 0
    for leaf in leaves:
        key = format_path(leaf.path)
        entries.append(
            Entry(
                index=leaf.index,
                key=key,
                kind=leaf.kind,
                dtype=leaf.dtype,
                shape=tuple(leaf.shape),
                nbytes=leaf.nbytes,
                offset=offset,
                shared=shared(key),
                region=leaf.region,
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
