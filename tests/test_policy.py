"""tierckpt.policy: the pure flush and retention rules, example-tested and property-tested."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.config import FlushPolicy, KeepPolicy
from tierckpt.policy import Candidate, FlushChoice, choose_flush, flush_eligible, retain

# Property tests run on a shared, loaded 2-core machine: no per-example deadline. A decorator, not a
# profile: loading a profile would change every other module's Hypothesis settings too.
relaxed = settings(deadline=None, max_examples=200)

steps_st = st.integers(min_value=0, max_value=10**12 - 1)
positive = st.integers(min_value=1, max_value=50)
optional_positive = st.none() | positive


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


# -- choose_flush --------------------------------------------------------------------------------


def test_nothing_pending_means_nothing_to_take_and_no_timer() -> None:
    for drain in (False, True):
        choice = choose_flush(None, FlushPolicy(min_interval_s=30), last_start=0.0, now=1.0, drain=drain)
        assert choice == FlushChoice(None, None)


def test_first_flush_is_not_held_back_by_min_interval() -> None:
    pending = Candidate(step=5, arrival=1, token=1)
    choice = choose_flush(pending, FlushPolicy(min_interval_s=30), last_start=None, now=0.0)
    assert choice.take == pending


def test_min_interval_holds_back_until_it_has_passed_since_the_last_start() -> None:
    pending = Candidate(step=7, arrival=2, token=2)
    policy = FlushPolicy(min_interval_s=30)
    held = choose_flush(pending, policy, last_start=100.0, now=110.0)
    assert held.take is None
    assert held.wait_s == pytest.approx(20.0)
    assert choose_flush(pending, policy, last_start=100.0, now=129.5).take is None
    assert choose_flush(pending, policy, last_start=100.0, now=130.0).take == pending
    assert choose_flush(pending, policy, last_start=100.0, now=1000.0).take == pending


def test_drain_waives_min_interval() -> None:
    pending = Candidate(step=7, arrival=2, token=2)
    choice = choose_flush(pending, FlushPolicy(min_interval_s=3600), last_start=100.0, now=100.0, drain=True)
    assert choice.take == pending


def test_no_min_interval_takes_at_once() -> None:
    pending = Candidate(step=1, arrival=1, token=1)
    assert choose_flush(pending, FlushPolicy(), last_start=5.0, now=5.0).take == pending


@relaxed
@given(
    interval=st.floats(min_value=0, max_value=1e6, allow_nan=False),
    last_start=st.none() | st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    now=st.floats(min_value=-1e6, max_value=2e6, allow_nan=False),
    drain=st.booleans(),
    has_pending=st.booleans(),
)
def test_property_choose_flush(interval: float, last_start: float | None, now: float, drain: bool, has_pending: bool) -> None:
    pending = Candidate(step=3, arrival=1, token=9) if has_pending else None
    choice = choose_flush(pending, FlushPolicy(min_interval_s=interval), last_start=last_start, now=now, drain=drain)
    if pending is None:
        assert choice == FlushChoice(None, None)
        return
    due = drain or last_start is None or interval == 0 or now >= last_start + interval
    if due:
        assert choice.take == pending
        assert choice.wait_s is None
    else:
        assert choice.take is None
        assert choice.wait_s is not None and choice.wait_s > 0
        assert choice.wait_s == pytest.approx(last_start + interval - now)


# -- retain --------------------------------------------------------------------------------------


def test_retain_nothing_from_nothing() -> None:
    assert retain([], KeepPolicy(last=2)) == frozenset()
    assert retain([], KeepPolicy()) == frozenset()


def test_retain_without_rules_keeps_everything() -> None:
    assert retain([3, 1, 2], KeepPolicy()) == {1, 2, 3}


def test_retain_last_keeps_the_newest_n_by_step_not_by_order() -> None:
    assert retain([9, 1, 5, 7, 3], KeepPolicy(last=2)) == {7, 9}
    assert retain([1, 2], KeepPolicy(last=5)) == {1, 2}


def test_retain_every_steps_alone_still_keeps_the_newest() -> None:
    assert retain([100, 150, 200, 250], KeepPolicy(every_steps=100)) == {100, 200, 250}


def test_retain_is_the_union_of_last_and_every_steps() -> None:
    steps = list(range(0, 5001, 250))
    assert retain(steps, KeepPolicy(last=2, every_steps=1000)) == {0, 1000, 2000, 3000, 4000, 4750, 5000}


@relaxed
@given(
    steps=st.lists(st.integers(min_value=0, max_value=10**6), max_size=60),
    last=optional_positive,
    every_steps=optional_positive,
)
def test_property_retain(steps: list[int], last: int | None, every_steps: int | None) -> None:
    kept = retain(steps, KeepPolicy(last=last, every_steps=every_steps))
    assert isinstance(kept, frozenset)
    assert kept <= set(steps)  # never invents a step
    if not steps:
        assert kept == frozenset()
        return
    assert max(steps) in kept  # always the newest
    if last is None and every_steps is None:
        assert kept == set(steps)
        return
    ordered = sorted(set(steps))
    expected = {ordered[-1]}
    if last is not None:
        expected |= set(ordered[-last:])
    if every_steps is not None:
        expected |= {s for s in ordered if s % every_steps == 0}
    assert kept == expected


@relaxed
@given(steps=st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=60), last=positive)
def test_property_retain_last_is_stable_under_order_and_duplicates(steps: list[int], last: int) -> None:
    policy = KeepPolicy(last=last)
    kept = retain(steps, policy)
    assert kept == retain(list(reversed(steps)) + steps, policy)
    assert len(kept) == min(last, len(set(steps)))
    # Keeping is monotone: whatever is kept is newer than whatever is dropped.
    dropped = set(steps) - kept
    assert not dropped or max(dropped) < min(kept)


@relaxed
@given(steps=st.lists(st.integers(min_value=0, max_value=10**4), min_size=1, max_size=40), last=positive, new=st.integers(min_value=10**4 + 1, max_value=10**5))
def test_property_retention_after_a_new_version_never_brings_back_a_dropped_one(steps: list[int], last: int, new: int) -> None:
    # A tier prunes after each commit: what a prune dropped must stay dropped at the next one.
    policy = KeepPolicy(last=last, every_steps=7)
    before = retain(steps, policy)
    after = retain(sorted(before) + [new], policy)
    assert new in after
    assert after <= before | {new}
