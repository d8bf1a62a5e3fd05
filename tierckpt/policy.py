"""What each tier keeps and what it sends further down: pure functions, the clock passed in.

Nothing here does I/O or reads the time, so every rule can be property-tested on its own. Flush
decisions depend only on step numbers, arrival numbers and the injected clock, so ranks that save the
same steps make the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tierckpt.config import FlushPolicy, KeepPolicy


@dataclass(frozen=True)
class Candidate:
    """A version offered to a flusher by the tier above."""

    step: int
    arrival: int  # 1, 2, ...: how many versions the tier above had offered, this one included
    token: int  # identifies the save this version came from (its snapshot's seq)


def flush_eligible(policy: FlushPolicy, step: int, arrival: int) -> bool:
    """Whether a version may go down at all: ``every`` N-th arrival and ``every_steps``."""
    if arrival % policy.every:
        return False
    return policy.every_steps is None or step % policy.every_steps == 0


@dataclass(frozen=True)
class FlushChoice:
    take: Candidate | None  # flush this one now
    wait_s: float | None  # nothing to take yet: look again after this long (None: when something arrives)


def choose_flush(
    pending: Candidate | None,
    policy: FlushPolicy,
    *,
    last_start: float | None,
    now: float,
    drain: bool = False,
) -> FlushChoice:
    """Decide whether the pending (newest eligible) version goes down now.

    ``min_interval`` holds a version back until that long after the previous flush started; a newer
    version arriving meanwhile replaces it (the flusher always takes the newest). ``drain`` (wait/close)
    waives ``min_interval`` so the newest version reaches every tier it is eligible for.
    """
    if pending is None:
        return FlushChoice(None, None)
    if not drain and last_start is not None and policy.min_interval_s > 0:
        remaining = last_start + policy.min_interval_s - now
        if remaining > 0:
            return FlushChoice(None, remaining)
    return FlushChoice(pending, None)


def retain(steps: Sequence[int], policy: KeepPolicy) -> frozenset[int]:
    """The steps a tier keeps: the union of ``last`` and ``every_steps``, always with the newest.

    A policy with no rule keeps everything.
    """
    if not steps:
        return frozenset()
    if policy.last is None and policy.every_steps is None:
        return frozenset(steps)
    ordered = sorted(set(steps))
    keep = {ordered[-1]}
    if policy.last is not None:
        keep.update(ordered[-policy.last :])
    if policy.every_steps is not None:
        keep.update(s for s in ordered if s % policy.every_steps == 0)
    return frozenset(keep)
