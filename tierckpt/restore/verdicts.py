"""How a restore says what it passed over, and what it raises when nothing is left.

One process (:class:`AloneVoice`) names each copy that did not verify and the candidate it tries
next ("step 2 on tier 'nvme' does not verify: ...; trying step 2 on tier 'pfs' next"). Several
ranks (:class:`RanksVoice`) say it once per step, after they exchanged their verdicts: the ranks
whose part failed, and the step they all fall back to. The fallback itself is the same loop for
both (:mod:`tierckpt.restore.fallback`).

Warnings go to the ``tierckpt`` logger only, once per event, never also through
:func:`warnings.warn` (the package's rule, in :mod:`tierckpt.errors`): a restore that falls back
went on and returned a version, so it is an event for the operator's log, not a fault in the
caller's code; and Python's warning filters would show it once per process (or raise it in the
middle of the fallback under ``-W error``).
"""

from __future__ import annotations

import abc
import logging
from typing import Callable, Sequence

from tierckpt.errors import CorruptCheckpointError, NoCheckpointError
from tierckpt.format.layout import after_where, where
from tierckpt.format.saved_layout import NotHere
from tierckpt.restore.result import held_steps, overwritten
from tierckpt.tiers.base import Tier

__all__ = ["AloneVoice", "RanksVoice", "Voice"]

log = logging.getLogger("tierckpt")


class Voice(abc.ABC):
    """What a restore of step ``only`` (None: the newest that verifies) says; ``listed``: the tiers an
    error names what they hold (all of them, also when the restore reads one)."""

    def __init__(self, only: int | None, listed: Sequence[Tier]) -> None:
        self.only, self.listed = only, listed

    @abc.abstractmethod
    def not_held(self, step: int, lacking: list[int]) -> NoCheckpointError:
        """Step ``step`` was asked for, and ranks ``lacking`` can get it from no tier."""

    def passed_over(self, tier: Tier, step: int, error: CorruptCheckpointError, after: Callable[[], str], *, elsewhere: bool) -> None:  # noqa: B027
        """This rank's copy of ``step`` on ``tier`` did not verify; ``after``: what is tried next;
        ``elsewhere``: that is the same step on another tier."""

    def not_here(self, error: NotHere, after: Callable[[], str]) -> None:  # noqa: B027
        """A tier holds only part of what this rank needs of a version (one process's host memory)."""

    def fetch_failed(self, error: CorruptCheckpointError, then: Sequence[Tier]) -> None:  # noqa: B027
        """A copy a tier fetched from other ranks did not arrive whole; ``then``: the tiers left."""

    @abc.abstractmethod
    def step_failed(self, step: int, failed: dict[int, str], later: Sequence[int], touched: set[str], touched_ranks: set[int]) -> None:
        """Step ``step`` did not verify on ranks ``failed`` (rank: why); ``later``: the steps left to try.
        Raises when it was the one step asked for."""

    def only_abandoned(self, steps: Sequence[int]) -> NoCheckpointError:
        """No version of the direction being trained restored, and versions a rollback abandoned
        (``steps``, newest first) are held: the caller chooses, as starting over would let retention
        delete them."""
        shown = ", ".join(map(str, steps[:8])) + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")
        return NoCheckpointError(
            f"no version of the direction being trained can be restored, and versions a rollback abandoned are held "
            f"(step(s) {shown}; {held_steps(self.listed)}): restore(step) loads one of them, and training on from it makes "
            f"its direction live again; to start over, remove them first (tierckpt ls lists them as abandoned)",
            step=steps[0],
        )

    @abc.abstractmethod
    def none_verified(self, touched: set[str], touched_ranks: set[int]) -> CorruptCheckpointError | None:
        """No step verified: the error to raise when the failed copies wrote into a template, else None."""


class AloneVoice(Voice):
    """One process: a warning per copy passed over, naming the candidate tried next."""

    def __init__(self, only: int | None, listed: Sequence[Tier]) -> None:
        super().__init__(only, listed)
        self.failures: list[str] = []

    def not_held(self, step: int, lacking: list[int]) -> NoCheckpointError:
        return NoCheckpointError(f"no tier holds step {step} ({held_steps(self.listed)})", step=step)

    def passed_over(self, tier: Tier, step: int, error: CorruptCheckpointError, after: Callable[[], str], *, elsewhere: bool) -> None:
        why = after_where(error, tier.name, step)
        self.failures.append(f"tier {tier.name!r}: {why}" if self.only is not None else f"{where(tier.name, step)}: {why}")
        log.warning("tierckpt: %s does not verify: %s; %s", where(tier.name, step), why, after())

    def not_here(self, error: NotHere, after: Callable[[], str]) -> None:
        log.info("tierckpt: %s; %s", error, after())

    def step_failed(self, step: int, failed: dict[int, str], later: Sequence[int], touched: set[str], touched_ranks: set[int]) -> None:
        if self.only is None:
            return  # each copy passed over was named as it failed
        if not self.failures:  # every copy left the tiers after they were listed
            raise self.not_held(step, [0])
        written = f"; {overwritten(touched)}" if touched else ""
        raise CorruptCheckpointError(f"step {step}: no copy verifies ({'; '.join(self.failures)}){written}", step=step)

    def none_verified(self, touched: set[str], touched_ranks: set[int]) -> CorruptCheckpointError | None:
        if not touched:
            return None
        return CorruptCheckpointError(f"no version verifies ({'; '.join(self.failures)}); {overwritten(touched)}")


class RanksVoice(Voice):
    """Several ranks: one warning per step, on every rank, after the ranks exchanged their verdicts."""

    def __init__(self, only: int | None, listed: Sequence[Tier], rank: int) -> None:
        super().__init__(only, listed)
        self.rank = rank

    def not_held(self, step: int, lacking: list[int]) -> NoCheckpointError:
        return NoCheckpointError(
            f"step {step} is not held for rank(s) {', '.join(map(str, lacking))} (on rank {self.rank}: {held_steps(self.listed)})",
            step=step,
        )

    def passed_over(self, tier: Tier, step: int, error: CorruptCheckpointError, after: Callable[[], str], *, elsewhere: bool) -> None:
        # A copy this rank passes over for the same step on another tier is named here, by this rank
        # alone: no verdict will (the step may verify). Else the step's verdict names it, once.
        if elsewhere:
            log.warning("tierckpt: rank %d: %s does not verify: %s; %s", self.rank, where(tier.name, step), after_where(error, tier.name, step), after())

    def fetch_failed(self, error: CorruptCheckpointError, then: Sequence[Tier]) -> None:
        if then:
            log.warning("tierckpt: %s; trying tier(s) %s next", error, ", ".join(repr(t.name) for t in then))
        else:
            log.warning("tierckpt: %s; no other tier of this rank holds it", error)

    def step_failed(self, step: int, failed: dict[int, str], later: Sequence[int], touched: set[str], touched_ranks: set[int]) -> None:
        verdict = (
            f"step {step} does not verify on rank(s) {', '.join(map(str, failed))} "
            f"({'; '.join(f'rank {r}: {why}' for r, why in failed.items())})"
        )
        if self.only is not None:  # that step or nothing: every rank raises the same
            raise CorruptCheckpointError(verdict + (f"; {overwritten(_ranks(touched_ranks))}" if touched_ranks else ""), step=step)
        older = f"every rank falls back to step {later[0]}" if later else "no older step is held for every rank"
        log.warning("tierckpt: %s; %s", verdict, older)

    def none_verified(self, touched: set[str], touched_ranks: set[int]) -> CorruptCheckpointError | None:
        if not touched_ranks:
            return None
        return CorruptCheckpointError(f"no step verifies on every rank; {overwritten(_ranks(touched_ranks))}")


def _ranks(ranks: set[int]) -> str:
    return f"rank(s) {', '.join(map(str, sorted(ranks)))}"
