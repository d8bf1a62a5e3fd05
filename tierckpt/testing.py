"""Fakes for tests, yours and ours: slow, gated and faulty tiers (all real filesystem tiers), and a clock.

Pass the tiers through ``Checkpointer(config, tier_factory=...)``::

    from tierckpt.testing import faulty, slow
    ckpt = Checkpointer(config, tier_factory=slow({"pfs": 0.5}))          # every pfs write takes 0.5 s longer
    ckpt = Checkpointer(config, tier_factory=faulty({"nvme": {3, 4}}))   # writes of steps 3 and 4 fail on nvme

and a :class:`ManualClock` through ``Checkpointer(config, clock=...)`` to test ``min_interval``,
``max_staleness`` and ``keep.within`` without waiting for them.
"""

from __future__ import annotations

import asyncio
import errno
import threading
from typing import Callable, Collection, Mapping

from tierckpt.config import TierConfig
from tierckpt.tiers.base import Staged, Tier, VersionSource
from tierckpt.tiers.filesystem import FilesystemTier


class SlowTier(FilesystemTier):
    """A filesystem tier whose every write takes ``delay_s`` longer, plus its bytes over ``bytes_per_s``.

    The wait comes before the real write and does not block the engine; the flusher holds its lease on
    the version above meanwhile, as it would during a slow write.
    """

    def __init__(self, config: TierConfig, delay_s: float = 0.0, *, bytes_per_s: float | None = None) -> None:
        super().__init__(config)
        self.delay_s = delay_s
        self.bytes_per_s = bytes_per_s
        self.writes_started = 0

    async def write(self, source: VersionSource) -> Staged:
        self.writes_started += 1
        delay = self.delay_s
        if self.bytes_per_s:
            delay += sum(record.nbytes for record in source.records) / self.bytes_per_s
        await asyncio.sleep(delay)
        return await super().write(source)


class GatedTier(FilesystemTier):
    """A filesystem tier whose writes wait until ``gate`` is set: a tier as slow as the test wants.

    ``started`` is set when a write begins; ``steps`` lists the steps whose write began, in order. A
    write still waiting after ``deadline_s`` fails (a guard against a test that never opens the gate).
    """

    def __init__(self, config: TierConfig, deadline_s: float = 60.0) -> None:
        super().__init__(config)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.steps: list[int] = []
        self.deadline_s = deadline_s

    async def write(self, source: VersionSource) -> Staged:
        self.steps.append(source.step)
        self.started.set()
        opened = await asyncio.get_running_loop().run_in_executor(None, self.gate.wait, self.deadline_s)
        if not opened:
            raise TimeoutError(f"tier {self.name!r}: the test never opened the gate")
        return await super().write(source)


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


class FaultyTier(FilesystemTier):
    """A filesystem tier whose write of a step in ``fail_on`` fails with ``error`` (default ENOSPC).

    ``fail_on`` may also be a predicate on the step. The failure comes after the version was written
    under its temporary name and before the rename, so cleanup of the temporary directory is exercised.
    """

    def __init__(
        self,
        config: TierConfig,
        fail_on: Collection[int] | Callable[[int], bool],
        error: Callable[[], BaseException] | None = None,
    ) -> None:
        super().__init__(config)
        self._fails = fail_on if callable(fail_on) else (lambda step, steps=frozenset(fail_on): step in steps)
        self._error = error or (lambda: OSError(errno.ENOSPC, "No space left on device (injected)"))

    async def commit(self, staged: Staged) -> object:  # type: ignore[override]
        if self._fails(staged.step):
            await self.abort(staged)
            raise self._error()
        return await super().commit(staged)


def slow(delays: Mapping[str, float], *, bytes_per_s: Mapping[str, float] | None = None) -> Callable[[TierConfig], Tier | None]:
    """A ``tier_factory`` making the named filesystem tiers slow: a delay per write, and a bandwidth."""
    rates = dict(bytes_per_s or {})

    def make(cfg: TierConfig) -> Tier | None:
        if cfg.name not in delays and cfg.name not in rates:
            return None
        return SlowTier(cfg, delays.get(cfg.name, 0.0), bytes_per_s=rates.get(cfg.name))

    return make


def faulty(fail_on: Mapping[str, Collection[int] | Callable[[int], bool]]) -> Callable[[TierConfig], Tier | None]:
    """A ``tier_factory`` making the named filesystem tiers fail on the given steps."""
    return lambda cfg: FaultyTier(cfg, fail_on[cfg.name]) if cfg.name in fail_on else None
