"""Chunks of an object read through a few large GETs instead of one GET each.

A GET costs the same few milliseconds whether it returns 4 KiB or 1 MiB (3.5 and 3.8 ms against the
local SeaweedFS here; a cloud store's first-byte latency is tens of ms), and its cost on the server
depends on where it starts and ends: against the benchmark's 1 GiB state (219 chunks of 0.01-16 MiB),
GETs of fixed 16 MiB windows of the data object took 0.94 s (65 GETs), GETs along chunk boundaries
grouped up to 16 MiB 1.11 s (88 GETs), one GET per chunk 1.13 s and more (158 GETs, small chunks
grouped).

Two plans, made without I/O:

- :func:`window_spans`, where every chunk is read (a restore of the saved layout): the object in
  fixed windows of :data:`GROUP` bytes, the GETs the raw client makes. A chunk across a window's edge
  is served in two pieces (:meth:`CoalescingReader.read_pieces`), which the source hashes one after
  the other and copies to where they land; only a caller that needs one buffer gets them joined.
- :func:`group_spans`, where only some chunks are read (a reshard): neighbouring chunks under
  :data:`SMALL`, at most :data:`GAP` apart, up to :data:`GROUP` bytes together, so that a GET fetches
  little that nothing reads; the other chunks are a GET each.

A :class:`CoalescingReader` serves the chunks inside the planned ranges from one GET per range, each
chunk still verified by the source as it is returned. A range is let go once each chunk in it was
served, and at most :data:`KEEP` are held at once, so memory stays bounded however a version is
laid out; a range let go and asked for again is fetched again. With ``ahead`` (the window plan), a
thread that would wait for a range another thread is fetching fetches the next range nobody asked
for yet instead, so that as many GETs are in flight as there are threads even when many chunks share
a window (on a cloud store, each connection moves only so much).
"""

from __future__ import annotations

import bisect
import collections
import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from tierckpt._buffers import copy_pieces
from tierckpt.storage.store import RangeReader

__all__ = ["GROUP", "SMALL", "CoalescingReader", "Group", "group_spans", "window_spans"]

GROUP = 16 << 20  # bytes in one window, and at most in one group
SMALL = 1 << 20  # where only some chunks are read, only chunks below this are grouped
GAP = 64 << 10  # bytes between two chunks fetched along rather than split the GET there
KEEP = 16  # ranges held at once
AHEAD = KEEP // 2  # how many ranges past its own a waiting thread fetches ahead, at most


class Group(NamedTuple):
    """Bytes ``[start, end)`` of an object, fetched whole, holding (pieces of) ``members`` chunk spans."""

    start: int
    end: int
    members: int


def window_spans(spans: Iterable[tuple[int, int]], window: int = GROUP) -> list[Group]:
    """The object's fixed windows ``[k * window, (k + 1) * window)`` that hold bytes of the chunks
    ``(offset, length)``, each cut to those bytes; a chunk across an edge counts in both windows.

    >>> window_spans([(0, 10), (10, 20), (30, 5)], window=16)
    [Group(start=0, end=16, members=2), Group(start=16, end=32, members=2), Group(start=32, end=35, members=1)]
    """
    found: dict[int, list[int]] = {}  # window index -> [start, end, members]
    for offset, length in spans:
        end = offset + length
        for k in range(offset // window, -(-end // window)) if length > 0 else ():
            lo, hi = max(offset, k * window), min(end, (k + 1) * window)
            got = found.get(k)
            if got is None:
                found[k] = [lo, hi, 1]
            else:
                got[0], got[1], got[2] = min(got[0], lo), max(got[1], hi), got[2] + 1
    return [Group(*found[k]) for k in sorted(found)]


def group_spans(spans: Iterable[tuple[int, int]], below: int = GROUP) -> list[Group]:
    """The ranges to fetch whole, from the ``(offset, length)`` of the chunks to read: neighbours
    under ``below`` bytes each, at most :data:`GAP` apart, up to :data:`GROUP` bytes together; a
    group of one is left out. ``below``: :data:`SMALL` where only some of the chunks will be read.

    >>> group_spans([(0, 4096), (4096, 4096), (1 << 30, 4096), (16384, 4 << 20)])
    [Group(start=0, end=4210688, members=3)]
    """
    groups: list[list[int]] = []  # [start, end, members]
    for start, end in sorted((o, o + n) for o, n in spans if 0 < n < below):
        last = groups[-1] if groups else None
        if last is not None and start - last[1] <= GAP and max(last[1], end) - last[0] <= GROUP:
            last[1], last[2] = max(last[1], end), last[2] + 1
        else:
            groups.append([start, end, 1])
    return [Group(start, end, members) for start, end, members in groups if members > 1]


class _Fetch:
    """One range's GET: the first thread to ask fetches it, the others wait for its bytes."""

    def __init__(self, members: int) -> None:
        self.left = members  # chunk spans still to serve from it
        self.done = threading.Event()
        self.data: memoryview | None = None
        self.error: BaseException | None = None


class CoalescingReader(RangeReader):
    """``inner``'s ranges, the chunks inside ``groups`` (sorted, not overlapping) served from one GET
    per group; ``ahead``: waiting threads fetch the next groups (only where every chunk is read)."""

    def __init__(self, inner: RangeReader, groups: list[Group], *, ahead: bool = False) -> None:
        self.inner = inner
        self.size = inner.size
        self.groups = groups
        self._starts = [g.start for g in groups]
        self._ahead = ahead
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[int, _Fetch] = collections.OrderedDict()
        self._started = [False] * len(groups)  # fetched (or being fetched) once: not to fetch ahead again
        self._floor = 0  # no group below it is still unstarted

    @property
    def direct(self) -> bool:
        return self.inner.direct

    def _cover(self, offset: int, length: int) -> range | None:
        """The groups that hold ``[offset, offset + length)`` between them (neighbours with no byte
        between); None when some of it lies outside them."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if length <= 0 or i < 0 or offset >= self.groups[i].end:
            return None
        j = i
        while self.groups[j].end < offset + length:
            if j + 1 == len(self.groups) or self.groups[j + 1].start != self.groups[j].end:
                return None
            j += 1
        return range(i, j + 1)

    def _start(self, i: int) -> _Fetch:
        """Group ``i``'s fetch, new (under the lock): held, newest last, the oldest fetched ones let go
        past :data:`KEEP`."""
        fetch = self._held[i] = _Fetch(self.groups[i].members)
        self._started[i] = True
        while self._floor < len(self._started) and self._started[self._floor]:
            self._floor += 1
        while len(self._held) > KEEP:
            oldest = next(iter(self._held))
            if not self._held[oldest].done.is_set():
                break  # still being fetched: its waiters need it
            del self._held[oldest]
        return fetch

    def _next_unstarted(self, i: int) -> int | None:
        """The first group after ``i`` never fetched, if near enough and there is room (under the lock)."""
        if len(self._held) >= KEEP:
            return None
        j = max(i + 1, self._floor)
        while j < len(self._started) and self._started[j]:
            j += 1
        return j if j < len(self._started) and j - i <= AHEAD else None

    def _fetch(self, i: int, fetch: _Fetch, what: str) -> None:
        """Fetch group ``i`` into ``fetch``; on failure, let it go (asked for again, it is fetched again)."""
        start, end, _ = self.groups[i]
        try:
            fetch.data = self.inner.read_span(start, end - start, memoryview(bytearray(0)), what=what)
        except BaseException as exc:
            fetch.error = exc
            with self._lock:
                if self._held.get(i) is fetch:
                    del self._held[i]
        finally:
            fetch.done.set()

    def _fetched(self, i: int, what: str) -> memoryview:
        """Group ``i``'s bytes (fetched now by this thread, or by another before); counted as one of
        its chunks served: after the last, the group is let go (its bytes stay alive as long as a
        view of them does)."""
        ahead: tuple[int, _Fetch] | None = None
        with self._lock:
            fetch = self._held.get(i)
            owner = fetch is None
            if fetch is None:
                fetch = self._start(i)
            else:
                self._held.move_to_end(i)
                if self._ahead and not fetch.done.is_set():
                    j = self._next_unstarted(i)
                    if j is not None:
                        ahead = (j, self._start(j))
        if ahead is not None:  # rather than wait idle; its failure is for whoever asks for it
            self._fetch(ahead[0], ahead[1], what)
        if owner:
            self._fetch(i, fetch, what)
        fetch.done.wait()
        if fetch.error is not None:
            raise fetch.error
        assert fetch.data is not None
        with self._lock:
            fetch.left -= 1
            if fetch.left <= 0 and self._held.get(i) is fetch:
                del self._held[i]  # every chunk in it served
        return fetch.data

    def _pieces(self, cover: range, offset: int, length: int, what: str) -> list[memoryview]:
        """``[offset, offset + length)`` from the groups ``cover``, a view of each."""
        pieces = []
        for i in cover:
            start, end, _ = self.groups[i]
            data = self._fetched(i, what)
            pieces.append(data[max(offset, start) - start:min(offset + length, end) - start])
        return pieces

    def read_pieces(self, offset: int, length: int, scratch: memoryview, *, what: str) -> Sequence[memoryview]:
        cover = self._cover(offset, length)
        if cover is None:
            return [self.inner.read_span(offset, length, scratch, what=what)]
        return self._pieces(cover, offset, length, what)

    def read_span(self, offset: int, length: int, scratch: memoryview, *, what: str) -> memoryview:
        pieces = self.read_pieces(offset, length, scratch, what=what)
        if len(pieces) == 1:
            return pieces[0]
        out = scratch[:length] if scratch.nbytes >= length else memoryview(bytearray(length))
        copy_pieces(out, pieces)
        return out

    def read_into(self, out: memoryview, offset: int, scratch: memoryview, *, what: str) -> None:
        cover = self._cover(offset, out.nbytes)
        if cover is None:
            self.inner.read_into(out, offset, scratch, what=what)
            return
        copy_pieces(out.cast("B"), self._pieces(cover, offset, out.nbytes, what))

    def close(self) -> None:
        with self._lock:
            self._held.clear()
        self.inner.close()

