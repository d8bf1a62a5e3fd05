"""What a rank asks of its group's store, and its collectives: counted by kind and key family, with
bytes (``benchmarks/scale.py`` and :mod:`tierckpt.testing.simranks` read it)."""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["StoreTally"]


@dataclass
class StoreTally:
    """What one rank asked of the store so far: requests by kind (the store's method names, ``wait``
    for a blocking wait), and by kind and key family (``set tier/#/report/#/#``: the key of the
    request, or its first, with numbers as ``#``), the bytes sent and received (keys and values), the
    largest single message. ``benchmarks/scale.py`` reads it to count what a save costs the coordinator."""

    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    by_key: collections.Counter[str] = field(default_factory=collections.Counter)
    sent: int = 0
    received: int = 0
    largest: int = 0

    def record(self, method: str, args: Sequence[Any], result: Any = None) -> None:
        sent, received = _size(args), _size(result)
        self.requests[method] += 1
        first = args[0] if args else ""
        first = first[0] if isinstance(first, list) and first else first
        self.by_key[f"{method} {_DIGITS.sub('#', first) if isinstance(first, str) else ''}"] += 1
        self.sent += sent
        self.received += received
        self.largest = max(self.largest, sent, received)

    def answer(self, result: Any) -> None:
        """The answer to a request recorded before it came (a blocking wait or read)."""
        received = _size(result)
        self.received += received
        self.largest = max(self.largest, received)

    def copy(self) -> StoreTally:
        return StoreTally(collections.Counter(self.requests), collections.Counter(self.by_key), self.sent, self.received, self.largest)


_DIGITS = re.compile(r"\d+")


def _size(value: Any) -> int:
    """The bytes of a store call's arguments or result: keys, values, and lists of them."""
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (bytes, str)) for v in (value[0], value[-1])):
            try:
                return sum(map(len, value))  # keys or values: the common case, and 10,000 long at scale
            except TypeError:
                pass
        return sum(_size(v) for v in value)
    return 8 if isinstance(value, int) else 0
