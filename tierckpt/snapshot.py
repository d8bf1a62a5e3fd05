"""A snapshot: one saved state captured into a host slot, immutable once captured.

Planning is separate from copying: :func:`plan_entries` lays the state's leaves out in a slot
(pure arithmetic), the copier fills the slot, and every tier reads the same layout. Entries are
aligned to 4 KiB so a slot region can be written to disk with O_DIRECT as it is. Of several ranks,
:func:`sharing` says which values are stored once between them (data-parallel sharing), and
:class:`LayoutCache` keeps the plan of a state whose layout does not change.
"""

from __future__ import annotations

import concurrent.futures
import enum
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from tierckpt.format.lineage import Lineage
from tierckpt._buffers import align_up
from tierckpt.format import ALIGN, CHUNK_BYTES
from tierckpt.format.records import TensorInfo
from tierckpt.state import Leaf, Survey, format_path


@dataclass(frozen=True)
class Entry(TensorInfo):
    """Where one array leaf lives inside a slot. Its ``shared``: a value every rank holds alike
    (``save(replicated=...)``), whose chunks these ranks store in turn."""

    offset: int

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


def sharing(replicated: Sequence[Any], leaves: Sequence[Leaf], ranks: Sequence[int]) -> Callable[[str], tuple[int, ...] | None]:
    """Which leaves are stored once between ranks, as :func:`plan_entries` asks: by key, those ranks.

    ``ranks`` are the global ranks of the group, in group order. A DTensor piece is shared by its
    replicas (the ranks holding the same piece), named or not; ``replicated`` names other values that
    every rank holds alike.

    Raises:
        ValueError: an entry names no leaf (a typo would otherwise store every rank's copy).
        TypeError: an entry is not a str or a tuple.
    """
    if isinstance(replicated, (str, tuple)) and replicated and not isinstance(replicated, list):
        replicated = [replicated]
    prefixes = []
    for entry in replicated:
        if isinstance(entry, str):
            prefixes.append(tuple(entry.split(".")))
        elif isinstance(entry, tuple):
            prefixes.append(tuple(str(k) for k in entry))
        else:
            raise TypeError(f"replicated entries are key paths (a str like 'model' or 'optim.state', or a tuple), not {entry!r}")
    unused = [".".join(p) for p in prefixes if not any(tuple(str(k) for k in leaf.path)[: len(p)] == p for leaf in leaves)]
    if unused:
        raise ValueError(f"replicated={unused!r}: no tensor of the state is under {'these keys' if len(unused) > 1 else 'this key'}")
    if len(ranks) <= 1:
        return lambda key: None
    position = {r: i for i, r in enumerate(ranks)}
    everyone = tuple(range(len(ranks)))
    holders: dict[str, tuple[int, ...]] = {}
    for leaf in leaves:
        key = format_path(leaf.path)
        if leaf.region is not None:  # a DTensor: its placements say who holds the same piece
            if len(leaf.replicas) > 1 and all(r in position for r in leaf.replicas):
                holders[key] = tuple(position[r] for r in leaf.replicas)
            continue
        path = tuple(str(k) for k in leaf.path)
        if any(path[: len(p)] == p for p in prefixes):
            holders[key] = everyone
    if not holders:
        return lambda key: None

    def sharing(key: str) -> tuple[int, ...] | None:
        group = holders.get(key)
        if group is None:
            return None
        # Each value's chunks start at a rank of their own (the same on every holder: from the key),
        # so that the odd chunks of many values do not all land on one rank.
        first = zlib.crc32(key.encode()) % len(group)
        return group[first:] + group[:first]

    return sharing


class LayoutCache:
    """:func:`plan_entries` of a state, reused while the state keeps its layout, as a training loop's
    does: its survey's rows and ``replicated`` compare equal to the last save's (planning costs ~2 µs
    a tensor; the comparison ~0.04, and makes no :class:`~tierckpt.state.Leaf`)."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self._ranks = tuple(ranks)  # the global ranks saving together, in group order
        self._last: tuple[Any, list[Any], tuple[tuple[Entry, ...], int]] | None = None

    def entries(self, found: Survey, replicated: Sequence[Any] = ()) -> tuple[tuple[Entry, ...], int]:
        """The entries of ``found``'s leaves and the slot bytes they need.

        Raises:
            ValueError, TypeError: as :func:`sharing`, for a bad ``replicated``.
        """
        named = replicated if isinstance(replicated, (str, tuple)) else list(replicated)
        last = self._last
        if last is not None and last[0] == named and last[1] == found.rows:
            return last[2]
        leaves = found.leaves()
        planned = plan_entries(leaves, sharing(replicated, leaves, self._ranks))
        self._last = (named, found.rows, planned)
        return planned


@dataclass(eq=False)
class Slot:
    """One of the host pool's equal parts (:class:`~tierckpt.capture.pool.HostPool`): a snapshot's home."""

    index: int
    offset: int  # in the pool
    size: int


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
    # Which save this is (tierckpt.format.lineage), as its metadata records it: kept decoded, since
    # retention and the tier's listing ask at every save.
    lineage: Lineage | None = None
