"""Tiers for tests: real filesystem tiers made slow (:class:`SlowTier`), held at a gate the test opens
(:class:`GatedTier`, :class:`Gates`) or failing on chosen steps (:class:`FaultyTier`), and the
``tier_factory`` helpers :func:`slow` and :func:`faulty` that put them in a Checkpointer.
"""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from typing import Callable, Collection, Mapping


from tierckpt.config import TierConfig
from tierckpt.format.source import VersionSource
from tierckpt.tiers.base import Staged, Tier
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

    async def write(self, source: VersionSource, staging: str | None = None) -> Staged:
        self.writes_started += 1
        delay = self.delay_s
        if self.bytes_per_s:
            delay += sum(record.nbytes for record in source.records) / self.bytes_per_s
        await asyncio.sleep(delay)
        return await super().write(source, staging)


class _Gate(threading.Event):
    """An event that also wakes the writes waiting on its tier's condition when it is set."""

    def __init__(self, changed: threading.Condition) -> None:
        super().__init__()
        self._changed = changed

    def set(self) -> None:
        super().set()
        with self._changed:
            self._changed.notify_all()


class GatedTier(FilesystemTier):
    """A filesystem tier whose writes wait until ``gate`` is set: a tier as slow as the test wants.

    ``allow(n)`` lets the next ``n`` writes through while the gate stays closed, so a test decides when
    each write ends. ``started`` is set when a write begins; ``steps`` lists the steps whose write
    began, in order, and ``sources`` the tier each of them was read from; ``waiting`` counts the writes
    at the gate now (a write is counted off the moment it passes), ``parked()`` those of them no permit
    lets through yet. A write still waiting after ``deadline_s`` fails (a guard against a test that
    never opens the gate).
    """

    def __init__(self, config: TierConfig, deadline_s: float = 60.0) -> None:
        super().__init__(config)
        self._changed = threading.Condition()
        self._permits = 0
        self.gate: threading.Event = _Gate(self._changed)
        self.started = threading.Event()
        self.steps: list[int] = []
        self.sources: list[str | None] = []
        self.waiting = 0
        self.deadline_s = deadline_s

    def allow(self, writes: int = 1) -> None:
        """Let the next ``writes`` writes through (those waiting first), the gate staying as it is."""
        with self._changed:
            self._permits += writes
            self._changed.notify_all()

    def parked(self) -> int:
        """Writes waiting at the gate that no permit lets through yet (0 while the gate is open)."""
        with self._changed:
            return 0 if self.gate.is_set() else max(0, self.waiting - self._permits)

    def _pass(self) -> bool:
        deadline = time.monotonic() + self.deadline_s
        with self._changed:
            try:
                while not self.gate.is_set():
                    if self._permits:
                        self._permits -= 1
                        return True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._changed.wait(left)
                return True
            finally:
                # Here, the moment it passes: counted down later (on the engine loop), a write already
                # through would still look parked, and a test would give it a second permit.
                self.waiting -= 1

    async def write(self, source: VersionSource, staging: str | None = None) -> Staged:
        self.steps.append(source.step)
        self.sources.append(source.tier)
        self.started.set()
        with self._changed:
            self.waiting += 1
        opened = await asyncio.get_running_loop().run_in_executor(None, self._pass)
        if not opened:
            raise TimeoutError(f"tier {self.name!r}: the test never opened the gate")
        return await super().write(source, staging)


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


class Gates:
    """A ``tier_factory`` making the named tiers :class:`GatedTier`: ``gates[name]`` is the tier made,
    ``open_all()`` opens every gate (do that before closing the Checkpointer, or its close waits on a
    closed gate)::

        gates = Gates("pfs")
        ckpt = Checkpointer(config, tier_factory=gates)
        handle = ckpt.save_sync(1, state)
        gates["pfs"].started.wait()      # pfs is writing step 1, and stays so
        gates["pfs"].allow(1)            # ... until now
    """

    def __init__(self, *names: str, deadline_s: float = 60.0) -> None:
        self.names = names
        self.deadline_s = deadline_s
        self.tiers: dict[str, GatedTier] = {}

    def __call__(self, config: TierConfig) -> GatedTier | None:
        if config.name not in self.names:
            return None
        self.tiers[config.name] = GatedTier(config, deadline_s=self.deadline_s)
        return self.tiers[config.name]

    def __getitem__(self, name: str) -> GatedTier:
        return self.tiers[name]

    def open_all(self) -> None:
        for tier in self.tiers.values():
            tier.gate.set()


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
