"""One version's bytes between two ranks, over the bulk gloo group (:meth:`RankGroup.bulk_group`).

A copy is laid out as a one-process version of the filesystem format: one data file, each record's
chunks back to back from a 4 KiB boundary, stored as they are in the source (compressed chunks stay
compressed), and a manifest with every chunk's checksum. Both sides walk the records in the same
order, so every chunk is one send matched by one receive, straight from the source's memory into the
receiver's data file mapped in RAM: no bounce buffer on either side.

Gloo's send returns only once the receiver has posted the matching receive, so a sender never runs
ahead of the receiver's memory; every call gives up after the group's timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import warnings
from typing import Any, Awaitable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from tierckpt._buffers import aligned_buffer, align_up
from tierckpt.format import ALIGN, DATA_FILE, Chunk, TensorRecord, checksum
from tierckpt.tiers.base import VersionSource
from tierckpt.storage.scratch import scratch_bytes

TAG_COPY = 1  # an owner's snapshot to the peers holding it, while training runs
TAG_FETCH = 2  # a held copy back to its owner, in a restore

COPY_FILE = DATA_FILE.format(rank=0)


class Throttle:
    """Keeps the bytes sent through it under ``rate`` bytes per second (None: no limit).

    Paces from the first byte on: after each send it sleeps until the bytes so far are due, so the
    average rate over any copy stays under the cap while no single send is split.
    """

    def __init__(self, rate: int | None, clock: Any = time.monotonic, sleep: Any = time.sleep) -> None:
        self.rate = rate
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._start: float | None = None
        self._sent = 0
        self.slept_s = 0.0  # time spent waiting for the cap, so far

    def begin(self) -> None:
        """A new copy starts: pacing restarts from now (an idle gap is no credit for a burst)."""
        with self._lock:
            self._start, self._sent = None, 0

    def spent(self, nbytes: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            now = self._clock()
            if self._start is None:
                self._start = now
            self._sent += nbytes
            delay = self._start + self._sent / self.rate - now
        if delay > 0:
            self.slept_s += delay
            self._sleep(delay)


def relocate(records: Sequence[TensorRecord]) -> tuple[tuple[TensorRecord, ...], int]:
    """``records`` laid out in a copy's data file; (records, data file size). Checksums are -1 until sent."""
    offset = 0
    out = []
    for r in records:
        offset = align_up(offset, ALIGN)
        chunks = []
        for c in r.chunks:
            if c is None:  # cannot happen for a rank's own snapshot: it holds every chunk it saved
                raise ValueError(f"{r.key}: a chunk this rank does not hold cannot be copied")
            chunks.append(Chunk(offset, c.stored, -1, codec=c.codec))
            offset += c.stored
        out.append(dataclasses.replace(r, file=COPY_FILE, chunks=tuple(chunks), shared=None, saved_shared=None))
    return tuple(out), offset


def with_checksums(records: Sequence[TensorRecord], sums: Sequence[int]) -> tuple[TensorRecord, ...]:
    """``records`` with the checksums :func:`send_copy` returned, in chunk order."""
    it = iter(sums)
    return tuple(dataclasses.replace(r, chunks=tuple(dataclasses.replace(c, checksum=next(it)) for c in r.all_chunks())) for r in records)


def _bytes_tensor(view: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only view is only ever sent from, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


class TransferError(RuntimeError):
    """A transfer to or from ``rank`` (a global rank) broke off: that rank died, or the link did."""

    def __init__(self, rank: int, cause: BaseException) -> None:
        # Gloo's messages run to several lines of advice; the first says what happened.
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
        super().__init__(f"the transfer with rank {rank} broke off: {first}")
        self.rank = rank


def _finish(work: Any) -> None:
    if work is None:  # torch returns no handle to a rank outside ``group``: nothing was transferred
        raise RuntimeError("this rank is not a member of the transfer group")
    work.wait()


def send(view: memoryview, dst: int, group: Any, tag: int) -> None:
    if view.nbytes:
        try:
            _finish(dist.isend(_bytes_tensor(view), dst, group=group, tag=tag))
        except RuntimeError as exc:  # gloo's errors (a closed connection, a timeout) are RuntimeErrors
            raise TransferError(dst, exc) from exc


def receive(view: memoryview, src: int, group: Any, tag: int) -> None:
    if view.nbytes:
        try:
            _finish(dist.irecv(_bytes_tensor(view), src, group=group, tag=tag))
        except RuntimeError as exc:
            raise TransferError(src, exc) from exc


class CopyFailed(RuntimeError):
    """Some or all of a copy's destinations did not get it: ``failed`` maps each to why."""

    def __init__(self, failed: dict[int, BaseException]) -> None:
        super().__init__("; ".join(f"rank {dst}: {why}" for dst, why in sorted(failed.items())))
        self.failed = failed


def send_copy(source: VersionSource, dsts: Sequence[int], group: Any, tag: int, throttle: Throttle) -> list[int]:
    """Send every stored chunk of ``source`` to each of ``dsts`` (global ranks), in record order;
    returns each chunk's checksum, hashed here unless the source knows it already (blocking).

    Every destination that is still there gets every chunk the announcement promised, whatever fails:
    a destination whose transfer broke is dropped and the others go on, and a chunk the source cannot
    read goes out as zeros (its checksum will not match, so no peer acknowledges the copy). A
    receiver thus never waits for a chunk that will not come, or takes the next copy's chunk for one
    of this copy's. Raises :class:`CopyFailed` at the end if anything failed.
    """
    sums: list[int] = []
    scratch: Any = None
    live = list(dsts)
    failed: dict[int, BaseException] = {}
    broken: BaseException | None = None  # the source's error: every chunk from there on is zeros
    for r in source.records:
        for i, c in enumerate(r.chunks):
            assert c is not None
            if scratch is None or len(scratch) < scratch_bytes(r.chunk_bytes):
                scratch = aligned_buffer(scratch_bytes(r.chunk_bytes))
            if broken is None:
                try:
                    view = source.read_stored(r, i, memoryview(scratch))[: c.stored]
                    known = source.checksum_of(r, i)
                    sums.append(checksum(view) if known is None else known)
                except Exception as exc:
                    broken = exc
            if broken is not None:
                view = memoryview(scratch)[: c.stored]
                view[:] = bytes(c.stored)
                sums.append(-1)
            for dst in list(live):
                try:
                    send(view, dst, group, tag)
                except TransferError as exc:
                    live.remove(dst)
                    failed[dst] = exc
                throttle.spent(view.nbytes)
    if broken is not None:
        failed.update({dst: broken for dst in live})
    if failed:
        raise CopyFailed(failed)
    return sums


async def transfers(fetch: Awaitable[Any] | None, serves: Sequence[Awaitable[Any]]) -> tuple[Any, list[BaseException]]:
    """Run this rank's fetch (None: it fetches nothing) and what it serves at once, to the end of all:
    a failed serve never stops the fetch, nor the other serves. Returns the fetch's result, or its
    exception (None without a fetch), and the serves' exceptions."""
    results = await asyncio.gather(*([fetch] if fetch is not None else []), *serves, return_exceptions=True)
    skip = 1 if fetch is not None else 0
    failed = [r for r in results[skip:] if isinstance(r, BaseException)]
    return (results[0] if fetch is not None else None), failed


def drain(sizes: Sequence[int], src: int, group: Any, tag: int) -> None:
    """Receive and drop chunks of these sizes: a copy this rank cannot keep still has to be taken off
    the wire, or the next copy's first chunks would land in its place."""
    scratch = memoryview(aligned_buffer(max(sizes, default=0)))
    for size in sizes:
        receive(scratch[:size], src, group, tag)


def receive_copy(data: memoryview, records: Sequence[TensorRecord], src: int, group: Any, tag: int) -> None:
    """Receive what :func:`send_copy` sends for ``records`` (relocated) into ``data``, the copy's data file."""
    for r in records:
        for c in r.chunks:
            assert c is not None
            receive(data[c.offset : c.offset + c.stored], src, group, tag)


def send_sums(sums: Sequence[int], dst: int, group: Any, tag: int) -> None:
    """Send the checksums :func:`send_copy` returned, after the chunks: a chunk whose checksum its
    sender knew only once it hashed it on the way out is verified end to end all the same."""
    send(np.array(sums, dtype=np.uint64).data.cast("B"), dst, group, tag)


def receive_sums(count: int, src: int, group: Any, tag: int) -> list[int]:
    """Receive ``count`` checksums :func:`send_sums` sent."""
    out = np.zeros(count, dtype=np.uint64)
    receive(out.data.cast("B"), src, group, tag)
    return [int(v) for v in out]


def first_mismatch(data: memoryview, records: Sequence[TensorRecord]) -> str | None:
    """The first chunk of a received copy whose bytes do not match its checksum, named; None if all do."""
    for r in records:
        for i, c in enumerate(r.chunks):
            assert c is not None
            if checksum(data[c.offset : c.offset + c.stored]) != c.checksum:
                return f"{r.key} chunk {i} (bytes {c.offset}..{c.offset + c.stored})"
    return None
