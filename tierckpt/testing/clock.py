"""A clock for tests: :class:`ManualClock`, which moves only when told to, so that ``min_interval``,
``max_staleness`` and ``keep.within`` can be tested without waiting for them.
"""

from __future__ import annotations


class ManualClock:
    """A monotonic clock that moves only when told to: ``Checkpointer(config, clock=ManualClock())``.

    The pipeline reads it for ``min_interval``, ``max_staleness`` and, anchored to the wall clock once at
    start, for version creation times and ``keep.within``. A flusher waiting on a timer notices a moved
    clock when it next wakes up: at the next save, or at ``wait()``.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
