"""tierckpt.policy: the pure flush, retention and host-slot rules, example-tested and property-tested.

The last section simulates whole tier chains on a virtual clock with nothing but these functions
(random saves, policies and tier speeds) and checks the invariants the pipeline relies on.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.config import FlushPolicy, KeepPolicy
from tierckpt.policy import (
    Candidate,
    FlushChoice,
    FlushState,
    SlotChoice,
    SlotOccupant,
    choose_flush,
    choose_slot,
    finished,
    flush_eligible,
    forget,
    offer,
    pass_over,
    pass_over_older_saves,
    retain,
    stale_at,
    still_wanted,
    take,
)

# Property tests run on a shared, loaded 2-core machine: no per-example deadline. A decorator, not a
# profile: loading a profile would change every other module's Hypothesis settings too.
relaxed = settings(deadline=None, max_examples=200)

steps_st = st.integers(min_value=0, max_value=10**12 - 1)
positive = st.integers(min_value=1, max_value=50)
optional_positive = st.none() | positive


@dataclass(frozen=True)
class V:
    """A stored version as retention sees it."""

    step: int
    created: float = 0.0
    nbytes: int = 1


def versions(*steps: int, created: float = 0.0, nbytes: int = 1) -> list[V]:
    return [V(s, created, nbytes) for s in steps]


def c(step: int, token: int | None = None, arrival: int | None = None) -> Candidate:
    token = step if token is None else token
    return Candidate(step, token if arrival is None else arrival, token)


# -- flush_eligible ------------------------------------------------------------------------------


def test_every_one_takes_every_arrival() -> None:
    policy = FlushPolicy()
    assert all(flush_eligible(policy, step, arrival) for arrival, step in enumerate(range(10, 30), start=1))


def test_every_n_takes_every_nth_arrival_whatever_the_step() -> None:
    policy = FlushPolicy(every=3)
    taken = [arrival for arrival in range(1, 13) if flush_eligible(policy, 7 * arrival + 1, arrival)]
    assert taken == [3, 6, 9, 12]


def test_every_steps_takes_only_multiples_of_the_step() -> None:
    policy = FlushPolicy(every_steps=100)
    steps = [0, 1, 99, 100, 150, 200, 1000, 1001]
    taken = [s for arrival, s in enumerate(steps, start=1) if flush_eligible(policy, s, arrival)]
    assert taken == [0, 100, 200, 1000]


def test_every_and_every_steps_must_both_hold() -> None:
    policy = FlushPolicy(every=2, every_steps=10)
    assert flush_eligible(policy, 20, 2)
    assert not flush_eligible(policy, 20, 3)  # right step, wrong arrival
    assert not flush_eligible(policy, 21, 2)  # right arrival, wrong step


@relaxed
@given(every=positive, arrivals=st.integers(min_value=1, max_value=500))
def test_property_every_n_takes_exactly_the_multiples_of_n(every: int, arrivals: int) -> None:
    policy = FlushPolicy(every=every)
    taken = [a for a in range(1, arrivals + 1) if flush_eligible(policy, a * 3, a)]
    assert taken == list(range(every, arrivals + 1, every))
    assert len(taken) == arrivals // every


@relaxed
@given(every=positive, every_steps=optional_positive, step=steps_st, arrival=st.integers(min_value=1, max_value=10**6))
def test_property_eligible_iff_every_rule_holds(every: int, every_steps: int | None, step: int, arrival: int) -> None:
    policy = FlushPolicy(every=every, every_steps=every_steps)
    expected = arrival % every == 0 and (every_steps is None or step % every_steps == 0)
    assert flush_eligible(policy, step, arrival) is expected


# -- offer, take, forget ---------------------------------------------------------------------------


def test_newest_only_a_newer_eligible_version_replaces_the_waiting_one() -> None:
    policy = FlushPolicy()
    first = offer(FlushState(), policy, c(1))
    assert first.state.queue == (c(1),) and first.passed_over == ()
    second = offer(first.state, policy, c(2))
    assert second.state.queue == (c(2),)
    assert second.passed_over == (c(1),)


def test_newest_only_an_older_version_than_one_taken_is_passed_over() -> None:
    policy = FlushPolicy()
    state = take(offer(FlushState(), policy, c(5)).state, policy, c(5), now=0.0).state
    late = offer(state, policy, c(4))  # captured after 5 although saved before it
    assert late.passed_over == (c(4),)
    assert late.state == state


def test_fifo_queues_every_eligible_version_oldest_save_first() -> None:
    policy = FlushPolicy(newest_only=False)
    state = FlushState()
    for token in (2, 3, 1):
        update = offer(state, policy, c(token))
        assert update.passed_over == ()
        state = update.state
    assert [x.token for x in state.queue] == [1, 2, 3]
    choice = choose_flush(state, policy, now=0.0)
    assert choice.take == c(1)
    after = take(state, policy, c(1), now=0.0)
    assert after.passed_over == ()  # FIFO: taking the oldest passes nothing over
    assert [x.token for x in after.state.queue] == [2, 3]


def test_ineligible_versions_are_passed_over_without_max_staleness() -> None:
    policy = FlushPolicy(every_steps=10)
    update = offer(FlushState(), policy, c(3))
    assert update.passed_over == (c(3),)
    assert update.state == FlushState()


def test_with_max_staleness_the_newest_ineligible_version_is_held_as_the_fallback() -> None:
    policy = FlushPolicy(every_steps=10, max_staleness_s=60)
    state = offer(FlushState(), policy, c(10)).state
    held = offer(state, policy, c(11))
    assert held.passed_over == ()
    assert (held.state.queue, held.state.fallback) == ((c(10),), c(11))
    newer = offer(held.state, policy, c(12))
    assert newer.passed_over == (c(11),)  # a newer version replaces the fallback
    assert newer.state.fallback == c(12)
    eligible = offer(newer.state, policy, c(20))
    assert eligible.passed_over == (c(10), c(12))  # newest only: 20 replaces 10, and 12 is older than 20
    assert (eligible.state.queue, eligible.state.fallback) == ((c(20),), None)
    assert offer(eligible.state, policy, c(19, token=19)).passed_over == (c(19),)  # older than 20


def test_a_newer_save_of_the_same_step_takes_the_waiting_ones_place_selected_or_not() -> None:
    fifo = FlushPolicy(every=2, newest_only=False)
    state = offer(FlushState(), fifo, c(4, token=4, arrival=4)).state  # selected: every 2nd save
    update = offer(state, fifo, c(4, token=5, arrival=5))  # save 5: not selected, but step 4 again
    assert update.passed_over == (c(4, token=4, arrival=4),)
    assert update.state.queue == (c(4, token=5, arrival=5),)
    staleness = FlushPolicy(every_steps=10, max_staleness_s=5.0)
    state = offer(FlushState(), staleness, c(7, token=1, arrival=1)).state
    assert state.fallback == c(7, token=1, arrival=1)
    update = offer(state, staleness, c(7, token=2, arrival=2))
    assert update.passed_over == (c(7, token=1, arrival=1),) and update.state.fallback == c(7, token=2, arrival=2)
    other = offer(FlushState(), fifo, c(4, token=4, arrival=4)).state
    assert offer(other, fifo, c(6, token=5, arrival=5)).state.queue == (c(4, token=4, arrival=4),)  # another step: kept


def test_forget_removes_a_waiting_version_and_passes_it_over() -> None:
    policy = FlushPolicy(newest_only=False, every_steps=2, max_staleness_s=5)
    state = FlushState()
    for token in (2, 4, 5):
        state = offer(state, policy, c(token)).state
    assert [x.token for x in state.queue] == [2, 4] and state.fallback == c(5)
    lost = forget(state, 2)
    assert lost.passed_over == (c(2),)
    assert [x.token for x in lost.state.queue] == [4]
    gone = forget(lost.state, 5)
    assert gone.passed_over == (c(5),) and gone.state.fallback is None
    assert forget(gone.state, 99).passed_over == ()


def test_take_records_the_start_and_finished_resets_staleness_only_on_success() -> None:
    policy = FlushPolicy(max_staleness_s=10)
    state = offer(FlushState(last_ok_start=0.0), policy, c(1)).state
    started = take(state, policy, c(1), now=3.0).state
    assert (started.last_start, started.last_ok_start, started.queue) == (3.0, 0.0, ())
    assert finished(started, started=3.0, ok=False) == started
    assert finished(started, started=3.0, ok=True).last_ok_start == 3.0
    assert stale_at(finished(started, started=3.0, ok=True), policy) == 13.0
    assert stale_at(started, FlushPolicy()) is None


def test_still_wanted() -> None:
    newest_only = FlushPolicy(every_steps=2, max_staleness_s=5)
    state = offer(offer(FlushState(), newest_only, c(2)).state, newest_only, c(3)).state
    assert (state.queue, state.fallback) == ((c(2),), c(3))
    assert still_wanted(state, newest_only, 2, [])
    assert still_wanted(state, newest_only, 2, [c(5)])  # 5 is not eligible: 2 stays wanted
    assert not still_wanted(state, newest_only, 2, [c(4)])  # 4 will replace it
    assert still_wanted(state, newest_only, 3, [])
    assert not still_wanted(state, newest_only, 3, [c(5)])  # any newer version replaces the fallback
    assert not still_wanted(state, newest_only, 7, [])  # not waiting here at all
    fifo = replace(newest_only, newest_only=False)
    assert still_wanted(state, fifo, 2, [c(4), c(6)])  # queued versions all go down


# -- choose_flush --------------------------------------------------------------------------------


def test_nothing_waiting_means_nothing_to_take_and_no_timer() -> None:
    for drain in (False, True):
        choice = choose_flush(FlushState(last_start=0.0), FlushPolicy(min_interval_s=30, max_staleness_s=60), now=1.0, drain=drain)
        assert choice == FlushChoice(None, None)


def test_first_flush_is_not_held_back_by_min_interval() -> None:
    state = FlushState(queue=(c(5),))
    assert choose_flush(state, FlushPolicy(min_interval_s=30), now=0.0).take == c(5)


def test_min_interval_holds_back_until_it_has_passed_since_the_last_start() -> None:
    state = FlushState(queue=(c(7),), last_start=100.0)
    policy = FlushPolicy(min_interval_s=30)
    held = choose_flush(state, policy, now=110.0)
    assert held.take is None
    assert held.wait_s == pytest.approx(20.0)
    assert choose_flush(state, policy, now=129.5).take is None
    assert choose_flush(state, policy, now=130.0).take == c(7)
    assert choose_flush(state, policy, now=1000.0).take == c(7)


def test_drain_waives_min_interval() -> None:
    state = FlushState(queue=(c(7),), last_start=100.0)
    assert choose_flush(state, FlushPolicy(min_interval_s=3600), now=100.0, drain=True).take == c(7)


def test_a_running_host_copy_holds_a_flush_back_until_the_tier_is_overdue() -> None:
    state = FlushState(queue=(c(3),), last_ok_start=0.0)
    assert choose_flush(state, FlushPolicy(), now=5.0, copy_running=True) == FlushChoice(None, None)
    policy = FlushPolicy(max_staleness_s=10)
    held = choose_flush(state, policy, now=4.0, copy_running=True)
    assert held.take is None and held.wait_s == pytest.approx(6.0)  # look again when it falls overdue
    overdue = choose_flush(state, policy, now=10.0, copy_running=True)
    assert overdue == FlushChoice(c(3), None, forced=False)  # eligible: not forced, only not held back


def test_max_staleness_sends_the_fallback_down_when_overdue() -> None:
    policy = FlushPolicy(every_steps=100, min_interval_s=30, max_staleness_s=600)
    state = FlushState(fallback=c(137), last_start=500.0, last_ok_start=500.0)
    waiting = choose_flush(state, policy, now=700.0)
    assert waiting.take is None and waiting.wait_s == pytest.approx(400.0)
    assert choose_flush(state, policy, now=700.0, drain=True).take is None  # a drain does not force it
    assert choose_flush(state, policy, now=1100.0) == FlushChoice(c(137), None, forced=True)
    # After a failed flush (started at 1090) min_interval still spaces the starts.
    failed = replace(state, last_start=1090.0)
    assert choose_flush(failed, policy, now=1100.0) == FlushChoice(None, pytest.approx(20.0))


def test_a_queued_eligible_version_goes_before_the_fallback() -> None:
    policy = FlushPolicy(every_steps=2, max_staleness_s=5)
    state = FlushState(queue=(c(2),), fallback=c(3), last_ok_start=0.0)
    assert choose_flush(state, policy, now=100.0) == FlushChoice(c(2), None)
    after = take(state, policy, c(2), now=100.0)
    assert after.state.fallback == c(3)  # newer than what was taken: still the fallback
    # The staleness clock runs from the start of the last flush that succeeded.
    done = finished(after.state, started=100.0, ok=True)
    assert choose_flush(done, policy, now=104.0) == FlushChoice(None, pytest.approx(1.0))
    assert choose_flush(done, policy, now=105.0) == FlushChoice(c(3), None, forced=True)
    failed = finished(after.state, started=100.0, ok=False)
    assert choose_flush(failed, policy, now=100.5) == FlushChoice(c(3), None, forced=True)  # still overdue


@relaxed
@given(
    interval=st.floats(min_value=0, max_value=1e6, allow_nan=False),
    staleness=st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False),
    last_start=st.none() | st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    last_ok=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    now=st.floats(min_value=-1e6, max_value=2e6, allow_nan=False),
    drain=st.booleans(),
    copy_running=st.booleans(),
    queued=st.booleans(),
    fallback=st.booleans(),
)
def test_property_choose_flush(
    interval: float,
    staleness: float | None,
    last_start: float | None,
    last_ok: float,
    now: float,
    drain: bool,
    copy_running: bool,
    queued: bool,
    fallback: bool,
) -> None:
    policy = FlushPolicy(min_interval_s=interval, max_staleness_s=None if staleness is None else interval + staleness + 1e-3)
    state = FlushState(queue=(c(3),) if queued else (), fallback=c(4) if fallback and policy.max_staleness_s else None, last_start=last_start, last_ok_start=last_ok)
    choice = choose_flush(state, policy, now=now, drain=drain, copy_running=copy_running)
    if not state.waiting():
        assert choice == FlushChoice(None, None)
        return
    spaced = drain or last_start is None or interval == 0 or now >= last_start + interval
    overdue = policy.max_staleness_s is not None and now >= last_ok + policy.max_staleness_s
    if not spaced:
        assert choice.take is None and choice.wait_s == pytest.approx(last_start + interval - now)  # type: ignore[operator]
    elif queued and (overdue or not copy_running):
        assert choice == FlushChoice(c(3), None)
    elif not queued and overdue:
        assert choice == FlushChoice(c(4), None, forced=True)
    else:
        assert choice.take is None
        if policy.max_staleness_s is None:
            assert choice.wait_s is None
        else:  # never sleeps past the moment the tier falls overdue
            assert choice.wait_s is not None and 0 < choice.wait_s
            assert choice.wait_s == pytest.approx(last_ok + policy.max_staleness_s - now)


# -- retain --------------------------------------------------------------------------------------


def test_retain_nothing_from_nothing() -> None:
    assert retain([], KeepPolicy(last=2), now=0.0) == frozenset()
    assert retain([], KeepPolicy(), now=0.0) == frozenset()


def test_retain_without_rules_keeps_everything() -> None:
    assert retain(versions(3, 1, 2), KeepPolicy(), now=0.0) == {1, 2, 3}


def test_retain_last_keeps_the_newest_n_by_step_not_by_order() -> None:
    assert retain(versions(9, 1, 5, 7, 3), KeepPolicy(last=2), now=0.0) == {7, 9}
    assert retain(versions(1, 2), KeepPolicy(last=5), now=0.0) == {1, 2}


def test_retain_every_steps_alone_still_keeps_the_newest() -> None:
    assert retain(versions(100, 150, 200, 250), KeepPolicy(every_steps=100), now=0.0) == {100, 200, 250}


def test_retain_is_the_union_of_last_and_every_steps() -> None:
    steps = list(range(0, 5001, 250))
    assert retain(versions(*steps), KeepPolicy(last=2, every_steps=1000), now=0.0) == {0, 1000, 2000, 3000, 4000, 4750, 5000}


def test_retain_within_compares_creation_times_with_now() -> None:
    stored = [V(1, created=1000.0), V(2, created=5000.0), V(3, created=8000.0), V(4, created=8100.0)]
    assert retain(stored, KeepPolicy(within_s=3600), now=8200.0) == {2, 3, 4}  # 5000 is exactly 3200 s old
    assert retain(stored, KeepPolicy(within_s=3600), now=20000.0) == {4}  # only the newest
    assert retain(stored, KeepPolicy(within_s=10), now=0.0) == {1, 2, 3, 4}  # from the future: kept


def test_retain_max_bytes_keeps_the_newest_that_fit_and_always_the_newest() -> None:
    stored = [V(1, nbytes=10), V(2, nbytes=30), V(3, nbytes=20), V(4, nbytes=25)]
    assert retain(stored, KeepPolicy(max_bytes=45), now=0.0) == {3, 4}
    assert retain(stored, KeepPolicy(max_bytes=44), now=0.0) == {4}
    assert retain(stored, KeepPolicy(max_bytes=75), now=0.0) == {2, 3, 4}
    assert retain(stored, KeepPolicy(max_bytes=5), now=0.0) == {4}  # larger than the budget alone
    # The newest run that fits: a small old version beyond a large one does not slip in.
    assert retain(stored, KeepPolicy(max_bytes=46), now=0.0) == {3, 4}
    # A union: versions other rules keep do not count against the budget.
    assert retain(stored, KeepPolicy(max_bytes=45, every_steps=2), now=0.0) == {2, 3, 4}


def test_retain_a_step_given_twice_counts_the_last() -> None:
    assert retain([V(5, nbytes=100), V(6, nbytes=1), V(5, nbytes=1)], KeepPolicy(max_bytes=2), now=0.0) == {5, 6}


stored_st = st.lists(
    st.builds(V, st.integers(0, 10**6), st.floats(0, 1e5, allow_nan=False), st.integers(0, 1000)),
    max_size=60,
)
keeps_st = st.builds(
    KeepPolicy,
    last=optional_positive,
    every_steps=optional_positive,
    within_s=st.none() | st.floats(1e-3, 1e5, allow_nan=False),
    max_bytes=st.none() | st.integers(1, 20000),
)


def expected_retain(stored: list[V], policy: KeepPolicy, now: float) -> set[int]:
    """The rules as docs/configuration.md (Retention) states them, written out naively."""
    by_step = {v.step: v for v in stored}
    ordered = sorted(by_step)
    if policy.keeps_all:
        return set(ordered)
    keep = {ordered[-1]}
    if policy.last is not None:
        keep |= set(ordered[-policy.last :])
    if policy.every_steps is not None:
        keep |= {s for s in ordered if s % policy.every_steps == 0}
    if policy.within_s is not None:
        keep |= {s for s in ordered if by_step[s].created >= now - policy.within_s}
    if policy.max_bytes is not None:
        for n in range(len(ordered), 0, -1):  # the longest run of newest versions that fits
            if n == 1 or sum(by_step[s].nbytes for s in ordered[-n:]) <= policy.max_bytes:
                keep |= set(ordered[-n:])
                break
    return keep


@relaxed
@given(stored=stored_st, policy=keeps_st, now=st.floats(0, 2e5, allow_nan=False))
def test_property_retain(stored: list[V], policy: KeepPolicy, now: float) -> None:
    kept = retain(stored, policy, now=now)
    assert isinstance(kept, frozenset)
    steps = {v.step for v in stored}
    assert kept <= steps  # never invents a step
    if not stored:
        assert kept == frozenset()
        return
    assert max(steps) in kept  # always the newest
    assert kept == expected_retain(stored, policy, now)  # nothing that no rule keeps


@relaxed
@given(steps=st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=60), last=positive)
def test_property_retain_last_is_stable_under_order_and_duplicates(steps: list[int], last: int) -> None:
    policy = KeepPolicy(last=last)
    kept = retain(versions(*steps), policy, now=0.0)
    assert kept == retain(versions(*reversed(steps), *steps), policy, now=0.0)
    assert len(kept) == min(last, len(set(steps)))
    # Keeping is monotone: whatever is kept is newer than whatever is dropped.
    dropped = set(steps) - kept
    assert not dropped or max(dropped) < min(kept)


@relaxed
@given(
    stored=stored_st.filter(bool),
    policy=keeps_st,
    new=st.builds(V, st.integers(10**6 + 1, 10**7), st.floats(1e5, 2e5, allow_nan=False), st.integers(0, 1000)),
    now=st.floats(1e5, 2e5, allow_nan=False),
    later=st.floats(0, 1e5, allow_nan=False),
)
def test_property_retention_after_a_new_version_never_brings_back_a_dropped_one(
    stored: list[V], policy: KeepPolicy, new: V, now: float, later: float
) -> None:
    # A tier prunes after each commit: what a prune dropped must stay dropped at the next one.
    by_step = {v.step: v for v in stored}
    before = retain(stored, policy, now=now)
    after = retain([by_step[s] for s in sorted(before)] + [new], policy, now=now + later)
    assert new.step in after
    assert after <= before | {new.step}


# -- choose_slot -----------------------------------------------------------------------------------


def test_choose_slot_examples() -> None:
    busy = SlotOccupant(1, copying=False, leased=True, wanted=False)
    waiting = SlotOccupant(2, copying=False, leased=False, wanted=True)
    done = SlotOccupant(3, copying=False, leased=False, wanted=False)
    copying = SlotOccupant(4, copying=True, leased=False, wanted=True)
    for mode in ("block", "skip", "evict"):
        assert choose_slot([busy, waiting], free=1, on_full=mode) == SlotChoice("free")
        assert choose_slot([busy, waiting, done], free=0, on_full=mode) == SlotChoice("drop", 3)
    assert choose_slot([busy, waiting], free=0, on_full="block") == SlotChoice("wait")
    assert choose_slot([busy, waiting], free=0, on_full="skip") == SlotChoice("skip")
    assert choose_slot([busy, waiting], free=0, on_full="evict") == SlotChoice("evict", 2)
    assert choose_slot([busy, copying], free=0, on_full="evict") == SlotChoice("wait")  # only as long as the copy
    assert choose_slot([busy], free=0, on_full="evict") == SlotChoice("skip")  # never waits for a read


held_st = st.lists(st.builds(SlotOccupant, st.integers(1, 10**6), st.booleans(), st.booleans(), st.booleans()), max_size=8, unique_by=lambda h: h.token)


@relaxed
@given(held=held_st, free=st.integers(0, 2), on_full=st.sampled_from(["block", "skip", "evict"]))
def test_property_choose_slot(held: list[SlotOccupant], free: int, on_full: str) -> None:
    choice = choose_slot(held, free=free, on_full=on_full)
    if free:
        assert choice == SlotChoice("free")
        return
    by_token = {h.token: h for h in held}
    droppable = [h for h in held if not (h.copying or h.leased or h.wanted)]
    evictable = [h for h in held if not (h.copying or h.leased)]
    if choice.action in ("drop", "evict"):
        victim = by_token[choice.token]  # type: ignore[index]
        assert not victim.copying and not victim.leased  # never a slot being copied into or read
    if droppable:
        assert choice == SlotChoice("drop", droppable[0].token)  # the oldest nobody needs
    elif on_full == "evict" and evictable:
        assert choice == SlotChoice("evict", evictable[0].token)
    elif on_full == "block":
        assert choice == SlotChoice("wait")
    elif on_full == "evict":
        # Waits only while a copy runs (bounded by that copy), never for a read (bounded by the disk).
        assert choice == SlotChoice("wait" if any(h.copying for h in held) else "skip")
    else:
        assert choice == SlotChoice("skip")


# -- whole chains on a virtual clock ---------------------------------------------------------------


@dataclass
class SimTier:
    flush: FlushPolicy
    keep: KeepPolicy
    seconds_per_byte: float
    state: FlushState = field(default_factory=FlushState)
    stored: dict[int, V] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)  # step -> the save it stores under that step
    in_flight: tuple[Candidate, float, int] | None = None  # (version, start, source: -1 host memory, else a tier)
    offered: list[int] = field(default_factory=list)  # tokens
    flushed: list[int] = field(default_factory=list)  # tokens, in commit order
    passed_over: list[int] = field(default_factory=list)
    committed_at: dict[int, float] = field(default_factory=dict)  # token -> time
    committed_steps: set[int] = field(default_factory=set)
    busy_at: dict[int, bool] = field(default_factory=dict)  # token -> writing, or held back by min_interval, when it was saved


@dataclass
class SimHost:
    slots: int | None  # None: room for every save
    on_full: str
    keep: KeepPolicy
    held: dict[int, V] = field(default_factory=dict)  # token -> version, oldest save first
    blocked: list[V] = field(default_factory=list)  # saves waiting for a slot (on_full: block)
    skipped: int = 0
    evicted: int = 0


class Sim:
    """Saves into host memory (captured at once, into ``host.slots`` slots), each offered to every tier
    and flushed by the policy functions alone, each write lasting its bytes times the tier's seconds per
    byte. A tier reads what it takes from host memory, else from the first tier above that stores that
    save (as :mod:`tierckpt.pipeline.sources` does)."""

    def __init__(self, tiers: list[SimTier], host: SimHost) -> None:
        self.tiers = tiers
        self.host = host
        self.events: list[tuple[float, int, str, object]] = []
        self.order = 0
        self.now = 0.0
        self.seq = 0
        self.saves: dict[int, V] = {}  # token (the save's seq) -> the saved version
        self.host_at: dict[int, float] = {}  # token -> when it reached host memory

    def push(self, at: float, kind: str, data: object) -> None:
        self.order += 1
        heapq.heappush(self.events, (at, self.order, kind, data))

    def run(self, saves: list[tuple[float, int, int]]) -> None:
        at, step = 0.0, -1
        for gap, increment, nbytes in saves:
            at, step = at + gap, step + increment
            self.push(at, "save", V(step, at, nbytes))
        handled = 0
        while self.events:
            handled += 1
            assert handled < 100_000, "the simulation does not settle"
            self.now, _, kind, data = heapq.heappop(self.events)
            if kind == "save":
                self.host.blocked.append(data)  # type: ignore[arg-type]
            elif kind == "done":
                self.done(data)  # type: ignore[arg-type]
            while self.host.blocked and self.save(self.host.blocked[0]):
                self.host.blocked.pop(0)
            self.prune_host()
            for i in range(len(self.tiers)):
                self.decide(i)
        assert not self.host.blocked

    def on_disk_above(self, i: int, token: int) -> int | None:
        """The first tier above tier ``i`` that stores save ``token``."""
        step = self.saves[token].step
        return next((j for j in range(i) if self.tiers[j].tokens.get(step) == token and step in self.tiers[j].stored), None)

    def read_from_host(self) -> set[int]:
        return {t.in_flight[0].token for t in self.tiers if t.in_flight is not None and t.in_flight[2] < 0}

    def wanted_here(self, token: int, newer: list[Candidate]) -> bool:
        """A tier still wants save ``token`` and no tier above it stores it: host memory must keep it."""
        return any(still_wanted(t.state, t.flush, token, newer) and self.on_disk_above(i, token) is None for i, t in enumerate(self.tiers))

    def save(self, version: V) -> bool:
        """A save takes a host slot (True), or is skipped (True), or waits for one (False)."""
        host = self.host
        if host.slots is not None and len(host.held) >= host.slots:
            incoming = Candidate(version.step, self.seq + 1, self.seq + 1)
            reading = self.read_from_host()
            held = [SlotOccupant(token, copying=False, leased=token in reading, wanted=self.wanted_here(token, [incoming])) for token in host.held]
            choice = choose_slot(held, free=0, on_full=host.on_full)
            if choice.action == "wait":
                assert host.on_full == "block"  # skip and evict never wait when no copy is running
                return False
            if choice.action == "skip":
                # evict skips only when every slot is being read
                assert host.on_full == "skip" or (host.on_full == "evict" and all(h.leased for h in held))
                host.skipped += 1
                return True
            victim = choice.token
            assert victim is not None and victim not in reading
            if choice.action == "evict":
                assert host.on_full == "evict"
                host.evicted += 1
                for i, tier in enumerate(self.tiers):
                    if self.on_disk_above(i, victim) is None:
                        self.apply(tier, forget(tier.state, victim))
            del host.held[victim]
            dropped = victim
        else:
            dropped = None
        self.seq += 1
        self.saves[self.seq] = version
        self.host_at[self.seq] = self.now
        self.host.held[self.seq] = version
        assert host.slots is None or len(host.held) <= host.slots  # host memory: the slots, no more
        for tier in self.tiers:
            started = tier.state.last_start
            held_back = started is not None and started + tier.flush.min_interval_s > self.now
            tier.busy_at[self.seq] = tier.in_flight is not None or held_back
            self.offer(tier, version.step, self.seq)
        # A snapshot that gave way is nothing a tier waits for from host memory once the new save is offered.
        assert dropped is None or not self.wanted_here(dropped, [])
        return True

    def prune_host(self) -> None:
        """Host retention: what keep lets go, nobody reads from host memory and no tier waits for."""
        kept = retain(list(self.host.held.values()), self.host.keep, now=self.now)
        reading = self.read_from_host()
        for token, version in list(self.host.held.items()):
            if version.step in kept or token in reading:
                continue
            if not any(still_wanted(t.state, t.flush, token, []) for t in self.tiers):
                del self.host.held[token]

    def offer(self, tier: SimTier, step: int, token: int) -> None:
        tier.offered.append(token)
        # Every tier counts the saves: the arrival number is the save's seq, as in the pipeline.
        self.apply(tier, offer(tier.state, tier.flush, Candidate(step, token, token)))

    def apply(self, tier: SimTier, update) -> None:  # type: ignore[no-untyped-def]
        tier.state = update.state
        tier.passed_over.extend(x.token for x in update.passed_over)

    def decide(self, i: int) -> None:
        tier = self.tiers[i]
        if tier.in_flight is not None:
            return
        choice = choose_flush(tier.state, tier.flush, now=self.now)
        if choice.take is None:
            if choice.wait_s is not None:
                assert choice.wait_s > 0
                # Look again when told to (never earlier than the next representable instant).
                self.push(max(self.now + choice.wait_s, math.nextafter(self.now, math.inf)), "timer", i)
            return
        token = choice.take.token
        above = self.on_disk_above(i, token)
        # Host memory or retention above kept it: a flusher never finds the version it waits for gone.
        assert token in self.host.held or above is not None, (i, choice.take)
        self.apply(tier, take(tier.state, tier.flush, choice.take, now=self.now))
        tier.in_flight = (choice.take, self.now, -1 if token in self.host.held else above)
        nbytes = self.saves[token].nbytes
        self.push(self.now + nbytes * tier.seconds_per_byte, "done", i)

    def done(self, i: int) -> None:
        tier = self.tiers[i]
        assert tier.in_flight is not None
        candidate, started, _ = tier.in_flight
        tier.in_flight = None
        if tier.flushed:
            assert candidate.token > tier.flushed[-1], "a tier went backwards"
        tier.flushed.append(candidate.token)
        tier.committed_at[candidate.token] = self.now
        tier.committed_steps.add(candidate.step)
        tier.stored[candidate.step] = self.saves[candidate.token]
        tier.tokens[candidate.step] = candidate.token
        tier.state = finished(tier.state, started=started, ok=True)
        self.prune(i, committed=candidate.step)

    def pinned(self, i: int) -> set[int]:
        """Steps of tier ``i`` that a tier below waits for or reads."""
        steps = set()
        for below in self.tiers[i + 1 :]:
            steps |= {x.step for x in below.state.waiting()}
            if below.in_flight is not None:
                steps.add(below.in_flight[0].step)
        return steps

    def prune(self, i: int, committed: int) -> None:
        tier = self.tiers[i]
        newest = max(tier.stored)
        by_rule = retain(list(tier.stored.values()), tier.keep, now=self.now)
        pinned = self.pinned(i)
        tier.stored = {s: v for s, v in tier.stored.items() if s in by_rule or s == committed or s in pinned}
        assert newest in tier.stored  # the newest committed version is always kept
        # Nothing is kept that no rule keeps, beyond what a tier below still needs.
        assert set(tier.stored) <= by_rule | {committed} | pinned
        # An every_steps milestone, once committed, is never pruned.
        if tier.keep.every_steps is not None:
            milestones = {s for s in tier.committed_steps if s % tier.keep.every_steps == 0}
            assert milestones <= set(tier.stored)


def flush_policies(draw: st.DrawFn) -> FlushPolicy:
    min_interval = draw(st.sampled_from([0.0, 0.0, 0.5, 3.0]))
    staleness = draw(st.none() | st.floats(0.1, 20.0))
    return FlushPolicy(
        every=draw(st.integers(1, 4)),
        every_steps=draw(st.none() | st.integers(1, 6)),
        min_interval_s=min_interval,
        max_staleness_s=None if staleness is None else min_interval + staleness,
        newest_only=draw(st.booleans()),
    )


@st.composite
def chains(draw: st.DrawFn) -> tuple[SimHost, list[SimTier], list[tuple[float, int, int]]]:
    host = SimHost(
        slots=draw(st.none() | st.integers(1, 3)),
        on_full=draw(st.sampled_from(["block", "skip", "evict"])),
        keep=draw(st.sampled_from([KeepPolicy(), KeepPolicy(last=1), KeepPolicy(last=2)])),
    )
    tiers = [
        SimTier(
            flush=flush_policies(draw),
            keep=draw(keeps_st.map(lambda k: replace(k, within_s=None if k.within_s is None else k.within_s / 1e3))),
            seconds_per_byte=draw(st.sampled_from([0.001, 0.01, 0.05, 0.2])),
        )
        for _ in range(draw(st.integers(1, 3)))
    ]
    saves = draw(st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(1, 4), st.integers(1, 100)), min_size=1, max_size=40))
    return host, tiers, saves


@settings(deadline=None, max_examples=300)
@given(chain=chains())
def test_property_tier_chains(chain: tuple[SimHost, list[SimTier], list[tuple[float, int, int]]]) -> None:
    host, tiers, saves = chain
    sim = Sim(tiers, host)
    sim.run(saves)  # slot and prune invariants are checked as it goes
    assert sim.seq + host.skipped == len(saves)  # every save happened or was skipped, none lost
    assert host.skipped == 0 or host.on_full in ("skip", "evict")
    assert host.evicted == 0 or host.on_full == "evict"
    for tier in tiers:
        # Every save was offered to every tier, and either flushed or passed over, once (a fallback
        # still waiting at the end is what a close() would pass over).
        assert tier.offered == sorted(sim.saves)
        leftover = [x.token for x in tier.state.waiting()]
        assert sorted(tier.flushed + tier.passed_over + leftover) == sorted(tier.offered)
        assert not tier.state.queue  # every eligible version went down or was replaced
        # Selection per tier: every version the tier's own rules select is flushed, unless it was
        # evicted from host memory, or (newest_only) it came while the tier was busy with a write or
        # held back by min_interval and a newer one the rules select replaced it. Another tier never
        # decides it.
        selected = [t for t, v in sorted(sim.saves.items()) if flush_eligible(tier.flush, v.step, t)]
        for k, token in enumerate(selected):
            if token in tier.flushed or host.evicted:
                continue
            assert tier.flush.newest_only, f"newest_only: false lost save {token}"
            newer = selected[k + 1 :]
            # It was not taken at once because the tier was busy when it arrived, or the newer one
            # reached host memory with it (saves waiting for a slot under block get slots in turn).
            assert newer, f"save {token}, the newest selected, was never written"
            assert tier.busy_at[token] or sim.host_at[newer[0]] == sim.host_at[token], f"save {token} was replaced although the tier was free when it came"
        if tier.flush.newest_only:
            assert tier.flushed == sorted(tier.flushed)
        # max_staleness: the newest save reaches this tier too. An older eligible version queued ahead
        # of it may still start (after min_interval or the write in flight) and restart the staleness
        # clock, since that is a successful flush; the newest then goes down once overdue: within
        # max(min_interval, write) + max(max_staleness, write) + a write, plus the write in flight,
        # counted from when it was saved (no tier above delays it any more).
        if tier.flush.max_staleness_s is not None and not host.evicted:
            newest = max(sim.saves)
            assert tier.flushed and tier.flushed[-1] == newest
            if tier.flush.newest_only:
                write = max(v.nbytes for v in sim.saves.values()) * tier.seconds_per_byte
                bound = max(tier.flush.min_interval_s, write) + max(tier.flush.max_staleness_s, write) + 2 * write
                assert tier.committed_at[newest] - sim.host_at[newest] <= bound + 1e-6


# -- a follower of several ranks: saves of one step kept apart, passed over by (step, save number) --------


def test_a_follower_keeps_both_saves_of_a_step_and_the_leaders_horizon_passes_only_those_it_dealt_with() -> None:
    """The leader took save 1 of step 24 and published its horizon (24, 1) before save 2 of step 24
    reached it: the follower's save 2 must stay (the leader will take it next), save 1 and older
    steps go. Before, a horizon of step 24 passed over both, and the leader's next decision found
    nothing on the follower."""
    policy = replace(FlushPolicy(), newest_only=False)
    state = FlushState()
    for c in (Candidate(16, 1, 1), Candidate(24, 2, 2), Candidate(24, 3, 3)):
        state = offer(state, policy, c, replace_step=False).state
    assert [c.token for c in state.waiting()] == [1, 2, 3]  # not replaced: each decision names its save
    update = pass_over(state, (24, 2))
    assert [c.token for c in update.passed_over] == [1, 2] and [c.token for c in update.state.waiting()] == [3]
    # A decision that takes the newer save lets the older save of the step go.
    update = pass_over_older_saves(state, Candidate(24, 3, 3))
    assert [c.token for c in update.passed_over] == [2] and [c.token for c in update.state.waiting()] == [1, 3]
    # One process: a newer save of a step replaces the waiting one.
    single = offer(offer(FlushState(), policy, Candidate(24, 1, 1)).state, policy, Candidate(24, 2, 2))
    assert [c.token for c in single.passed_over] == [1] and [c.token for c in single.state.waiting()] == [2]
