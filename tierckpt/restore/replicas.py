"""On restore, a replicated value is read from shared storage once per group of ranks sharing it.

A value every rank of a group holds alike (saved with ``replicated=``: a data-parallel model, its
optimizer state) is stored once: its chunk ``i`` by rank ``shared[i % len(shared)]``
(:mod:`tierckpt.format.manifest`). If every rank read all of it, each of its bytes would be read from
the file system or the bucket once per rank: at 1,000 data-parallel ranks, 1,000 times. So when every
rank restores a step from the same shared tier (a filesystem or object tier, not a node's own disk)
and reads it as it was saved (the planner's fast path), each rank reads and verifies only the chunks
it stored, and sends them to the other ranks sharing the value over the group's gloo group
(:func:`spread`); MegaScale's restore does the same (one reader per data-parallel group, then a
broadcast).

The ranks agree on it twice, each time in an exchange the restore makes anyway or one small one:

- before any read, from what each rank said it holds: the steps for which every rank's first tier is
  the same shared tier (:func:`read_once`);
- once each rank tried that tier, whether every rank read its own chunks there
  (:mod:`tierckpt.restore.fallback`). If one did not (a damaged chunk, a step gone meanwhile, a
  version that does not fit its template), every rank reads the chunks it left to the others itself
  (:class:`LeftToOwners`), as all ranks did before, and a failure there passes over that copy as any
  damaged copy is passed over.

Chunks are sent as decoded bytes, verified by the rank that read them; a rank receives at most
:data:`RECEIVE_BYTES` at a time.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from tierckpt.format.source import VersionSource
from tierckpt.restore.landing import Target
from tierckpt.restore.plan import Plan
from tierckpt.tiers.base import Tier

__all__ = ["LeftToOwners", "RECEIVE_BYTES", "first_tiers", "read_once", "spread"]

RECEIVE_BYTES = 256 << 20  # what one rank receives at most in one batch of sends (its buffers' size)


class Swapping(Protocol):
    """What :func:`spread` needs of the ranks (:class:`~tierckpt.ranks.group.RankGroup`)."""

    @property
    def rank(self) -> int: ...

    def swap(self, sends: Sequence[tuple[int, Any]], receives: Sequence[tuple[int, Any]]) -> None: ...


def first_tiers(tiers: Sequence[Tier], steps: Sequence[int]) -> list[int]:
    """For each of ``steps``, the index of the first of ``tiers`` holding this rank's part of it (-1: none)."""
    def first(step: int) -> int:
        return next((i for i, t in enumerate(tiers) if t.has_part(step) and any(v.step == step for v in t.versions())), -1)

    return [first(step) for step in steps]


def read_once(tiers: Sequence[Tier], held: Sequence[tuple[Sequence[int], Sequence[int] | None]]) -> dict[int, int]:
    """The steps whose replicated values are read once per group: step -> the index of the tier every
    rank reads it from first, a tier storing one copy for all ranks. ``held``: each rank's steps and
    their :func:`first_tiers` (None: that rank reads every replicated value whole), in rank order
    (the same on every rank, so every rank decides alike)."""
    if len(held) < 2 or any(indices is None for _, indices in held):
        return {}
    firsts = [dict(zip(steps, indices or ())) for steps, indices in held]
    return {
        step: i
        for step, i in firsts[0].items()
        if i >= 0 and tiers[i].reads_replicas_once and all(f.get(step) == i for f in firsts[1:])
    }


@dataclass
class LeftToOwners:
    """What this rank's read of a version left to the ranks storing its replicated chunks (the plan's
    deferred chunk jobs), and how to read them here instead."""

    plan: Plan
    source: VersionSource  # open until the restore's attempt at the step ends
    executor: concurrent.futures.Executor
    threads: int

    def read_here(self) -> None:
        """Read the chunks left to other ranks from the version, as the rest was read (blocking).

        Raises:
            CorruptCheckpointError: one of them does not verify.
        """
        self.plan.run_deferred(self.source, self.executor, self.threads)


def spread(ranks: Swapping, targets: Sequence[Target], receive_bytes: int | None = None) -> None:
    """Send the chunks of replicated values this rank read to the other ranks sharing each value, and
    land theirs (blocking; every rank of each value calls it, after reading its own chunks of it).

    The values of each group of ranks go in turn (groups ordered alike on every rank, so that ranks
    in several groups never wait on each other in a circle), their chunks ordered by key, then by
    index; a rank sends what it stored in batches of at most ``receive_bytes`` (default
    :data:`RECEIVE_BYTES`) shared among the others.
    A batch of one chunk of host memory is sent from, and received into, its place; others go through
    a buffer.
    """
    me = ranks.rank
    groups: dict[tuple[int, ...], list[Target]] = {}
    for t in targets:
        shared = t.record.shared
        if shared is not None and len(shared) > 1 and me in shared and t.record.nbytes:
            groups.setdefault(tuple(shared), []).append(t)
    for members in sorted(groups):
        held = sorted(groups[members], key=lambda t: t.record.key)
        limit = max(1, (receive_bytes or RECEIVE_BYTES) // (len(members) - 1))
        batches = {o: _batches([(t, c) for t in held for c in range(len(t.record.chunks)) if t.record.owner(c) == o], limit) for o in members}
        for j in range(max(len(b) for b in batches.values())):
            sends: list[tuple[int, Any]] = []
            receives: list[tuple[int, Any]] = []
            landings: list[Callable[[], None]] = []
            for owner in members:
                if j >= len(batches[owner]):
                    continue
                if owner == me:
                    out = _gathered(batches[owner][j])
                    sends += [(m, out) for m in members if m != me]
                else:
                    into, land = _receiving(batches[owner][j])
                    receives.append((owner, into))
                    landings.append(land)
            ranks.swap(sends, receives)
            for land in landings:
                land()


Piece = tuple[Target, int]  # a target and the index of one chunk of its record


def _batches(pieces: list[Piece], limit: int) -> list[list[Piece]]:
    """``pieces`` in order, in batches of at most ``limit`` bytes (a larger chunk alone)."""
    out: list[list[Piece]] = []
    size = 0
    for piece in pieces:
        length = piece[0].record.chunk_span(piece[1])[1]
        if not out or size + length > limit:
            out.append([])
            size = 0
        out[-1].append(piece)
        size += length
    return out


def _bytes(piece: Piece) -> torch.Tensor:
    """The chunk's decoded bytes in its target: host memory, or a CUDA template's."""
    t, c = piece
    start, length = t.record.chunk_span(c)
    if t.cuda_bytes is not None:
        return t.cuda_bytes[start : start + length]
    return torch.frombuffer(t.out, dtype=torch.uint8, count=length, offset=start)


def _gathered(batch: list[Piece]) -> torch.Tensor:
    """The batch's bytes in one CPU tensor (the chunk's own bytes when it is one, in host memory)."""
    pieces = [_bytes(p) for p in batch]
    if len(pieces) == 1 and not pieces[0].is_cuda:
        return pieces[0]
    return torch.cat([p.cpu() for p in pieces])


def _receiving(batch: list[Piece]) -> tuple[torch.Tensor, Callable[[], None]]:
    """A CPU tensor to receive the batch into, and what lands it afterwards (nothing when it is the
    chunk's own place)."""
    pieces = [_bytes(p) for p in batch]
    if len(pieces) == 1 and not pieces[0].is_cuda:
        return pieces[0], lambda: None
    into = torch.empty(sum(p.numel() for p in pieces), dtype=torch.uint8)

    def land() -> None:
        offset = 0
        for p in pieces:
            p.copy_(into[offset : offset + p.numel()])
            offset += p.numel()

    return into, land
