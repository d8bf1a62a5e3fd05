"""The device stages' own logic on any machine, with a fake GPU: barrier, completion, torn writes, and
the restore's ring of bounce buffers.

``DeviceCopies`` talks to CUDA through a handful of calls (streams, events, the current stream). Here
they are a fake GPU whose queued work "finishes" only when the test opens :attr:`FakeGpu.done`, so
the test decides when the copies complete and can check what the barrier did before that: that it
did not block the host, that it made the current stream wait on the copy's done event, which writes
it reports as torn, and that the sources stay alive until the copies are done. The copies themselves
run on the CPU at once (``copy_`` of CPU tensors). What CUDA does with real streams is tested in
tests/test_cuda.py on a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import Any, Iterator

import pytest
import torch

from tierckpt.capture.device import DeviceCopies
from tierckpt.capture.pool import HostPool
from tierckpt.capture.views import TornCaptureError, moment
from tierckpt.snapshot import Snapshot, plan_entries
from tierckpt.state import survey
from tierckpt.testing.inspect import copy_done_event, device_slot_views, pending_device_snapshots, wait_device_queued

from helpers import parked, until

DEADLINE_S = 30.0  # a deadlock guard only
GPU = torch.device("cpu")  # the fake GPU's tensors live on the CPU: streams and events are keyed by their device


class FakeGpu:
    """Streams and events whose work is done once :attr:`done` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waits: list[tuple[Any, Any]] = []  # (stream, event) of every wait_event
        self.stream_syncs: list[str] = []  # the thread of every stream synchronize, as it begins
        self.current = self.Stream()

    def Stream(self, device: Any = None) -> Any:  # noqa: N802 - stands in for torch.cuda.Stream
        gpu = self

        class FakeStream:
            def wait_event(self, event: Any) -> None:
                gpu.waits.append((self, event))

            def synchronize(self) -> None:
                gpu.stream_syncs.append(threading.current_thread().name)
                assert gpu.done.wait(DEADLINE_S)

        return FakeStream()

    def Event(self, **_: Any) -> Any:  # noqa: N802 - stands in for torch.cuda.Event
        gpu = self

        class FakeEvent:
            def record(self, stream: Any = None) -> None:
                pass

            def synchronize(self) -> None:
                assert gpu.done.wait(DEADLINE_S)

        return FakeEvent()


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpu]:
    fake = FakeGpu()
    monkeypatch.setattr(torch.cuda, "Stream", fake.Stream)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "device", lambda _: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda _: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.current)
    yield fake
    fake.done.set()  # let every waiter go, whatever the test did


class Capture:
    """One snapshot of ``state`` started on ``copies`` (as the Copier does for device tensors)."""

    def __init__(self, copies: DeviceCopies, pool: HostPool, state: dict[str, torch.Tensor], layout: Snapshot | None = None) -> None:
        found = survey(state)
        skeleton, leaves = found.skeleton, found.leaves()
        # ``layout``: an earlier capture's snapshot whose entries this one reuses, as save() does while
        # a state keeps its layout.
        entries, nbytes = (layout.entries, layout.nbytes) if layout is not None else plan_entries(leaves)
        self.snapshot = Snapshot(1, 1, entries, nbytes, skeleton, {}, 0.0, pool.slots[0])
        self.pool = pool
        self.finished = threading.Event()
        self.error: BaseException | None = None
        items = list(zip(found.values, entries, moment(found).versions))
        copies.start(self.snapshot, items, {GPU: "ready"}, self._done)

    def _done(self, error: BaseException | None) -> None:
        self.error = error
        self.finished.set()

    def slot(self, key: str) -> torch.Tensor:
        entry = next(e for e in self.snapshot.entries if e.key == f"[{key!r}]")
        return self.pool.tensor(self.snapshot.slot, entry.offset, entry.nbytes, entry.dtype, entry.shape)


@pytest.fixture
def stage(gpu: FakeGpu) -> Iterator[tuple[DeviceCopies, HostPool]]:
    pool = HostPool(1 << 20, 1)
    copies = DeviceCopies(pool)
    yield copies, pool
    gpu.done.set()
    copies.close()
    pool.close()


def queued(copies: DeviceCopies) -> None:
    """Wait until the queueing thread has queued everything started so far."""
    wait_device_queued(copies, DEADLINE_S)


def test_the_barrier_orders_the_stream_without_waiting_for_the_copy(gpu: FakeGpu, stage: tuple[DeviceCopies, HostPool]) -> None:
    copies, pool = stage
    x = torch.arange(100, dtype=torch.float32)
    capture = Capture(copies, pool, {"x": x})
    assert copies.order(timeout=DEADLINE_S) is True  # returns while the "GPU" has not finished
    assert not capture.finished.is_set()
    ((stream, event),) = [w for w in gpu.waits if w[0] is gpu.current]
    assert event is capture_event(copies, capture)  # the training stream waits on the copy's done event
    x.add_(1)  # after the barrier: ordered, so not torn
    gpu.done.set()
    assert capture.finished.wait(DEADLINE_S) and capture.error is None
    assert torch.equal(capture.slot("x"), torch.arange(100, dtype=torch.float32))


def capture_event(copies: DeviceCopies, capture: Capture) -> Any:
    return copy_done_event(copies, capture.snapshot, GPU)


def test_the_copy_stream_waits_for_what_was_queued_before_save(gpu: FakeGpu, stage: tuple[DeviceCopies, HostPool]) -> None:
    copies, pool = stage
    Capture(copies, pool, {"x": torch.zeros(4)})
    queued(copies)
    assert [event for stream, event in gpu.waits if stream is not gpu.current] == ["ready"]


def test_a_write_queued_after_the_copy_but_before_the_barrier_is_torn(gpu: FakeGpu, stage: tuple[DeviceCopies, HostPool]) -> None:
    copies, pool = stage
    x = torch.zeros(100)
    capture = Capture(copies, pool, {"x": x})
    queued(copies)
    x.add_(1)  # unordered with the copy on a real GPU
    assert copies.order(timeout=DEADLINE_S) is True
    gpu.done.set()
    assert capture.finished.wait(DEADLINE_S)
    assert isinstance(capture.error, TornCaptureError) and "['x']" in str(capture.error)


def test_a_write_with_no_barrier_before_the_copy_finished_is_torn(gpu: FakeGpu, stage: tuple[DeviceCopies, HostPool]) -> None:
    copies, pool = stage
    x = torch.zeros(100)
    capture = Capture(copies, pool, {"x": x})
    queued(copies)
    x.add_(1)
    gpu.done.set()
    assert capture.finished.wait(DEADLINE_S)
    assert isinstance(capture.error, TornCaptureError)


def test_wait_blocks_the_host_until_the_copies_are_done(gpu: FakeGpu, stage: tuple[DeviceCopies, HostPool]) -> None:
    copies, pool = stage
    capture = Capture(copies, pool, {"x": torch.zeros(100)})
    assert copies.wait(timeout=0.05) is False
    waiter = threading.Thread(target=copies.wait, args=(DEADLINE_S,))
    waiter.start()
    assert parked(waiter, DEADLINE_S), "wait() returned before the copies were done"
    gpu.done.set()
    waiter.join(DEADLINE_S)
    assert not waiter.is_alive() and capture.finished.is_set() and capture.error is None
    assert pending_device_snapshots(copies) == []


def test_the_sources_live_until_their_copies_are_done(gpu: FakeGpu, stage: tuple[DeviceCopies, HostPool]) -> None:
    copies, pool = stage
    x = torch.zeros(100)
    alive = weakref.ref(x)
    capture = Capture(copies, pool, {"x": x})
    del x
    queued(copies)
    gc.collect()
    assert alive() is not None, "a source was let go while its copy could still be reading it"
    gpu.done.set()
    assert capture.finished.wait(DEADLINE_S)
    gc.collect()
    assert alive() is None


def test_slot_views_are_reused_while_a_layout_stays_and_remade_for_another(gpu: FakeGpu, stage: tuple[DeviceCopies, HostPool]) -> None:
    copies, pool = stage
    gpu.done.set()
    first = Capture(copies, pool, {"x": torch.arange(10.0), "y": torch.ones(3, dtype=torch.int8)})
    assert first.finished.wait(DEADLINE_S) and first.error is None
    slot = pool.slots[0]  # the views are kept per slot (the slot itself: a pool may map new ones) and device
    views = device_slot_views(copies)[(slot, GPU)]
    second = Capture(copies, pool, {"x": torch.arange(10.0) + 1, "y": torch.full((3,), 5, dtype=torch.int8)}, layout=first.snapshot)
    assert second.finished.wait(DEADLINE_S) and second.error is None
    assert device_slot_views(copies)[(slot, GPU)] is views  # the same layout: the same views
    assert torch.equal(second.slot("x"), torch.arange(10.0) + 1) and torch.equal(second.slot("y"), torch.full((3,), 5, dtype=torch.int8))
    third = Capture(copies, pool, {"y": torch.full((3,), 7, dtype=torch.int8), "x": torch.arange(4.0)})
    assert third.finished.wait(DEADLINE_S) and third.error is None
    assert device_slot_views(copies)[(slot, GPU)] is not views
    assert torch.equal(third.slot("x"), torch.arange(4.0)) and torch.equal(third.slot("y"), torch.full((3,), 7, dtype=torch.int8))


def test_a_pool_that_grew_gets_views_of_its_new_slots_and_lets_go_of_the_old(gpu: FakeGpu) -> None:
    pool = HostPool(None, 1, limit_bytes=64 << 20)  # sized to the state (no host.capacity)
    copies = DeviceCopies(pool)
    try:
        gpu.done.set()
        pool.fit(4096, 1)
        old = pool.slots[0]
        first = Capture(copies, pool, {"x": torch.arange(10.0)})
        assert first.finished.wait(DEADLINE_S) and first.error is None
        pool.fit(1 << 20, 2)  # a larger save came: new slots (the old one still holds the first)
        # The first's layout again, in the new slot: its views are made anew, not taken from the old slot's.
        second = Capture(copies, pool, {"x": torch.arange(10.0) + 1}, layout=first.snapshot)
        assert second.finished.wait(DEADLINE_S) and second.error is None
        assert second.snapshot.slot is pool.slots[0] and second.snapshot.slot is not old
        assert torch.equal(second.slot("x"), torch.arange(10.0) + 1)
        assert torch.equal(first.slot("x"), torch.arange(10.0))  # the old slot as the first left it
        assert [key[0] for key in device_slot_views(copies)] == [pool.slots[0]]  # the old slot's views let go
    finally:
        copies.close()
        pool.close()


def test_a_failed_queueing_waits_for_what_was_queued_and_reports_the_failure(
    gpu: FakeGpu, stage: tuple[DeviceCopies, HostPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    copies, pool = stage

    def failing_copies(dests: list[torch.Tensor], sources: list[torch.Tensor], non_blocking: bool = False) -> None:
        dests[0].copy_(sources[0], non_blocking=non_blocking)  # one copy queued, then the failure
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "_foreach_copy_", failing_copies)
    capture = Capture(copies, pool, {"a": torch.zeros(10), "b": torch.zeros(10)})
    done_queueing = threading.Thread(target=queued, args=(copies,))
    done_queueing.start()
    # The first copy was queued: the queueing thread waits for the stream before the slot can go back.
    assert until(lambda: gpu.stream_syncs or capture.finished.is_set(), DEADLINE_S)
    assert gpu.stream_syncs and not capture.finished.is_set()
    assert done_queueing.is_alive()  # queued behind the queueing thread's synchronize
    gpu.done.set()
    done_queueing.join(DEADLINE_S)
    assert capture.finished.wait(DEADLINE_S)
    assert isinstance(capture.error, RuntimeError) and "illegal memory access" in str(capture.error)
    assert copies.order(timeout=DEADLINE_S) is True  # nothing left pending


# -- the restore's ring of bounce buffers (tierckpt.restore.device) ---------------------------------------


@pytest.fixture
def fake_cuda_templates(gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch) -> Iterator[set[int]]:
    """Template tensors whose ids are put in the returned set land as CUDA templates do: through the
    restore's ring of bounce buffers, on the fake GPU (whose copies are done at once)."""
    from tierckpt.restore import device as ring_module
    from tierckpt.restore import exact

    on_gpu: set[int] = set()
    real_template_bytes = exact._template_bytes

    def template_bytes(value: Any) -> Any:
        return None if id(value) in on_gpu else real_template_bytes(value)

    def device_bytes(value: Any) -> Any:
        return value.detach().reshape(-1).view(torch.uint8) if id(value) in on_gpu else None

    made: list[Any] = []
    real_bounce = ring_module._Bounce

    def bounce(nbytes: int) -> Any:
        made.append(real_bounce(nbytes))
        return made[-1]

    monkeypatch.setattr(exact, "_template_bytes", template_bytes)
    monkeypatch.setattr(exact, "device_bytes", device_bytes)
    monkeypatch.setattr(ring_module, "_Bounce", bounce)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    gpu.done.set()
    yield on_gpu
    assert made, "no chunk went through the ring"
    assert all(b.memory.closed for b in made), "a ring buffer outlived its restore"


def _save_and_damage(path: Any, states: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """``states`` saved as steps 1, 2, ... to a disk tier at ``path``; a bit of the newest one's 'b' flipped."""
    from helpers import fs_tier, tier_config
    from tierckpt import Checkpointer
    from tierckpt.format import MANIFEST_FILE, Manifest, version_dirname
    from tierckpt.testing import flip_bits

    config = tier_config(fs_tier("nvme", path / "nvme"), capacity="16MiB")
    with Checkpointer(config) as ckpt:
        for step, state in enumerate(states, 1):
            assert ckpt.save_sync(step, state).committed_sync("nvme", timeout=DEADLINE_S)
    version = path / "nvme" / version_dirname(len(states))
    record = next(r for r in Manifest.decode((version / MANIFEST_FILE).read_bytes()).records if r.key == "['b']")
    flip_bits(version / record.file, record.chunks[0].offset + 100, 0x01)
    return config


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.arange(1 << 18, dtype=torch.float32) + value, "b": torch.full((1 << 18,), value)}


def test_a_damaged_chunk_bound_for_a_gpu_template_warns_and_falls_back(tmp_path: Any, fake_cuda_templates: set[int]) -> None:
    from helpers import assert_bitwise, logged_warnings
    from tierckpt import Checkpointer

    config = _save_and_damage(tmp_path, [_state(1.0), _state(2.0)])
    template = {k: torch.zeros_like(v) for k, v in _state(0.0).items()}
    fake_cuda_templates.update(id(v) for v in template.values())
    with Checkpointer(config) as ckpt, logged_warnings(match="step 2"):
        restored = ckpt.restore_latest_sync(template)  # step 2 fails in the ring's buffer: step 1 comes back
    assert restored is not None and restored.step == 1
    assert_bitwise(template, _state(1.0))


def test_a_damaged_chunk_never_reaches_a_gpu_template(tmp_path: Any, fake_cuda_templates: set[int]) -> None:
    from helpers import logged_warnings
    from tierckpt import Checkpointer, CorruptCheckpointError

    config = _save_and_damage(tmp_path, [_state(1.0)])
    template = {k: torch.zeros_like(v) for k, v in _state(0.0).items()}
    fake_cuda_templates.update(id(v) for v in template.values())
    with Checkpointer(config) as ckpt, logged_warnings(match="step 1"):
        with pytest.raises(CorruptCheckpointError, match="partly overwritten"):
            ckpt.restore_latest_sync(template)
    assert torch.equal(template["a"], _state(1.0)["a"])  # verified, copied through the ring
    assert not template["b"].any()  # failed in the ring's buffer: nothing of it was copied
