"""Small chunks of an object read together: one ranged GET for neighbours instead of one each.

A GET costs the same few milliseconds whether it returns 4 KiB or 1 MiB (3.5 and 3.8 ms against the
local SeaweedFS here; a cloud store's first-byte latency is tens of ms), so a model's many small
tensors (norms, biases: half the records of a transformer layer) would spend a restore's time on
round trips. :func:`group_spans` plans, without I/O, which byte ranges to fetch whole; a
:class:`CoalescingReader` serves the chunks inside them from the one GET, each still verified by the
source as it is returned. At most :data:`KEEP` groups are held at once, so memory stays bounded
however many small tensors a version has; a group evicted and asked for again is fetched again.
"""

from __future__ import annotations

import bisect
import collections
import threading
from collections.abc import Iterable

from tierckpt._buffers import copy_bytes
from tierckpt.storage.store import ObjectReader

__all__ = ["CoalescingReader", "group_spans"]

SMALL = 1 << 20  # a chunk below this is read with its neighbours
GROUP = 8 << 20  # at most this many bytes in one grouped GET
GAP = 64 << 10  # bytes between two small chunks fetched along rather than split the GET there
KEEP = 16  # groups held at once


def group_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges ``(start, end)`` to fetch whole, from the ``(offset, length)`` of the chunks to read:
    small chunks at most :data:`GAP` apart, up to :data:`GROUP` bytes; a group of one is left out.

    >>> group_spans([(0, 4096), (4096, 4096), (1 << 30, 4096), (16384, 4 << 20)])
    [(0, 8192)]
    """
    groups: list[list[int]] = []  # [start, end, members]
    for start, end in sorted((o, o + n) for o, n in spans if 0 < n < SMALL):
        last = groups[-1] if groups else None
        if last is not None and start - last[1] <= GAP and max(last[1], end) - last[0] <= GROUP:
            last[1], last[2] = max(last[1], end), last[2] + 1
        else:
            groups.append([start, end, 1])
    return [(start, end) for start, end, members in groups if members > 1]


class _Fetch:
    """One group's GET: the first thread to ask fetches it, the others wait for its bytes."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.data: memoryview | None = None
        self.error: BaseException | None = None


class CoalescingReader(ObjectReader):
    """``inner``'s ranges, the small chunks inside ``groups`` served from one GET per group."""

    def __init__(self, inner: ObjectReader, groups: list[tuple[int, int]]) -> None:
        self.inner = inner
        self.size = inner.size
        self.groups = groups
        self._starts = [start for start, _ in groups]
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[int, _Fetch] = collections.OrderedDict()

    @property
    def direct(self) -> bool:
        return self.inner.direct

    def _group(self, offset: int, length: int) -> int | None:
        i = bisect.bisect_right(self._starts, offset) - 1
        if i >= 0 and offset + length <= self.groups[i][1]:
            return i
        return None

    def _fetched(self, i: int, scratch: memoryview, what: str) -> memoryview:
        with self._lock:
            fetch = self._held.get(i)
            owner = fetch is None
            if fetch is None:
                fetch = self._held[i] = _Fetch()
            self._held.move_to_end(i)
            while len(self._held) > KEEP:
                oldest = next(iter(self._held))
                if not self._held[oldest].done.is_set():
                    break  # still being fetched: its waiters need it
                del self._held[oldest]
        if owner:
            start, end = self.groups[i]
            try:
                fetch.data = self.inner.read_span(start, end - start, memoryview(bytearray(0)), what=what)
            except BaseException as exc:
                fetch.error = exc
                with self._lock:
                    self._held.pop(i, None)  # asked for again, it is fetched again
                raise
            finally:
                fetch.done.set()
        fetch.done.wait()
        if fetch.error is not None:
            raise fetch.error
        assert fetch.data is not None
        return fetch.data

    def read_span(self, offset: int, length: int, scratch: memoryview, *, what: str) -> memoryview:
        i = self._group(offset, length)
        if i is None:
            return self.inner.read_span(offset, length, scratch, what=what)
        at = offset - self.groups[i][0]
        return self._fetched(i, scratch, what)[at:at + length]

    def read_into(self, out: memoryview, offset: int, scratch: memoryview, *, what: str) -> None:
        i = self._group(offset, out.nbytes)
        if i is None:
            self.inner.read_into(out, offset, scratch, what=what)
            return
        at = offset - self.groups[i][0]
        copy_bytes(out.cast("B"), self._fetched(i, scratch, what)[at:at + out.nbytes].cast("B"))

    def close(self) -> None:
        with self._lock:
            self._held.clear()
        self.inner.close()
