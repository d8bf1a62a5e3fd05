"""Property test: random chains of tiers on the real pipeline, every write ended by the test.

Hypothesis draws a chain (host memory and 1-3 gated filesystem tiers, each with random ``every``,
``every_steps``, ``min_interval``, ``max_staleness``, ``newest_only`` and ``keep``), a number of host
slots, ``on_full``, and a sequence of events: a save, the end of one tier's write (its gate lets one
write through), or the injected clock moving on. Write times are therefore random and independent per
tier. After each event the test waits until the pipeline has settled: no host copy runs, every
flusher is either writing (parked at its gate) or has nothing it may take now, and a save is either
done or waiting for a slot it cannot have. It predicts those decisions with the pipeline's own pure
rules on the engine thread, so it never sleeps on a guess, and a flusher that should take a version
but does not (it waits for another tier, say) makes the settle time out, naming it. The tiers are
uncompressed: the one wait on real time, a tier waiting (bounded) for a tier above that compresses
alike and is writing the same save, would let a write begin with no event; ``test_selection.py``
tests that wait.

Checked as it goes and at the end, per tier:
- each write is of a version its own policy selected (or forced by ``max_staleness``, counted), read
  from host memory or a filesystem tier above;
- under ``newest_only`` each write is of the newest version the tier selected when it started (a
  forced one, of the newest save); with ``newest_only: false`` every selected version is written, in
  order, unless it was evicted;
- a selected version the tier did not write was replaced by a newer one it selected while it was busy
  with another write (or held back by ``min_interval``): never because another tier was busy;
- host memory never holds more snapshots than its slots; with ``2 × tiers + 1`` slots and every tier
  ``newest_only``, no save ever waits, is skipped, or evicts one;
- nothing waits forever: once every gate opens, a waiting save goes on, ``wait()`` returns and every
  handle resolves; each tier's newest version restores to its own step's state.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tierckpt import Checkpointer
from tierckpt.config import TierConfig
from tierckpt.policy import choose_flush, flush_eligible
from tierckpt.testing import GatedTier, ManualClock
from tierckpt.testing.inspect import (
    call_on_engine, committed_done, flushers_of, is_closed, newest_save_number, pipeline_of, save_number,
)

DEADLINE_S = 30.0  # a deadlock guard only: settling takes milliseconds
SLOT_KIB = 16


def state_for(step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step)), "step": step}


@dataclass(frozen=True)
class Chain:
    tiers: tuple[dict[str, Any], ...]  # flush and keep settings of each filesystem tier, fastest first
    slots: int
    on_full: str
    events: tuple[tuple[str, int, float], ...]  # (kind, tier index, seconds)


@st.composite
def chains(draw: st.DrawFn) -> Chain:
    n = draw(st.integers(1, 3))
    tiers = []
    for _ in range(n):
        min_interval = draw(st.sampled_from([0, 0, 0, 5, 20]))
        flush: dict[str, Any] = {
            "every": draw(st.sampled_from([1, 1, 2, 3])),
            "min_interval": min_interval,
            "newest_only": draw(st.booleans()),
        }
        every_steps = draw(st.sampled_from([None, None, 2, 3, 4]))
        if every_steps is not None:
            flush["every_steps"] = every_steps
        staleness = draw(st.none() | st.sampled_from([10, 40]))
        if staleness is not None:
            flush["max_staleness"] = min_interval + staleness
        keep = draw(st.sampled_from([None, {"last": 1}, {"last": 1}, {"last": 2}]))
        tiers.append({"flush": flush, **({"keep": keep} if keep else {})})
    event = st.tuples(st.sampled_from(["save", "save", "end", "end", "tick"]), st.integers(0, n - 1), st.sampled_from([3.0, 15.0, 50.0]))
    return Chain(
        tiers=tuple(tiers),
        # Few slots more often: that is where host memory must choose what to keep.
        slots=draw(st.integers(1, n + 1) | st.integers(1, 2 * n + 2)),
        on_full=draw(st.sampled_from(["block", "skip", "evict"])),
        events=tuple(draw(st.lists(event, min_size=10, max_size=60))),
    )


class Probed(GatedTier):
    """A gated tier that notes which saves were captured when each of its writes began."""

    def __init__(self, config: TierConfig, run: Run, deadline_s: float) -> None:
        super().__init__(config, deadline_s=deadline_s)
        self.run = run
        self.captured_at: list[tuple[int, frozenset[int]]] = []

    async def write(self, source: Any) -> Any:
        self.captured_at.append(self.run.captured_now())
        return await super().write(source)


@dataclass
class Seen:
    """What the test saw of one tier."""

    policy: Any
    writes: list[tuple[int, bool]] = field(default_factory=list)  # (step, forced) in the order they began
    busy_at: dict[int, bool] = field(default_factory=dict)  # step saved -> the tier was busy when it arrived


class Run:
    def __init__(self, chain: Chain, root: Path) -> None:
        self.chain = chain
        self.clock = ManualClock()
        self.gated: dict[str, Probed] = {}
        tiers: list[dict[str, Any]] = [{"name": "ram", "type": "memory", "keep": {"last": 1}}]
        for i, settings_ in enumerate(chain.tiers):
            tiers.append({"name": f"t{i}", "type": "filesystem", "path": str(root / f"t{i}"), **settings_})
        self.config = {
            "host": {"capacity": f"{chain.slots * SLOT_KIB}KiB", "snapshots": chain.slots, "on_full": chain.on_full, "copy_threads": 1},
            "tiers": tiers,
        }
        self.ckpt = Checkpointer(self.config, tier_factory=self._gated, clock=self.clock)
        self.names = [f"t{i}" for i in range(len(chain.tiers))]
        self.seen = {t.name: Seen(t.flush) for t in self.ckpt.config.tiers if t.name in self.names}
        self.saver = concurrent.futures.ThreadPoolExecutor(1)
        self.pending: tuple[int, concurrent.futures.Future[Any]] | None = None
        self.handles: dict[int, Any] = {}  # step -> handle of the saves that happened
        self.seq: dict[int, int] = {}  # step -> the save's number (what `every` counts)
        self.next_step = 7  # steps != save numbers, so `every` and `every_steps` select differently
        self.waited = 0  # events after which a save was waiting for a slot

    def _gated(self, cfg: TierConfig) -> GatedTier | None:
        if cfg.type != "filesystem":
            return None
        self.gated[cfg.name] = Probed(cfg, self, deadline_s=DEADLINE_S * 4)
        return self.gated[cfg.name]

    def captured_now(self) -> tuple[int, frozenset[int]]:
        """The saves captured so far, as (the newest save number, those still being copied). Engine thread."""
        return newest_save_number(self.ckpt), frozenset(s.seq for s in pipeline_of(self.ckpt).memory.capturing())

    # -- on the engine thread ----------------------------------------------------------------------

    def _on_engine(self, fn: Any) -> Any:
        return call_on_engine(self.ckpt, fn)

    def _unsettled(self) -> str | None:
        """Why the pipeline may still move on its own (None: it is settled). Engine thread."""
        pipeline = pipeline_of(self.ckpt)
        memory = pipeline.memory
        if memory.capturing():
            return "a host copy runs"
        if self.pending is not None and not self.pending[1].done():
            if not memory.waiting_saves:
                return "a save is on its way"
            step = self.pending[0]
            if memory.slot_choice(step, newest_save_number(self.ckpt) + 1, self.chain.on_full).action != "wait":
                return f"the save of step {step} can have a slot now"
        for flusher in pipeline.flushers:
            tier = self.gated[flusher.tier.name]
            if flusher.in_flight is not None:
                if tier.parked() != 1:
                    return f"{tier.name} is reading, writing or pruning"
                continue
            choice = choose_flush(flusher.state, flusher.policy, now=self.clock(), copy_running=False)
            if choice.take is not None and not pipeline.sources.defer(tier.name, choice.take):
                return f"{tier.name} may take step {choice.take.step} and has not (what holds it back?)"
        return None

    def settle(self, *, one_event: bool = True) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while (why := self._on_engine(self._unsettled)) is not None:
            assert time.monotonic() < deadline, f"the pipeline did not settle: {why}"
            time.sleep(0.001)
        if self.pending is not None:
            step, future = self.pending
            if future.done():  # before the checks: its capture may have started a write
                handle = future.result()
                self.pending = None
                if not handle.skipped:
                    self.handles[step] = handle
                    self.seq[step] = save_number(handle)
            else:
                busy = self._on_engine(self._busy)  # it arrives later: was each tier busy meanwhile?
                for name in self.names:
                    self.seen[name].busy_at[step] = self.seen[name].busy_at.get(step, False) or busy[name]
        self._on_engine(lambda: self._check(one_event))

    def _check(self, one_event: bool) -> None:
        """Invariants of a settled pipeline (engine thread). ``one_event``: one event happened since
        the last check, so each tier began at most one write."""
        pipeline = pipeline_of(self.ckpt)
        memory = pipeline.memory
        assert len(memory.snapshots()) <= self.chain.slots
        counters = pipeline.counters
        for flusher in pipeline.flushers:
            name = flusher.tier.name
            tier, seen = self.gated[name], self.seen[name]
            began = tier.steps[len(seen.writes) :]
            sources = tier.sources[len(seen.writes) :]
            above = ["ram", *self.names[: self.names.index(name)]]
            assert all(source in above for source in sources), (name, began, sources)
            if not one_event:  # wait() drained: several writes each; forced ones are counted below
                seen.writes += [(step, step not in self._selected(name)) for step in began]
                continue
            assert len(began) <= 1, f"{name} began {began} during one event"
            forced_before = sum(f for _, f in seen.writes)
            for step, (newest, copying) in zip(began, tier.captured_at[len(seen.writes) :]):
                forced = counters.forced.get(name, 0) > forced_before
                seen.writes.append((step, forced))
                captured = [s for s, q in self.seq.items() if q <= newest and q not in copying]
                self._check_write(name, step, forced, captured)
        if memory.waiting_saves:
            self.waited += 1

    def _selected(self, name: str) -> list[int]:
        policy = self.seen[name].policy
        return [s for s in self.seq if flush_eligible(policy, s, self.seq[s])]

    def _check_write(self, name: str, step: int, forced: bool, captured: list[int]) -> None:
        """A write of ``step`` began on tier ``name`` when the saves ``captured`` had been captured."""
        seen = self.seen[name]
        selected = [s for s in self._selected(name) if s in captured]
        if forced:
            assert step == max(captured), f"{name} was forced to take step {step}, not the newest save"
            return
        assert step in selected, f"{name} wrote step {step}, which its policy did not select"
        if seen.policy.newest_only:
            assert step == max(selected), f"{name} wrote step {step} while it had selected {max(selected)}"

    # -- events ------------------------------------------------------------------------------------

    def _busy(self) -> dict[str, bool]:
        """Per tier, whether it is writing or held back by min_interval now (engine thread)."""
        out = {}
        for flusher in flushers_of(self.ckpt):
            held_back = flusher.state.last_start is not None and flusher.state.last_start + flusher.policy.min_interval_s > self.clock()
            out[flusher.tier.name] = flusher.in_flight is not None or held_back
        return out

    def save(self) -> None:
        step = self.next_step
        self.next_step += 1
        busy = self._on_engine(self._busy)
        for name in self.names:
            self.seen[name].busy_at[step] = busy[name]
        self.pending = (step, self.saver.submit(self.ckpt.save_sync, step, state_for(step)))
        self.settle()

    def end_write(self, index: int) -> bool:
        parked = self._on_engine(lambda: [n for n in self.names if self.gated[n].parked()])
        if not parked:
            return False
        name = self.names[index] if self.names[index] in parked else parked[0]
        self.gated[name].allow(1)
        self.settle()
        return True

    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self._on_engine(lambda: [f.wake() for f in flushers_of(self.ckpt)])
        self.settle()

    def play(self) -> None:
        self.settle()
        for kind, index, seconds in self.chain.events:
            if kind == "save" and self.pending is None:
                self.save()
            elif kind in ("save", "end") and self.end_write(index):
                pass
            else:
                self.tick(seconds)
        # Nothing waits forever: writes end as they come, the clock moves on; a waiting save goes on.
        for _ in range(200):
            if self.pending is None:
                break
            if not self.end_write(0):
                self.tick(60.0)
        assert self.pending is None, "a save waits for a slot that never frees"

    def finish(self) -> None:
        for tier in self.gated.values():
            tier.gate.set()
        self.ckpt.wait_sync()
        self.settle(one_event=False)  # the writes wait() started are logged and checked too
        self.ckpt.close_sync()
        self.saver.shutdown()

    def close_on_failure(self) -> None:
        for tier in self.gated.values():
            tier.gate.set()
        if not is_closed(self.ckpt):
            try:
                self.ckpt.close_sync()
            except Exception:
                pass
        self.saver.shutdown(cancel_futures=True)


def check_outcome(run: Run, root: Path) -> None:
    counters = run.ckpt.counters
    n = len(run.names)
    if run.chain.slots >= 2 * n + 1 and all(s.policy.newest_only for s in run.seen.values()):
        # The rule in docs/configuration.md (Flushing): 2 × tiers + 1 slots keep every save off the disks' critical path.
        assert run.waited == 0 and counters.skipped_saves == 0 and counters.evicted_saves == 0
    for name in run.names:
        seen = run.seen[name]
        written = [s for s, _ in seen.writes]
        assert sum(f for _, f in seen.writes) == counters.forced.get(name, 0)
        assert written == sorted(set(written)), f"{name} went backwards or wrote a version twice: {written}"
        selected = [s for s in run.seq if flush_eligible(seen.policy, s, run.seq[s])]
        for i, step in enumerate(selected):
            handle = run.handles[step]
            assert committed_done(handle, name), f"{name}: step {step} never resolved"
            committed = handle.committed_sync(name, 0)  # raises what the write raised, had it failed
            if step in written:
                assert committed is True
                continue
            assert committed is False
            if not seen.policy.newest_only:
                assert counters.evicted_saves, f"{name} (newest_only: false) never wrote step {step}"
                continue
            newer = selected[i + 1 :]
            # Replaced by the next version this tier selected, which came while it was busy; or it was
            # evicted from host memory (on_full: evict) before the tier was free.
            if not counters.evicted_saves:
                assert newer and seen.busy_at[newer[0]], f"{name} never wrote step {step}, and was free when step {newer[0] if newer else None} came"
    # Each tier's newest version holds its own step's bytes.
    for name in run.names:
        steps = sorted(p.name for p in (root / name).iterdir() if p.name.startswith("step-"))
        if not steps:
            continue
        step = int(steps[-1].removeprefix("step-"))
        only = {"host": {"capacity": f"{SLOT_KIB}KiB", "snapshots": 1}, "tiers": [{"name": "only", "type": "filesystem", "path": str(root / name)}]}
        with Checkpointer(only) as reader:
            restored = reader.restore_latest_sync()
        assert restored is not None and restored.step == step
        assert restored.state["step"] == step and torch.equal(restored.state["w"], state_for(step)["w"])


@pytest.mark.slow
@settings(max_examples=int(os.environ.get('TIERCKPT_EXAMPLES', '80')), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains())
def test_property_every_tier_gets_what_its_own_policy_selects(chain: Chain) -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        run = Run(chain, root)
        try:
            run.play()
            run.finish()
        except BaseException:
            run.close_on_failure()
            raise
        check_outcome(run, root)
        # What the examples exercised (pytest --hypothesis-show-statistics).
        counters = run.ckpt.counters
        sources = [src for tier in run.gated.values() for src in tier.sources]
        event(f"writes: {'>= 5' if sum(len(s.writes) for s in run.seen.values()) >= 5 else '< 5'}")
        event(f"a write read a disk tier: {any(src != 'ram' for src in sources)}")
        event(f"a save waited for a slot: {run.waited > 0}")
        event(f"skipped: {counters.skipped_saves > 0}, evicted: {counters.evicted_saves > 0}, forced: {sum(counters.forced.values()) > 0}")
        event(f"passed over: {sum(counters.passed_over.values()) > 0}")
