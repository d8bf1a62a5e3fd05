"""What each tier keeps and what it sends further down: pure functions, the clock passed in.

Nothing here does I/O or reads a clock, so every rule can be property-tested on its own; the pipeline
only applies these decisions. Flush decisions depend only on step numbers, arrival numbers and the
injected clock, so ranks that save the same steps make the same decisions.

Flushing (one :class:`FlushState` per tier below the first, held by its flusher):

- :func:`offer`: a save was captured (every tier is offered every save: each selects on the stream
  of saves, whatever the other tiers took; a newer save of a step replaces a waiting older save of
  that step, since saving a step again replaces it). ``every``/``every_steps`` make it *eligible*
  (:func:`flush_eligible`). Under ``newest_only`` an eligible version waiting while the tier is busy
  is replaced by a newer eligible one, and a version older than one already taken is passed over
  (PCheck). With ``newest_only: false`` eligible versions queue, oldest save first, and each goes down.
  With ``max_staleness`` set, the newest version offered is also held, eligible or not, as the
  *fallback* for when the tier falls overdue; any newer version replaces it.
- :func:`choose_flush`: the first queued version goes down once ``min_interval`` has passed since the
  previous flush *started* and no host copy is running. When ``max_staleness`` has passed since the
  start of the tier's last *successful* flush, the tier is overdue: the queued version goes down even
  beside a running host copy, and with nothing queued the fallback goes down, whatever ``every`` and
  ``every_steps`` say. ``min_interval`` still spaces starts (config forbids a ``max_staleness`` shorter
  than it, so it only bites right after a failed flush). ``wait()``/``close()`` waive ``min_interval``.

  Why staleness is timed from the *start* of the last successful flush: that flush took the newest
  version there was when it started, so the tier's newest data is about as old as that moment. Timed
  from the start, the tier's newest data is never older than ``max_staleness`` plus one write (every
  tier is offered every save, and an overdue tier waits for no other); timed from the commit it could
  be older by a second write, and a failed flush must not count (nothing new reached the tier).
  Before any flush succeeds, the clock runs from when the flusher started.

Retention: :func:`retain`, applied after each commit: it counts the direction being trained
(:mod:`tierckpt.format.lineage`). Host slots: :func:`choose_slot`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Protocol, Sequence

from tierckpt.config import FlushPolicy, KeepPolicy
from tierckpt.format.lineage import Lineage, is_live, order_key

__all__ = [
    "Candidate",
    "FlushChoice",
    "FlushState",
    "SlotChoice",
    "SlotOccupant",
    "Stored",
    "Update",
    "choose_flush",
    "choose_slot",
    "finished",
    "flush_eligible",
    "forget",
    "offer",
    "pass_over",
    "retain",
    "stale_at",
    "still_wanted",
    "take",
]


# -- flushing -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A save offered to a flusher (every captured save is offered to every tier)."""

    step: int
    arrival: int  # 1, 2, ...: how many saves there were, this one included (what ``every`` counts)
    token: int  # identifies the save this version came from (its snapshot's seq): larger is newer


def flush_eligible(policy: FlushPolicy, step: int, arrival: int) -> bool:
    """Whether ``every`` N-th save and ``every_steps`` both select a version."""
    if arrival % policy.every:
        return False
    return policy.every_steps is None or step % policy.every_steps == 0


@dataclass(frozen=True)
class FlushState:
    """What one flusher remembers between decisions.

    Attributes:
        queue: eligible versions waiting, oldest save first; at most one under ``newest_only``.
        fallback: with ``max_staleness``, the newest version offered when it is newer than every
            eligible one: it goes down only if the tier falls overdue.
        newest_token: the newest save this tier has queued or taken.
        last_start: when the last flush started (``min_interval``), or None.
        last_ok_start: when the last flush that committed started, or when the flusher started
            (``max_staleness``).
    """

    queue: tuple[Candidate, ...] = ()
    fallback: Candidate | None = None
    # Below every token: snapshots a previous process left in RAM are numbered up to 0 (MemoryTier).
    newest_token: int = -(1 << 62)
    last_start: float | None = None
    last_ok_start: float = 0.0

    def waiting(self) -> tuple[Candidate, ...]:
        """Every version that must stay held above this tier for it: the queue and the fallback."""
        return self.queue + ((self.fallback,) if self.fallback is not None else ())

    def find(self, token: int) -> Candidate | None:
        return next((c for c in self.waiting() if c.token == token), None)


@dataclass(frozen=True)
class Update:
    """A new state, and the versions this tier will never take (their handles resolve ``False``)."""

    state: FlushState
    passed_over: tuple[Candidate, ...] = ()


def offer(state: FlushState, policy: FlushPolicy, candidate: Candidate, *, replace_step: bool = True) -> Update:
    """Save ``candidate`` was captured: queue it, hold it as the fallback, or pass it over.

    A newer save of a step replaces that step (saving a step again replaces it), so a version of the
    same step waiting here is replaced by ``candidate``, which takes its place in the queue whether or
    not the rules select it (or becomes the fallback in its place). Not with ``replace_step=False``:
    a follower of several ranks keeps both, as the leader may have taken the older save already and
    then take the newer one too (each decision names the save it takes).
    """
    if not replace_step:
        return _offer(state, policy, candidate, flush_eligible(policy, candidate.step, candidate.arrival))
    replaced = tuple(c for c in state.waiting() if c.step == candidate.step and c.token < candidate.token)
    eligible = flush_eligible(policy, candidate.step, candidate.arrival)
    if replaced:
        eligible = eligible or any(c in state.queue for c in replaced)
        queue = tuple(c for c in state.queue if c not in replaced)
        state = replace(state, queue=queue, fallback=None if state.fallback in replaced else state.fallback)
        update = _offer(state, policy, candidate, eligible)
        return Update(update.state, replaced + update.passed_over)
    return _offer(state, policy, candidate, eligible)


def _offer(state: FlushState, policy: FlushPolicy, candidate: Candidate, eligible: bool) -> Update:
    queue: tuple[Candidate, ...]
    if eligible:
        if policy.newest_only:
            if candidate.token < state.newest_token:
                # Older than a version this tier already has or will take (captures may finish out
                # of order): taking it would only move the tier backwards.
                return Update(state, (candidate,))
            passed, queue = state.queue, (candidate,)
        else:
            passed, queue = (), tuple(sorted(state.queue + (candidate,), key=lambda c: c.token))
        fallback = state.fallback
        if fallback is not None and fallback.token < candidate.token:
            passed, fallback = passed + (fallback,), None
        newest = max(state.newest_token, candidate.token)
        return Update(replace(state, queue=queue, fallback=fallback, newest_token=newest), passed)
    newest_waiting = max((c.token for c in state.waiting()), default=state.newest_token)
    if policy.max_staleness_s is None or candidate.token < max(state.newest_token, newest_waiting):
        return Update(state, (candidate,))
    passed = (state.fallback,) if state.fallback is not None else ()
    return Update(replace(state, fallback=candidate), passed)


def forget(state: FlushState, token: int) -> Update:
    """Nothing above holds version ``token`` any more (evicted from host memory): this tier will not take it."""
    lost = state.find(token)
    if lost is None:
        return Update(state)
    queue = tuple(c for c in state.queue if c is not lost)
    fallback = None if state.fallback is lost else state.fallback
    return Update(replace(state, queue=queue, fallback=fallback), (lost,))


def pass_over(state: FlushState, up_to: tuple[int, int]) -> Update:
    """Nothing waiting here up to ``up_to`` (step, save number) will be taken (a follower's leader went
    past it): no save of an earlier step, nor a save of that step numbered up to it."""
    return _pass_over(state, tuple(c for c in state.waiting() if (c.step, c.arrival) <= up_to))


def pass_over_older_saves(state: FlushState, taken: Candidate) -> Update:
    """The saves of ``taken``'s step made before it will not be taken (a follower took ``taken`` for
    a decision of the leader: the newer save of a step replaces the older)."""
    return _pass_over(state, tuple(c for c in state.waiting() if c.step == taken.step and c.token < taken.token))


def _pass_over(state: FlushState, older: tuple[Candidate, ...]) -> Update:
    if not older:
        return Update(state)
    queue = tuple(c for c in state.queue if c not in older)
    fallback = None if state.fallback in older else state.fallback
    return Update(replace(state, queue=queue, fallback=fallback), older)


def stale_at(state: FlushState, policy: FlushPolicy) -> float | None:
    """When the tier falls overdue (``max_staleness`` after its last successful flush started), or None."""
    if policy.max_staleness_s is None:
        return None
    return state.last_ok_start + policy.max_staleness_s


@dataclass(frozen=True)
class FlushChoice:
    take: Candidate | None  # flush this one now
    wait_s: float | None  # nothing to take yet: look again after this long (None: when something changes)
    forced: bool = False  # taken only because the tier was overdue (max_staleness): no rule selected it


def choose_flush(
    state: FlushState,
    policy: FlushPolicy,
    *,
    now: float,
    drain: bool = False,
    copy_running: bool = False,
) -> FlushChoice:
    """Decide whether a version goes down now (see the module docstring for the rules).

    Args:
        state: the flusher's state.
        policy: the tier's flush policy.
        now: the injected clock.
        drain: ``wait()``/``close()`` is waiting: ``min_interval`` is waived.
        copy_running: a host copy is running (only for the tier right below host memory): a flush
            waits for it unless the tier is overdue.
    """
    head = state.queue[0] if state.queue else None
    if head is None and state.fallback is None:
        return FlushChoice(None, None)
    if not drain and state.last_start is not None and policy.min_interval_s > 0:
        remaining = state.last_start + policy.min_interval_s - now
        if remaining > 0:
            return FlushChoice(None, remaining)
    due = stale_at(state, policy)
    overdue = due is not None and now >= due
    if head is not None and (overdue or not copy_running):
        return FlushChoice(head, None)
    if head is None and overdue:
        return FlushChoice(state.fallback, None, forced=True)
    # Held back by a running copy (woken when it ends), or a fallback not yet due: look again when
    # the tier falls overdue.
    return FlushChoice(None, None if due is None else due - now)


def take(state: FlushState, policy: FlushPolicy, candidate: Candidate, *, now: float) -> Update:
    """The flusher starts writing ``candidate`` at ``now``.

    Under ``newest_only`` anything older still waiting is passed over, and so is a fallback older than
    ``candidate`` (it no longer makes the tier any fresher).
    """
    passed: list[Candidate] = []
    queue: list[Candidate] = []
    for c in state.queue:
        if c.token == candidate.token:
            continue
        (passed if policy.newest_only and c.token < candidate.token else queue).append(c)
    fallback = state.fallback
    if fallback is not None and fallback.token <= candidate.token:
        if fallback.token < candidate.token:
            passed.append(fallback)
        fallback = None
    newest = max(state.newest_token, candidate.token)
    new = replace(state, queue=tuple(queue), fallback=fallback, newest_token=newest, last_start=now)
    return Update(new, tuple(passed))


def finished(state: FlushState, *, started: float, ok: bool) -> FlushState:
    """A flush that started at ``started`` ended; a successful one resets the staleness clock."""
    if not ok:
        return state
    return replace(state, last_ok_start=max(state.last_ok_start, started))


def still_wanted(state: FlushState, policy: FlushPolicy, token: int, newer: Sequence[Candidate]) -> bool:
    """Whether version ``token`` must stay held above this tier (in host memory, or on a filesystem
    tier above that holds it) for this tier.

    ``newer`` are versions that will be offered after it (saves being captured, or a save about to
    take a host slot): a newer eligible version replaces a waiting one under ``newest_only``, and any
    newer version replaces the fallback. Queued versions under ``newest_only: false`` are always kept.
    """
    waiting = state.find(token)
    if waiting is None:
        return False
    if waiting is state.fallback:
        return not newer
    if not policy.newest_only:
        return True
    return not any(flush_eligible(policy, c.step, c.arrival) for c in newer)


# -- retention ------------------------------------------------------------------------------------------


class Stored(Protocol):
    """A committed version as retention sees it (a :class:`~tierckpt.tiers.base.VersionInfo`, a snapshot)."""

    @property
    def step(self) -> int: ...

    @property
    def created(self) -> float: ...  # unix seconds when it was saved

    @property
    def nbytes(self) -> int: ...  # bytes it takes on its tier

    @property
    def lineage(self) -> Lineage | None: ...  # which save it is (tierckpt.format.lineage)


def retain(versions: Sequence[Stored], policy: KeepPolicy, *, now: float, top: Lineage | None = None) -> frozenset[int]:
    """The steps a tier keeps: the union of what each rule keeps of the live versions, always with
    the newest of them, and the newest ``policy.abandoned_kept`` abandoned versions.

    Live and abandoned are :func:`tierckpt.format.lineage.is_live` of ``top``, the lineage of the newest
    save the job committed (None: every version is live). The rules count the live versions only, so
    that versions of a direction a rollback left never displace the direction being trained.

    A policy with no rule keeps every live version. ``last``: the newest N steps. ``every_steps``:
    steps divisible by N. ``within``: versions created at most that long before ``now`` (unix
    seconds, the clock ``created`` is on; a version from the future is kept). ``max_bytes``: the
    newest versions whose bytes add up to at most that; the newest always, even alone larger;
    versions other rules keep do not count against it. For a step given twice the last one given
    counts. Abandoned versions: the most recently saved first (their serials).
    """
    if not versions:
        return frozenset()
    by_step = {v.step: v for v in versions}
    live = {s: v for s, v in by_step.items() if is_live(v, top)}
    abandoned = sorted((v for s, v in by_step.items() if s not in live), key=order_key, reverse=True)
    kept_abandoned = policy.abandoned_kept
    keep = {v.step for v in abandoned[: len(abandoned) if kept_abandoned is None else kept_abandoned]}
    if not live:
        return frozenset(keep)
    if policy.keeps_all:
        return frozenset(keep | set(live))
    ordered = sorted(live)
    keep.add(ordered[-1])
    if policy.last is not None:
        keep.update(ordered[-policy.last :])
    if policy.every_steps is not None:
        keep.update(s for s in ordered if s % policy.every_steps == 0)
    if policy.within_s is not None:
        keep.update(s for s in ordered if now - live[s].created <= policy.within_s)
    if policy.max_bytes is not None:
        total = 0
        for s in reversed(ordered):
            total += live[s].nbytes
            if total > policy.max_bytes and s != ordered[-1]:
                break
            keep.add(s)
    return frozenset(keep)


# -- host slots -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotOccupant:
    """A snapshot in a host slot, as the slot decision sees it."""

    token: int
    copying: bool  # its host copy is running: its slot cannot be reused before the copy ends
    leased: bool  # being read (a flush or a restore): cannot be dropped
    wanted: bool  # a tier below is still waiting to take it


@dataclass(frozen=True)
class SlotChoice:
    """What a save needing a host slot does.

    ``free``: take a free slot. ``drop``: drop snapshot ``token``, which nobody needs, and take its slot.
    ``evict``: drop snapshot ``token`` although a tier was waiting for it (counted). ``wait``: wait for
    a change (a flush or a copy ending). ``skip``: the save does not happen.
    """

    action: Literal["free", "drop", "evict", "wait", "skip"]
    token: int | None = None


def choose_slot(held: Sequence[SlotOccupant], *, free: int, on_full: str) -> SlotChoice:
    """Where a new save goes (``held`` oldest first; ``on_full`` is ``block``, ``skip`` or ``evict``).

    A free slot first; else the oldest snapshot nobody needs (already flushed, superseded, or kept
    only by host retention); else, under ``evict``, the oldest snapshot neither being copied nor read.
    Otherwise ``block`` waits; ``evict`` waits only while a copy runs (a bounded wait: after it ends
    that snapshot can go) and skips when only reads hold the slots; ``skip`` skips.
    """
    if free > 0:
        return SlotChoice("free")
    for h in held:
        if not h.copying and not h.leased and not h.wanted:
            return SlotChoice("drop", h.token)
    if on_full == "evict":
        for h in held:
            if not h.copying and not h.leased:
                return SlotChoice("evict", h.token)
        return SlotChoice("wait") if any(h.copying for h in held) else SlotChoice("skip")
    return SlotChoice("wait") if on_full == "block" else SlotChoice("skip")
