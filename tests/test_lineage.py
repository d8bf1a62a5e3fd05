"""The rollback rule (tierckpt.format.lineage) and the lineages a job's saves get (tierckpt.pipeline.direction).

The property test plays a job of saves, restores (of any version held, abandoned ones too) and
restarts against a model that records each save's parent outright, and checks that the lineage of
the newest save says of every save exactly whether the model's chain of parents reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.config import KeepPolicy
from tierckpt.format.lineage import KEY, MAX_CUTS, Cut, Lineage, head, is_live, lineage_of, marked, newest_first, user_metadata
from tierckpt.pipeline.direction import Direction
from tierckpt.policy import retain


@dataclass(frozen=True)
class V:
    """A version as retention and the rule see it."""

    step: int
    lineage: Lineage | None
    created: float = 0.0
    nbytes: int = 1
    abandoned: bool = False


@dataclass
class Save:
    step: int
    lineage: Lineage
    parent: Save | None  # the model's: the save this one descends from


def ancestors(save: Save) -> set[int]:
    found = set()
    at: Save | None = save
    while at is not None:
        found.add(at.lineage.serial)
        at = at.parent
    return found


def descends_from(nominal: Save | None, step: int, *, own_previous: bool = False) -> Save | None:
    """The model's parent of a save of ``step`` whose nominal parent is ``nominal``: the nearest save of
    its chain below ``step`` (going back to a step, or saving one again, leaves what is at or above it),
    except that a save of the step this process saved last (``own_previous``: no restore between) goes
    on from that save."""
    if own_previous and nominal is not None and nominal.step == step:
        return nominal
    at = nominal
    while at is not None and at.step >= step:
        at = at.parent
    return at


ops = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.integers(0, 12)),
        st.tuples(st.just("restore"), st.integers(0, 1000)),
        st.tuples(st.just("restart"), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_newest_save_descends_from_exactly_its_chain_of_parents(plan: list[tuple[str, int]]) -> None:
    saves: list[Save] = []
    direction = Direction()
    nominal: Save | None = None  # the model: what the next save descends from in this process
    own_previous = False  # whether ``nominal`` is this process's previous save (no restore since)

    def newest() -> Save | None:
        return max(saves, key=lambda s: s.lineage.serial, default=None)

    for op, arg in plan:
        if op == "restart":  # a new process: it knows what is held, and goes on from the newest save
            top = newest()
            direction = Direction()
            if top is not None:
                direction.held(top.step, top.lineage, top.lineage.serial)
            nominal, own_previous = top, False
        elif op == "restore" and saves:
            chosen = saves[arg % len(saves)]
            direction.restored(chosen.step, chosen.lineage)
            nominal, own_previous = chosen, False
        elif op == "save":
            made = Save(arg, direction.next(arg), descends_from(nominal, arg, own_previous=own_previous))
            saves.append(made)
            nominal, own_previous = made, True
    top = newest()
    if top is None:
        return
    chain = ancestors(top)
    for s in saves:
        assert top.lineage.descends(s.step, s.lineage.serial) == (s.lineage.serial in chain), (s.step, s.lineage.serial)
    # The live versions go up in step as they go up in serial. A step saved twice in a row is live
    # twice (a tier holds the one it wrote last; the newer serial wins a restore).
    live = sorted((s for s in saves if s.lineage.serial in chain), key=lambda s: s.lineage.serial)
    assert [s.step for s in live] == sorted(s.step for s in live)


def test_a_rollback_abandons_the_higher_steps_and_a_restart_keeps_the_new_direction() -> None:
    d = Direction()
    old = {step: d.next(step) for step in range(1, 14)}  # serials 1..13
    d.restored(5, old[5])
    new = {step: d.next(step) for step in (6, 7, 8)}  # 14, 15, 16
    assert [new[s].serial for s in (6, 7, 8)] == [14, 15, 16]
    versions = [V(s, lin) for s, lin in old.items() if s in (5, 10, 11, 12, 13)] + [V(s, lin) for s, lin in new.items()]
    top = head(versions)
    assert top == new[8]
    assert [v.step for v in versions if is_live(v, top)] == [5, 6, 7, 8]
    assert [(v.step, v.lineage.serial if v.lineage else 0) for v in newest_first(versions, top)][:4] == [(8, 16), (7, 15), (6, 14), (5, 5)]
    # A new process goes on from the new direction, with no new cut: a normal resume adds none.
    restart = Direction()
    restart.held(8, new[8], 16)
    restart.restored(8, new[8])
    nine = restart.next(9)
    assert nine.serial == 17 and nine.cuts == new[8].cuts


def test_a_flush_of_the_abandoned_direction_committing_after_the_rollback_stays_abandoned() -> None:
    """Ordered by the call, not the commit: step 13 was saved (serial 13) before the rollback's first save."""
    d = Direction()
    lineages = {step: d.next(step) for step in range(1, 14)}
    d.restored(5, lineages[5])
    six = d.next(6)
    late = V(13, lineages[13])  # committed on a slow tier after step 6 was
    assert not is_live(late, six) and head([late, V(6, six)]) == six


def test_restoring_an_abandoned_version_and_training_on_makes_its_direction_live_again() -> None:
    d = Direction()
    old = {step: d.next(step) for step in range(1, 14)}
    d.restored(5, old[5])
    new = {step: d.next(step) for step in (6, 7, 8)}
    d.restored(13, old[13])
    fourteen = d.next(14)
    versions = [V(s, lin) for s, lin in old.items()] + [V(s, lin) for s, lin in new.items()]
    assert [v.step for v in versions if is_live(v, fourteen)] == list(range(1, 14))


def test_saving_a_step_again_replaces_it_and_going_back_without_a_restore_leaves_the_higher_steps() -> None:
    d = Direction()
    first = {step: d.next(step) for step in (1, 2, 3)}
    again = d.next(2)  # the same process saves step 2 again
    assert not again.descends(2, first[2].serial) and not again.descends(3, first[3].serial)
    assert again.descends(1, first[1].serial)


def test_a_first_save_without_a_restore_goes_on_from_the_newest_save_held() -> None:
    d = Direction()
    old = {step: d.next(step) for step in range(1, 6)}
    d2 = Direction()
    d2.held(5, old[5], 5)
    six = d2.next(6)
    assert all(six.descends(s, lin.serial) for s, lin in old.items())
    d3 = Direction()
    d3.held(5, old[5], 5)
    one = d3.next(1)  # a job started over from scratch
    assert not any(one.descends(s, lin.serial) for s, lin in old.items())


def test_versions_saved_before_lineages_were_recorded() -> None:
    legacy = [V(s, None) for s in range(1, 14)]
    assert head(legacy) is None and all(is_live(v, None) for v in legacy)
    d = Direction()
    d.held(13, None, 0)
    d.restored(5, None)  # restored from a version without a lineage
    six = d.next(6)
    assert six.serial == 1
    assert [v.step for v in legacy if is_live(v, six)] == [1, 2, 3, 4, 5]
    d2 = Direction()
    d2.held(13, None, 0)
    assert all(is_live(v, d2.next(14)) for v in legacy)


def test_retention_counts_the_live_direction_and_keeps_the_newest_abandoned_versions() -> None:
    d = Direction()
    old = {step: d.next(step) for step in range(1, 14)}
    d.restored(5, old[5])
    new = {step: d.next(step) for step in (6, 7, 8)}
    nvme = [V(s, old[s]) for s in (11, 12, 13)] + [V(s, new[s]) for s in (6, 7, 8)]
    top = new[8]
    assert retain(nvme, KeepPolicy(last=3), now=0.0, top=top) == {6, 7, 8, 13}
    assert retain(nvme, KeepPolicy(last=3, abandoned=0), now=0.0, top=top) == {6, 7, 8}
    assert retain(nvme, KeepPolicy(last=2, abandoned=2), now=0.0, top=top) == {7, 8, 12, 13}
    assert retain(nvme, KeepPolicy(), now=0.0, top=top) == {6, 7, 8, 11, 12, 13}
    assert retain(nvme, KeepPolicy(abandoned=1), now=0.0, top=top) == {6, 7, 8, 13}
    # Without a lineage to go by, as before: the newest steps.
    assert retain(nvme, KeepPolicy(last=3), now=0.0) == {11, 12, 13}


def test_marked_and_metadata() -> None:
    d = Direction()
    a, b = d.next(5), d.next(9)
    d.restored(5, a)
    c = d.next(6)
    got = marked([V(5, a), V(9, b), V(6, c)])
    assert [v.abandoned for v in got] == [False, True, False]
    meta = {"loss": 1.5, KEY: c.encode()}
    assert lineage_of(meta) == c and user_metadata(meta) == {"loss": 1.5}


@pytest.mark.parametrize(
    "raw",
    [[1], "x", [1, [[1, 2]]], [-1, []], [1, [[0, -2, 3]]], [True, []], [1, [[0, 0, 1]] * (MAX_CUTS + 1)], [1.5, []]],
)
def test_a_malformed_lineage_counts_as_none(raw: Any) -> None:
    with pytest.raises(ValueError):
        Lineage.decode(raw)
    assert lineage_of({KEY: raw}) is None


def test_cuts_are_bounded() -> None:
    lineage = Lineage(1)
    for n in range(MAX_CUTS + 10):
        lineage = lineage.then(n + 2, Cut(0, n, n + 2))
    assert len(lineage.cuts) == MAX_CUTS and lineage.cuts[-1] == Cut(0, MAX_CUTS + 9, MAX_CUTS + 11)
    assert Lineage.decode(lineage.encode()) == lineage
