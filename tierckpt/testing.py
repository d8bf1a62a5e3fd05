"""Fakes for tests, yours and ours: a slow tier and a faulty tier, both real filesystem tiers.

Pass them through ``Checkpointer(config, tier_factory=...)``::

    from tierckpt.testing import faulty, slow
    ckpt = Checkpointer(config, tier_factory=slow({"pfs": 0.5}))          # every pfs write takes 0.5 s longer
    ckpt = Checkpointer(config, tier_factory=faulty({"nvme": {3, 4}}))   # writes of steps 3 and 4 fail on nvme
"""

from __future__ import annotations

import asyncio
import errno
from typing import Callable, Collection, Mapping

from tierckpt.config import TierConfig
from tierckpt.tiers.base import Staged, Tier, VersionSource
from tierckpt.tiers.filesystem import FilesystemTier


class SlowTier(FilesystemTier):
    """A filesystem tier whose every write takes ``delay_s`` longer (without blocking the engine)."""

    def __init__(self, config: TierConfig, delay_s: float) -> None:
        super().__init__(config)
        self.delay_s = delay_s
        self.writes_started = 0

    async def write(self, source: VersionSource) -> Staged:
        self.writes_started += 1
        await asyncio.sleep(self.delay_s)
        return await super().write(source)


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


def slow(delays: Mapping[str, float]) -> Callable[[TierConfig], Tier | None]:
    """A ``tier_factory`` making the named filesystem tiers slow."""
    return lambda cfg: SlowTier(cfg, delays[cfg.name]) if cfg.name in delays else None


def faulty(fail_on: Mapping[str, Collection[int] | Callable[[int], bool]]) -> Callable[[TierConfig], Tier | None]:
    """A ``tier_factory`` making the named filesystem tiers fail on the given steps."""
    return lambda cfg: FaultyTier(cfg, fail_on[cfg.name]) if cfg.name in fail_on else None
