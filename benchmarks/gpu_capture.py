"""The GPU→host capture stage: tierckpt's capture against a plain pinned copy, and what it costs a training step.

One run measures, on ``--device`` (cuda when available, else cpu), each number a median of
``--repeats`` after warm-up:

1. **Peak**: a state of 200 fp32 tensors (``--size`` in all) copied with plain ``copy_`` into one
   reused, already-touched host buffer of the state's size. On CUDA the buffer is pinned
   (``torch.empty(..., pin_memory=True)``) and the copies are ``non_blocking`` on a side stream, then
   synchronized; on CPU it is a pre-touched pageable buffer, copied on one thread. GB/s (10⁹ bytes a second).
2. **Capture**: a Checkpointer with only a memory tier (3 slots of the state's size, so a save never
   waits for a slot) saves the same state; the time from the ``save_sync`` call to
   ``handle.captured_sync()`` returning. GB/s and its share of the peak (target ≥ 90%).
3. **save() call**: the ``save_sync`` call alone on those 200 tensors, the capture awaited between
   calls: median and p90 in ms (target ≤ 1 ms).
4. **Training step**: a GPT (``benchmarks/gpt.py``) whose weights + AdamW moments come to about
   ``--size``, AdamW, real forward/backward/step on synthetic batches (``--batch`` sequences; bf16
   autocast on CUDA), the compute stream synchronized at the end of each step. For each K of
   ``--every`` (``--every 1 10``: a checkpoint at every step, and at every 10th), the time per step
   (a) without checkpoints (one baseline, shared by every K), (b) with
   ``ckpt.save_sync(step, {"model": ..., "optim": ...})`` at the start of every K-th step and
   ``ckpt.attach(optimizer)`` as the only barrier, (c) DCP ``async_save`` with a ``DefaultStager``,
   a new one per save (torch 2.11's stager, reused, fails on the second save with ``KeyError: <class
   'type'>``, a DCP bug fixed for 2.13), staging awaited before ``optimizer.step()``, and (d) the classic
   DCP ``async_save`` without a stager (it stages into new CPU memory inside the call); for both DCP
   rows, the previous upload is awaited before the next save, as PyTorch's recipe says (output under
   ``--dir``). Slowdown against (a), with the targets ≤ 5% at every step (meaningful only where a step
   is longer than a capture) and ≤ 1% at every 10th; the time the training thread spent in checkpoint
   calls and waits per step; and how long a capture takes (idle, and during training) next to the
   step time.

   A round of a variant is one untimed period of K steps (so that the timed part starts in the steady
   state: the previous save still in flight, as it would be), then about ``--steps`` timed steps, a
   whole number of periods; its step time is the mean of the timed steps (at K > 1 the median would
   skip every step that saves). The variants run in ``--rounds`` rounds, in alternating order; medians
   over the rounds. DCP's saves cost seconds each, so its variants run only in the last ``--dcp-rounds``
   rounds, of at most ``--dcp-periods`` timed periods: a rough figure beside a precise one.
   ``--budget-s`` stops starting rounds that would end past that many seconds from the script's start
   (estimated from the variant's last round, or its warm-up saves); what was cut is said.

Prints a markdown section and writes it with the raw numbers to ``--out``
(``<name>.json``/``.md``, name ``gpu_capture-<time>`` unless ``--name``; both are rewritten after each
part, so a run cut short keeps what it measured), and a PNG of the step time per variant and K
(``<name>.png``) where matplotlib is installed (without it, a note says so). A part that fails is
reported and the run goes on; the exit status is then 1. A failed DCP variant is reported beside the
others and does not fail the run.

    python3 benchmarks/gpu_capture.py --device cuda --every 1 10 --out $OUT    # the GPU machine: ~2 GiB state, ~2 minutes
    .venv/bin/python benchmarks/gpu_capture.py --quick --every 1 2             # tiny sizes, well under a minute
    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/gpu_capture.py --device cpu

DCP's upload writes the state to ``--dir`` at every save (a temporary directory by default, on
``$TMPDIR``'s disk), and the recipe waits for it before the next save: most of a CUDA run's time is
those uploads, and ``--dir /dev/shm`` takes the disk out of DCP's numbers (where /dev/shm is large).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from gpt import GPT, ModelSize
from machine_limits import machine
from tierckpt import Checkpointer
from tierckpt.units import parse_size
from train_loop import batches, state_nbytes

HERE = Path(__file__).resolve().parent
TENSORS = 200  # the state of parts 1-3: 25 layers of 4 matrices and 4 vectors
LAYERS = TENSORS // 8
ALIGN = 4096  # tierckpt starts every tensor 4 KiB-aligned in a slot
PAD = 64  # the peak's buffer starts every tensor at a cache line: any dtype's view is aligned
SLOTS = 3  # one holds the newest version, one is being captured into, one spare while the old one is pruned
WAIT_S = 600.0  # a DCP future not done by then counts as failed, rather than hanging the run
TARGETS = {"capture_share": 0.90, "save_call_ms": 1.0}
SLOWDOWN_PCT = {1: 5.0, 10: 1.0}  # the targets: at every step, and at every 10th (and rarer)


def slowdown_target(every: int) -> float:
    """The slowdown allowed when saving every ``every`` steps: 5% up to every 9th, 1% from every 10th."""
    return SLOWDOWN_PCT[1] if every < 10 else SLOWDOWN_PCT[10]


@dataclasses.dataclass(frozen=True)
class Profile:
    """Defaults per device: the GPU machine gets a ~2 GiB state; this 2-core CPU box something it can train."""

    size_bytes: int
    vocab: int
    block: int  # tokens of context
    batch: int  # sequences per step
    steps: int  # timed steps per round (rounded to whole periods of K steps)
    warmup: int  # untimed steps before anything is measured
    repeats: int  # samples behind the medians of parts 1-3
    rounds: int  # training rounds per variant and K
    dcp_rounds: int  # of which DCP's variants run this many
    dcp_periods: int  # DCP's timed periods of K steps per round, at most


# The H200 ran the 2 GiB model at 28 ms a step with batch 16, shorter than a capture (~45 ms): batch 64
# (~110 ms) makes a save at every step a question the target can answer.
PROFILES = {
    "cuda": Profile(2 << 30, vocab=32768, block=512, batch=64, steps=15, warmup=3, repeats=5, rounds=3, dcp_rounds=1, dcp_periods=2),
    "cpu": Profile(256 << 20, vocab=8192, block=128, batch=8, steps=8, warmup=2, repeats=5, rounds=3, dcp_rounds=2, dcp_periods=3),
    "quick": Profile(32 << 20, vocab=4096, block=64, batch=4, steps=3, warmup=2, repeats=2, rounds=2, dcp_rounds=1, dcp_periods=1),
}


# -- the device ----------------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    """Every stream of the device: before a clock starts, nothing queued earlier may still run."""
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Give freed memory back (device cache, cached pinned blocks) so the next part starts from what it allocates."""
    gc.unfreeze()  # a frozen reference cycle (a closed Checkpointer's) would keep its memory forever
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # private; missing in some builds
        if host_empty_cache is not None:
            host_empty_cache()


def ready_pool(ckpt: Checkpointer) -> None:
    """Every slot of the host pool faulted in (and pinned) now, on this thread at full speed, as a training
    job's pool is by the time it saves; the pool's own thread would take a quarter of a core for it."""
    pool = ckpt._pool
    for slot in getattr(pool, "slots", ()):
        pool.prepare(slot)
    pool.wait_prepared()


def quiet_gc() -> None:
    """A full collection in a torch process takes tens of ms and would land anywhere: none inside the clock."""
    gc.collect()
    gc.freeze()


def human(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def p90(samples: list[float]) -> float:
    """Nearest rank: an observed value, never one extrapolated beyond the samples."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


# -- parts 1-3: a 200-tensor state ---------------------------------------------------------------------


def make_state(nbytes: int, device: str) -> dict[str, torch.Tensor]:
    """25 transformer-like layers of 8 fp32 tensors (4 matrices, 4 vectors): exactly 200, about ``nbytes``."""
    hidden = max(8, int((nbytes / (LAYERS * 12 * 4)) ** 0.5))  # 12 h² floats of matrices a layer
    torch.manual_seed(0)
    shapes: dict[str, tuple[int, ...]] = {"qkv.weight": (3 * hidden, hidden), "proj.weight": (hidden, hidden), "fc.weight": (4 * hidden, hidden), "out.weight": (hidden, 4 * hidden)}
    shapes |= {name: (hidden,) for name in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias")}
    state = {f"layers.{i}.{name}": torch.randn(shape, device=device) for i in range(LAYERS) for name, shape in shapes.items()}
    assert len(state) == TENSORS
    return state


def pinned_buffer(nbytes: int, device: str) -> torch.Tensor:
    """A host buffer of ``nbytes``, touched: page-locked on CUDA (pageable if the system refuses), pageable on CPU."""
    host = None
    if device == "cuda":
        try:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            print(f"peak: pinning {human(nbytes)} failed ({exc}); measuring a pageable buffer", flush=True)
    if host is None:
        host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(0)  # the reused-buffer case: every page faulted in before the clock
    return host


def copier(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: str) -> Callable[[], tuple[float, float | None]]:
    """One timed copy of every (source, destination) pair: wall seconds, and on CUDA the copy stream's own seconds."""
    if device != "cuda":

        def copy_cpu() -> tuple[float, float | None]:
            # One thread: torch's intra-op threads wait milliseconds per copy_ for a core whenever other
            # processes hold them (measured here: 4 ms or 460 ms for the same 32 MiB), which no capture pays.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                t = time.perf_counter()
                for src, dst in pairs:
                    dst.copy_(src)
                return time.perf_counter() - t, None
            finally:
                torch.set_num_threads(threads)

        return copy_cpu
    stream = torch.cuda.Stream()  # created once, as a checkpointer would

    def copy_cuda() -> tuple[float, float | None]:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            start.record(stream)
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            end.record(stream)
        stream.synchronize()
        wall = time.perf_counter() - t
        return wall, start.elapsed_time(end) / 1e3  # elapsed_time is in ms

    return copy_cuda


def bench_peak(state: dict[str, torch.Tensor], device: str, repeats: int) -> dict[str, Any]:
    """Part 1: plain ``copy_`` of every tensor into one reused host buffer of the state's size (``{"peak": ...}``)."""
    total = sum(nbytes_of(t) for t in state.values())
    host = pinned_buffer(total + PAD * len(state), device)
    pairs, offset = [], 0
    for tensor in state.values():
        # Typed views, as tierckpt's slots are: on CPU, copy_ between uint8 views runs ~5x slower than between
        # fp32 ones (measured here), which would flatter the capture.
        n = nbytes_of(tensor)
        pairs.append((tensor, host[offset : offset + n].view(tensor.dtype).view(tensor.shape)))
        offset += -(-n // PAD) * PAD
    copy = copier(pairs, device)
    copy()  # warm-up: first-use costs (stream, kernels) stay out of the clock
    samples = [copy() for _ in range(repeats)]
    pinned = host.is_pinned()
    del pairs, host, copy
    release(device)
    wall = [w for w, _ in samples]
    out: dict[str, Any] = {"bytes": total, "pinned": pinned, "seconds": statistics.median(wall), "samples_s": wall}
    out["gbps"] = total / out["seconds"] / 1e9
    if device == "cuda":
        out["stream_seconds"] = statistics.median(s for _, s in samples if s is not None)
    return {"peak": out}


def capture_config(nbytes: int, tensors: int, copy_threads: int) -> dict[str, Any]:
    """A memory tier only; ``SLOTS`` slots of the state's size (+ 4 KiB alignment per tensor, + room for the rest)."""
    slot = nbytes + ALIGN * tensors + (16 << 20)
    return {
        "host": {"capacity": SLOTS * slot, "snapshots": SLOTS, "copy_threads": copy_threads},
        "tiers": [{"name": "ram", "type": "memory", "keep": {"last": 1}}],
    }


def timed_save(ckpt: Checkpointer, step: int, state: Any, device: str) -> tuple[float, float]:
    """One save from an idle device: (the ``save_sync`` call, from the call to ``captured_sync`` returning)."""
    synchronize(device)
    t = time.perf_counter()
    handle = ckpt.save_sync(step, state)
    called = time.perf_counter()
    if not handle.captured_sync(WAIT_S):
        raise RuntimeError(f"step {step} was skipped: no free host slot")
    return called - t, time.perf_counter() - t


def bench_capture(state: dict[str, torch.Tensor], device: str, saves: int, copy_threads: int) -> dict[str, Any]:
    """Parts 2 and 3 (``{"capture": ..., "save_call": ...}``): every save gives a call time and a capture
    time, the capture awaited before the next save."""
    total = sum(nbytes_of(t) for t in state.values())
    ckpt = Checkpointer(capture_config(total, len(state), copy_threads))
    try:
        ready_pool(ckpt)
        for step in range(2):  # warm-up: first-use costs of the copy threads and the pipeline
            timed_save(ckpt, step, state, device)
        quiet_gc()
        samples = [timed_save(ckpt, step, state, device) for step in range(2, 2 + saves)]
        pinned = getattr(ckpt, "pinned", None)  # the host pool is page-locked (newer tierckpt only)
        counters = ckpt.counters
    finally:
        ckpt.close_sync()
    del ckpt
    release(device)
    calls_ms = [1e3 * call for call, _ in samples]
    captures = [captured for _, captured in samples]
    capture: dict[str, Any] = {"bytes": total, "seconds": statistics.median(captures), "samples_s": captures, "pool_pinned": pinned}
    capture["gbps"] = total / capture["seconds"] / 1e9
    capture["counters"] = {"saves": counters.saves, "skipped_saves": counters.skipped_saves, "captures_failed": counters.captures_failed}
    call = {"tensors": len(state), "median_ms": statistics.median(calls_ms), "p90_ms": p90(calls_ms), "samples_ms": calls_ms}
    return {"capture": capture, "save_call": call}


# -- part 4: the training step --------------------------------------------------------------------------


def model_size(state_bytes: int, profile: Profile, batch: int | None = None) -> ModelSize:
    """A GPT whose weights + AdamW moments (12 bytes a parameter) come to about ``state_bytes``: the widest
    d_model (a multiple of 64, heads of 64) that 8 layers leave room for, then as many layers as fit."""
    params = state_bytes / 12

    def embeddings(d: int) -> int:  # tokens, positions and the untied head
        return (2 * profile.vocab + profile.block) * d

    def layer(d: int) -> int:  # qkv, proj, fc, out with their biases, two LayerNorms
        return 12 * d * d + 13 * d

    d = 64
    while embeddings(d + 64) + 8 * layer(d + 64) <= params:
        d += 64
    layers = max(1, round((params - embeddings(d) - 2 * d) / layer(d)))
    return ModelSize(vocab=profile.vocab, d_model=d, layers=layers, heads=d // 64, block=profile.block, batch=batch or profile.batch)


class Trainer:
    """The GPT, AdamW and synthetic batches; :meth:`step` is one training step, ended by a synchronize."""

    def __init__(self, size: ModelSize, device: str, precision: str) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = GPT(size).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.01)
        self.next_batch = batches(size, device)
        self.bf16 = precision == "bf16"

    def state(self) -> dict[str, Any]:
        # References, not copies: each checkpointer copies them itself.
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def step(self, before_update: Callable[[], None] = lambda: None) -> None:
        inputs, targets = self.next_batch()
        with torch.autocast(device_type=self.device, dtype=torch.bfloat16, enabled=self.bf16):
            loss = F.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        before_update()
        self.optimizer.step()
        if self.device == "cuda":
            # The compute stream only, as train_loop.py: a checkpointer's copy stream may keep running.
            torch.cuda.current_stream().synchronize()


class NoCheckpoint:
    """The baseline, and the interface of every variant. ``spent`` holds this round's seconds in checkpoint
    calls and waits, by kind."""

    name = "none"
    label = "no checkpoint"
    is_dcp = False

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.save_s = 0.0  # what one save cost in the warm-up, wall seconds: the budget's first estimate

    def begin(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a round (untimed)."""
        self.spent = {}

    def save(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """At the start of a step; builds the state itself, so that the state_dict() calls count as its time."""

    def before_update(self) -> None:
        """Right before ``optimizer.step()``."""

    def end(self) -> None:
        """After a round (untimed): wait for what is still in flight."""

    def close(self) -> None:
        pass

    def extra(self) -> dict[str, Any]:
        """What the variant measured over the whole run (not per round)."""
        return {}

    def round_extra(self) -> dict[str, float | None]:
        """What the variant measured in the round that just ended (after :meth:`end`)."""
        return {}

    def _add(self, kind: str, since: float) -> None:
        self.spent[kind] = self.spent.get(kind, 0.0) + time.perf_counter() - since


class Tierckpt(NoCheckpoint):
    """``save_sync`` at the start of the step, ``attach(optimizer)`` the only barrier (timed by hooks around it);
    a thread records when each capture finished."""

    name = "tierckpt"
    label = "tierckpt"

    def __init__(self, nbytes: int, tensors: int, copy_threads: int) -> None:
        super().__init__()
        self.ckpt = Checkpointer(capture_config(nbytes, tensors, copy_threads))
        ready_pool(self.ckpt)  # every slot faulted and pinned before anything is timed
        self.calls_s: list[float] = []  # this round's save_sync calls
        self.captures_s: list[float] = []  # this round's: from the save call to captured, while training runs
        self.idle_captures_s: list[float] = []  # the same with nothing else running
        self.handles: queue.Queue[Any] = queue.Queue()
        self.hooks: list[Any] = []
        self.error: BaseException | None = None
        self.pinned: bool | None = None

    def warm(self, trainer: Trainer, step: int, repeats: int) -> None:
        """Before the rounds: one warm-up save, then ``repeats`` timed captures of the training state alone
        (steps ``step`` to ``step + repeats``)."""
        for i in range(repeats + 1):
            _, captured = timed_save(self.ckpt, step + i, trainer.state(), trainer.device)
            if i:
                self.idle_captures_s.append(captured)

    def begin(self, optimizer: torch.optim.Optimizer) -> None:
        super().begin(optimizer)
        self.calls_s, self.captures_s, self.error = [], [], None
        started = 0.0

        def before(*_: Any) -> None:
            nonlocal started
            started = time.perf_counter()

        def after(*_: Any) -> None:
            self._add("barrier", started)

        # Step pre-hooks run in the order registered: the two around attach() time its barrier.
        self.hooks = [optimizer.register_step_pre_hook(before), self.ckpt.attach(optimizer), optimizer.register_step_pre_hook(after)]
        self.waiter = threading.Thread(target=self._wait_captures, name="capture-waiter", daemon=True)
        self.waiter.start()

    def _wait_captures(self) -> None:
        while (item := self.handles.get()) is not None:
            handle, saved = item
            try:
                handle.captured_sync(WAIT_S)
                self.captures_s.append(time.perf_counter() - saved)
            except BaseException as exc:  # raised in end(), on the training thread
                self.error = self.error or exc

    def save(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        t = time.perf_counter()
        handle = self.ckpt.save_sync(step, state())
        self.calls_s.append(time.perf_counter() - t)
        self._add("call", t)
        self.handles.put((handle, t))

    def end(self) -> None:
        try:
            self.ckpt.wait_sync()
        finally:
            self.handles.put(None)
            self.waiter.join()
            for hook in self.hooks:
                hook.remove()
            self.hooks = []
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.pinned = getattr(self.ckpt, "pinned", None)  # the host pool is page-locked (newer tierckpt only)
        self.ckpt.close_sync()

    def extra(self) -> dict[str, Any]:
        return {
            "pool_pinned": self.pinned,
            "capture_idle_s": statistics.median(self.idle_captures_s) if self.idle_captures_s else None,
        }

    def round_extra(self) -> dict[str, float | None]:
        calls_ms = [1e3 * s for s in self.calls_s]
        return {
            "capture_in_training_s": statistics.median(self.captures_s) if self.captures_s else None,
            "save_call_ms": statistics.median(calls_ms) if calls_ms else None,
            "save_call_p90_ms": p90(calls_ms) if calls_ms else None,
        }


def staging_options(device: str, nbytes: int) -> tuple[Any, str]:
    """DCP's defaults on CUDA (pinned, shared memory, async staging, non-blocking copies). Its shared memory
    lives in /dev/shm, which containers often keep small: writing past it kills the process (SIGBUS), so
    without room for the state the staging goes without shared memory. On CPU the accelerator-only options
    are off, as in train_loop.py."""
    from torch.distributed.checkpoint.staging import StagingOptions

    if device != "cuda":
        return StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False), "CPU: no pinned or shared memory, no non-blocking copies"
    try:
        stat = os.statvfs("/dev/shm")
        room = stat.f_bavail * stat.f_frsize
    except OSError:
        room = 0
    if room >= nbytes * 5 // 4:
        return StagingOptions(), "defaults (pinned + shared memory, async staging, non-blocking copies)"
    note = f"pinned, async, non-blocking, but no shared memory: /dev/shm has {human(room)} free for a {human(nbytes)} state"
    return StagingOptions(use_shared_memory=False), note


class DcpVariant(NoCheckpoint):
    """PyTorch's recipe for ``async_save``: the previous upload awaited before the next save (older checkpoints
    deleted then: at most 2 on disk), and where the staging is a future, it is awaited before
    ``optimizer.step()`` changes the state. Subclasses make the call (:meth:`async_save`)."""

    is_dcp = True
    prefix = "dcp"  # of its checkpoint directories

    def __init__(self, directory: Path) -> None:
        super().__init__()
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.directory = directory
        self.staging: Any = None
        self.upload: Any = None
        self.written: list[Path] = []

    def async_save(self, state: dict[str, Any], path: Path) -> Any:
        raise NotImplementedError

    def save(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        if self.upload is not None:
            t = time.perf_counter()
            self._finish_upload()
            self._add("upload", t)
        t = time.perf_counter()
        path = self.directory / f"{self.prefix}-{step:06d}"
        response = self.async_save(state(), path)
        self.written.append(path)
        # With async staging it answers (staging, upload) futures; without, or an older torch, one future.
        self.staging = getattr(response, "staging_completion", None)
        self.upload = getattr(response, "upload_completion", response)
        self._add("call", t)

    def before_update(self) -> None:
        if self.staging is not None:
            t = time.perf_counter()
            staging, self.staging = self.staging, None
            staging.result(WAIT_S)
            self._add("staging", t)

    def _finish_upload(self) -> None:
        upload, self.upload = self.upload, None
        upload.result(WAIT_S)
        for old in self.written[:-1]:  # the newest is durable: drop the others
            shutil.rmtree(old, ignore_errors=True)
        self.written = self.written[-1:]
        self.uploaded()

    def uploaded(self) -> None:
        """After an upload: nothing of the checkpoints saved so far is in use any more."""

    def end(self) -> None:
        self.before_update()
        if self.upload is not None:
            self._finish_upload()

    def extra(self) -> dict[str, Any]:
        return {"directory": str(self.directory)}


class DcpStager(DcpVariant):
    """``async_save`` with a ``DefaultStager``, a new one per save: torch 2.11's stager, reused, fails on its
    second save (``KeyError: <class 'type'>``, fixed for 2.13). Each is closed once its upload is done
    (its executor stops, its buffers are let go), on the training thread, as part of the upload wait."""

    name = "dcp.async_save+stager"
    label = "DCP `async_save` + `DefaultStager` (a new one per save)"
    prefix = "dcp-stager"

    def __init__(self, directory: Path, device: str, nbytes: int) -> None:
        super().__init__(directory)
        from torch.distributed.checkpoint.staging import DefaultStager

        options, self.options_note = staging_options(device, nbytes)
        self.new_stager: Callable[[], Any] = functools.partial(DefaultStager, options)
        self.stagers: list[Any] = []

    def async_save(self, state: dict[str, Any], path: Path) -> Any:
        stager = self.new_stager()
        self.stagers.append(stager)
        return self.dcp.async_save(state, checkpoint_id=path, async_stager=stager, no_dist=True)

    def uploaded(self) -> None:
        stagers, self.stagers = self.stagers, []
        for stager in stagers:
            stager.close()

    def close(self) -> None:
        self.uploaded()

    def extra(self) -> dict[str, Any]:
        return super().extra() | {"staging": f"a new `DefaultStager` per save: {self.options_note}"}


class DcpClassic(DcpVariant):
    """The classic ``async_save`` without a stager: DCP copies the state into new CPU memory inside the call,
    then writes it on a thread."""

    name = "dcp.async_save"
    label = "DCP `async_save`, no stager (classic)"
    prefix = "dcp-classic"

    def async_save(self, state: dict[str, Any], path: Path) -> Any:
        return self.dcp.async_save(state, checkpoint_id=path, no_dist=True)

    def extra(self) -> dict[str, Any]:
        return super().extra() | {"staging": "inside the call, into new CPU memory (no stager)"}


DCP_VARIANTS: tuple[type[DcpVariant], ...] = (DcpStager, DcpClassic)


def dcp_unavailable(variant: type[DcpVariant]) -> str | None:
    """Why ``variant`` cannot run with this torch, or None."""
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this build"
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as exc:
        return f"no torch.distributed.checkpoint in torch {torch.__version__}: {exc}"
    if not hasattr(dcp, "async_save"):
        return f"no async_save in torch {torch.__version__}"
    if variant is DcpStager:
        try:
            import torch.distributed.checkpoint.staging as staging
        except ImportError as exc:
            return f"no torch.distributed.checkpoint.staging in torch {torch.__version__}: {exc}"
        if not hasattr(staging, "DefaultStager") or not hasattr(staging, "StagingOptions"):
            return f"no DefaultStager in torch {torch.__version__}"
    return None


def timed_periods(steps: int, every: int) -> int:
    """Whole periods of ``every`` steps that come closest to ``steps`` timed steps (at least one)."""
    return max(1, round(steps / every))


def run_round(trainer: Trainer, variant: NoCheckpoint, every: int, periods: int, first_step: int) -> tuple[list[float], dict[str, float], dict[str, float | None]]:
    """One untimed period of ``every`` steps, then ``periods`` timed ones; a save at the start of every
    ``every``-th step. Returns each timed step's seconds, the seconds the variant spent in them by kind, and
    the variant's :meth:`~NoCheckpoint.round_extra`."""
    times: list[float] = []
    lead = every  # the steady state: the timed part's first save finds the previous one in flight
    variant.begin(trainer.optimizer)
    try:
        for i in range(lead + periods * every):
            if i == lead:
                variant.spent = {}
            t = time.perf_counter()
            if i % every == 0:
                variant.save(first_step + i, trainer.state)
            trainer.step(variant.before_update)
            if i >= lead:
                times.append(time.perf_counter() - t)
        spent = dict(variant.spent)  # end()'s waits are not the timed steps'
    finally:
        variant.end()
    return times, spent, variant.round_extra()


def warmed(variant: NoCheckpoint, warm: Callable[[], Any], saves: int, missing: dict[str, str]) -> bool:
    """Run ``warm()`` (``saves`` saves, which sets ``variant.save_s``); on failure note it in ``missing``, close
    the variant and answer False."""
    try:
        t = time.monotonic()
        warm()
        variant.save_s = (time.monotonic() - t) / saves
        return True
    except Exception as exc:
        missing[variant.name] = f"failed while warming up: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    with contextlib.suppress(Exception):
        variant.close()
    return False


def build_variants(trainer: Trainer, args: argparse.Namespace, nbytes: int, tensors: int, work: Path) -> tuple[list[NoCheckpoint], dict[str, str], int]:
    """The baseline, tierckpt (warmed up, idle captures timed) and each DCP variant where it runs (one
    warm-up checkpoint made durable: a stager allocates its buffers then); returns the variants, why any is
    missing, and the next free step number. A variant that fails here is left out, and the others still run."""
    variants: list[NoCheckpoint] = [NoCheckpoint()]
    missing: dict[str, str] = {}
    step = 1
    try:
        tier = Tierckpt(nbytes, tensors, args.copy_threads)
    except Exception as exc:
        missing[Tierckpt.name] = f"failed to construct: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    else:
        if warmed(tier, lambda: tier.warm(trainer, step, args.repeats), args.repeats + 1, missing):
            variants.append(tier)
    step += args.repeats + 1
    for kind in DCP_VARIANTS:
        why = dcp_unavailable(kind)
        if why is not None:
            missing[kind.name] = f"unavailable: {why}"
            continue
        try:
            dcp = DcpStager(work, args.device, nbytes) if kind is DcpStager else kind(work)
        except Exception as exc:
            missing[kind.name] = f"failed to construct: {type(exc).__name__}: {exc}"
            traceback.print_exc()
            continue
        # Two saves: the second is the one that failed with a reused stager on torch 2.11.
        if warmed(dcp, functools.partial(run_round, trainer, dcp, 1, 1, step), 2, missing):
            variants.append(dcp)
        step += 2
    return variants, missing, step


def summarize(rounds: list[dict[str, Any]], baseline_s: float | None) -> dict[str, Any]:
    """A variant's medians over its rounds: step time, slowdown against the baseline, seconds spent per step,
    and what it measured per round."""
    step_s = statistics.median(r["step_s"] for r in rounds)
    kinds = sorted({k for r in rounds for k in r["spent_per_step_s"]})
    out: dict[str, Any] = {"step_s": step_s, "timed_steps": [len(r["steps_s"]) for r in rounds], "rounds": rounds}
    out["stall_per_step_s"] = statistics.median(sum(r["spent_per_step_s"].values()) for r in rounds)
    out["spent_per_step_s"] = {k: statistics.median(r["spent_per_step_s"].get(k, 0.0) for r in rounds) for k in kinds}
    if baseline_s is not None:
        out["slowdown_pct"] = 100 * (step_s / baseline_s - 1)
    measured = {k for r in rounds for k in r["extra"]}
    out["round_extra"] = {k: statistics.median(vs) for k in sorted(measured) if (vs := [r["extra"][k] for r in rounds if r["extra"].get(k) is not None])}
    return out


def bench_training(args: argparse.Namespace, profile: Profile, work: Path) -> dict[str, Any]:
    """Part 4: every variant at every K in rounds, in alternating order, the model trained throughout; the
    baseline once a round, shared by every K."""
    size = model_size(args.size, profile, args.batch)
    parameters, nbytes, tensors = state_nbytes(size)
    trainer = Trainer(size, args.device, args.precision)
    for _ in range(profile.warmup):  # the AdamW moments exist from here on; kernels chosen, memory cached
        trainer.step()
    out: dict[str, Any] = {
        "model": dataclasses.asdict(size) | {"parameters": parameters, "state_bytes": nbytes, "tensors": tensors},
        "precision": args.precision, "every": args.every, "steps": args.steps, "rounds": args.rounds, "warmup": profile.warmup,
        "dcp_rounds": args.dcp_rounds, "dcp_periods": args.dcp_periods,
    }  # fmt: skip
    print(f"training: GPT {parameters / 1e6:.1f} M parameters, state {human(nbytes)} in {tensors} tensors ({elapsed(args)})", flush=True)
    variants, missing, step = build_variants(trainer, args, nbytes, tensors, work)
    print(f"training: variants ready: {', '.join(v.name for v in variants)} ({elapsed(args)})", flush=True)
    baseline, checkpointers = variants[0], variants[1:]
    plan = [(baseline, 1)] + [(v, k) for k in args.every for v in checkpointers]
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {(v.name, k): [] for v, k in plan}
    errors: dict[str, str] = {}
    took: dict[tuple[str, int], float] = {}  # each (variant, K)'s last round, seconds: what the next may take
    cut: list[str] = []
    quiet_gc()
    for r in range(args.rounds):
        for variant, every in plan if r % 2 == 0 else plan[::-1]:
            key = (variant.name, every)
            # DCP's variants run in the last rounds: what --budget-s cuts first is the rough figure.
            if variant.name in errors or (variant.is_dcp and r < args.rounds - args.dcp_rounds):
                continue
            periods = timed_periods(args.steps, every)
            if variant.is_dcp:
                periods = min(periods, args.dcp_periods)
            if key not in took:  # no round of it yet: its saves as the warm-up had them, and the steps
                step_s = statistics.median(x["step_s"] for x in rounds[(baseline.name, 1)]) if rounds[(baseline.name, 1)] else 0.0
                took[key] = (1 + periods) * (variant.save_s + every * step_s)
            if args.deadline is not None and time.monotonic() + took[key] > args.deadline:
                cut.append(f"round {r} of {variant.name} every {every}")
                continue
            t = time.monotonic()
            try:
                times, spent, extra = run_round(trainer, variant, every, periods, step)
            except Exception as exc:
                errors[variant.name] = f"failed in round {r} (every {every}): {type(exc).__name__}: {exc}"
                traceback.print_exc()
                continue
            finally:
                step += (1 + periods) * every
                took[key] = time.monotonic() - t
            n = len(times)
            rounds[key].append({"step_s": sum(times) / n, "steps_s": times, "spent_per_step_s": {k: s / n for k, s in spent.items()}, "extra": extra})
            print(
                f"round {r}: {variant.name:22s} every {every:3d}: {1e3 * sum(times) / n:8.1f} ms a step, "
                f"{1e3 * sum(spent.values()) / n:7.2f} ms in checkpointing ({elapsed(args)})",
                flush=True,
            )
    for variant in variants:
        try:
            variant.close()
        except Exception as exc:
            errors.setdefault(variant.name, f"close failed: {type(exc).__name__}: {exc}")
    base_rounds = rounds[(baseline.name, 1)]
    if baseline.name in errors or not base_rounds:
        out["baseline"] = {"error": errors.get(baseline.name, "no round ran")}
        baseline_s = None
    else:
        out["baseline"] = summarize(base_rounds, None)
        del out["baseline"]["round_extra"]  # nothing measured beside the steps
        baseline_s = out["baseline"]["step_s"]
    out["runs"] = []
    for every in args.every:
        run: dict[str, Any] = {"every": every, "variants": {}}
        for variant in checkpointers:
            result: dict[str, Any] = {"extra": variant.extra()}
            if variant.name in errors:
                result |= {"error": errors[variant.name], "unavailable": False}
            elif rounds[(variant.name, every)]:
                result |= summarize(rounds[(variant.name, every)], baseline_s)
                result["extra"] |= result.pop("round_extra")
            else:
                result |= {"error": "no round ran in the time --budget-s left", "unavailable": False, "cut": True}
            run["variants"][variant.name] = result
        for name, why in missing.items():
            run["variants"][name] = {"error": why, "unavailable": why.startswith("unavailable:")}
        out["runs"].append(run)
    if cut:
        out["cut"] = cut
    del trainer, variants, checkpointers, baseline
    release(args.device)
    return out


# -- the report -----------------------------------------------------------------------------------------


VARIANTS: tuple[type[NoCheckpoint], ...] = (NoCheckpoint, Tierckpt, *DCP_VARIANTS)
LABELS = {cls.name: cls.label for cls in VARIANTS}
SHORT = {NoCheckpoint.name: "none", Tierckpt.name: "tierckpt", DcpStager.name: "DCP + stager\n(new per save)", DcpClassic.name: "DCP classic\n(no stager)"}


def capture_of(variant: dict[str, Any]) -> float | None:
    """A tierckpt result's capture seconds: during training where measured, else idle."""
    extra = variant.get("extra", {})
    return extra.get("capture_in_training_s") or extra.get("capture_idle_s")


def verdicts(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, checked on the medians (reported, never tuned for). ``met`` is None where a target
    does not apply: saving every K steps cannot cost nothing when a capture takes longer than K steps."""
    out: list[dict[str, Any]] = []
    peak, capture, call = report.get("peak"), report.get("capture"), report.get("save_call")
    if peak and capture:
        share = peak["seconds"] / capture["seconds"]
        out.append({"what": "capture throughput / peak", "value": f"{100 * share:.0f}%", "target": f"≥ {100 * TARGETS['capture_share']:.0f}%", "met": share >= TARGETS["capture_share"]})
    if call:
        ms = call["median_ms"]
        out.append({"what": f"save() call, {call['tensors']} tensors (median)", "value": f"{ms:.3f} ms", "target": f"≤ {TARGETS['save_call_ms']:g} ms", "met": ms <= TARGETS["save_call_ms"]})
    training = report.get("training", {})
    base = training.get("baseline", {}).get("step_s")
    for run in training.get("runs", []):
        tier = run["variants"].get(Tierckpt.name, {})
        if "slowdown_pct" not in tier or base is None:
            continue
        every, pct = run["every"], tier["slowdown_pct"]
        target = slowdown_target(every)
        item: dict[str, Any] = {"what": f"training-step slowdown, tierckpt every {every} step(s)", "value": f"{pct:+.1f}%", "target": f"≤ {target:g}%", "met": pct <= target}
        taken = capture_of(tier)
        if taken is not None and taken >= every * base:
            item["met"] = None
            item["note"] = f"not applicable: a capture ({1e3 * taken:.1f} ms) takes longer than {every} step(s) ({1e3 * every * base:.1f} ms)"
        out.append(item)
    return out


def header(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    gpu = f"{report['gpu']} (CUDA {report['cuda']})" if report["device"] == "cuda" else "none used"
    pinned = report.get("peak", {}).get("pinned")
    pool = report.get("capture", {}).get("pool_pinned")
    return [
        f"### GPU→host capture: tierckpt vs a plain copy, and the training step ({report['time']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; GPU: {gpu}; Python {m['python']}, "
        f"torch {m['torch']}. Device: `{report['device']}`. Host buffers pinned: peak buffer {pinned}, tierckpt pool "
        f"{'unknown (no `pinned` property)' if pool is None else pool}. Medians of {report['repeats']}. "
        f"Command: `{report['command']}`; raw numbers: `{report['json']}`.",
        "",
    ]


def copy_table(report: dict[str, Any]) -> list[str]:
    peak, capture, call = report.get("peak"), report.get("capture"), report.get("save_call")
    if not peak and not capture:
        return []
    state: dict[str, Any] = peak or capture or {}
    lines = [
        f"State: {TENSORS} fp32 tensors ({LAYERS} layers of 4 matrices and 4 vectors), {human(state['bytes'])}, on `{report['device']}`.",
        "",
        "| measure | seconds | GB/s | share of the peak |",
        "| --- | ---: | ---: | ---: |",
    ]
    how = "pinned buffer, `non_blocking` on a side stream, synchronized" if report["device"] == "cuda" else "pre-touched buffer, one thread"
    if peak:
        stream = f" (copy stream alone {peak['stream_seconds']:.4f} s)" if "stream_seconds" in peak else ""
        lines.append(f"| peak: plain `copy_` into one reused host buffer ({how}){stream} | {peak['seconds']:.4f} | {peak['gbps']:.2f} | 100% |")
    if capture:
        share = f"{100 * peak['seconds'] / capture['seconds']:.0f}%" if peak else ""
        lines.append(f"| tierckpt capture: `save_sync` → `captured_sync` | {capture['seconds']:.4f} | {capture['gbps']:.2f} | {share} |")
    if call:
        lines += ["", f"`save_sync` call alone, {call['tensors']} tensors, {len(call['samples_ms'])} saves: median {call['median_ms']:.3f} ms, p90 {call['p90_ms']:.3f} ms."]
    return lines + [""]


def variant_row(label: str, v: dict[str, Any], baseline: bool = False) -> str:
    if "error" in v:
        return f"| {label} | {v['error']} | | | | | |"
    slowdown = f"{v['slowdown_pct']:+.1f}%" if "slowdown_pct" in v else ""
    if "slowdown_pct" in v and v["slowdown_pct"] >= 100:
        slowdown += f" (×{1 + v['slowdown_pct'] / 100:.1f})"
    parts = ", ".join(f"{k} {1e3 * s:.2f}" for k, s in v["spent_per_step_s"].items())
    extra = v.get("extra", {})
    capture = ""
    if extra.get("capture_idle_s") is not None:
        during = extra.get("capture_in_training_s")
        capture = f"{1e3 * extra['capture_idle_s']:.1f} / {'' if during is None else f'{1e3 * during:.1f}'}"
    stall = "" if baseline else f"{1e3 * v['stall_per_step_s']:.2f}"
    steps = v["timed_steps"]
    shape = f"{len(steps)} × {steps[0]}" if len(set(steps)) == 1 else " + ".join(map(str, steps))
    return f"| {label} | {1e3 * v['step_s']:.1f} | {slowdown} | {stall} | {parts} | {capture} | {shape} |"


def training_table(training: dict[str, Any]) -> list[str]:
    m = training["model"]
    lines = [
        f"Training: GPT ({m['layers']} layers, d_model {m['d_model']}, vocab {m['vocab']}), {m['parameters'] / 1e6:.1f} M parameters; "
        f"state (weights + AdamW moments) {human(m['state_bytes'])} in {m['tensors']} tensors; batch {m['batch']} × {m['block']} tokens, "
        f"{training['precision']}; after {training['warmup']} warm-up steps and warm-up checkpoints, {training['rounds']} rounds per variant "
        f"and K in alternating order (DCP: {training['dcp_rounds']}, of at most {training['dcp_periods']} timed period(s) each), each an untimed "
        f"period of K steps then about {training['steps']} timed steps in whole periods; a round's step time is the mean of its timed "
        f"steps; medians over the rounds. The baseline runs once a round and serves every K.",
        "",
    ]
    baseline = training.get("baseline", {})
    for run in training["runs"]:
        every = run["every"]
        lines += [
            f"**A checkpoint every {every} step(s)** (slowdown target ≤ {slowdown_target(every):g}%)",
            "",
            "| checkpointing | step ms | slowdown | in checkpointing, ms a step | of which, ms a step | capture ms: idle / during training | rounds × timed steps |",
            "| --- | ---: | ---: | ---: | --- | --- | --- |",
            variant_row(LABELS["none"], baseline, baseline=True),
        ]
        lines += [variant_row(LABELS.get(name, name), v) for name, v in run["variants"].items()]
        tier = run["variants"].get(Tierckpt.name, {})
        taken = capture_of(tier)
        if "step_s" in baseline and taken is not None and taken > every * baseline["step_s"]:
            lines += ["", f"A capture ({1e3 * taken:.1f} ms) takes longer than {every} step(s): saving this often is bounded by the copy."]
        lines.append("")
    notes = "tierckpt: call = the `save_sync` call with the `state_dict()` calls; barrier = the wait `attach(optimizer)` adds before `optimizer.step()`."
    first = training["runs"][0]["variants"] if training["runs"] else {}
    dcp = {c.name: first[c.name].get("extra", {}) for c in DCP_VARIANTS if c.name in first}
    if any("staging" in e for e in dcp.values()):
        staging = "; ".join(f"{LABELS[name]}: {e['staging']}" for name, e in dcp.items() if "staging" in e)
        where = next(e["directory"] for e in dcp.values() if "directory" in e)
        notes += (
            " DCP: call = `async_save` with the `state_dict()` calls; staging = the wait for a staging future before `optimizer.step()`; "
            f"upload = the wait for the previous upload before a save (with deleting old checkpoints), writing to `{where}`. Staging: {staging}."
        )
    lines += [notes, ""]
    if training.get("cut"):
        lines += [f"Cut by `--budget-s`: {', '.join(training['cut'])}.", ""]
    return lines


def markdown(report: dict[str, Any]) -> str:
    lines = header(report) + copy_table(report)
    if "training" in report:
        lines += training_table(report["training"])
    if report.get("plot"):
        lines += [f"Plot: {report['plot']}.", ""]
    checks = report.get("targets", [])
    if checks:

        def verdict(c: dict[str, Any]) -> str:
            return c["note"] if c["met"] is None else "met" if c["met"] else "NOT met"

        lines += ["Targets: " + "; ".join(f"{c['what']}: {c['value']} (target {c['target']}, {verdict(c)})" for c in checks) + ".", ""]
    for part, error in report.get("errors", {}).items():
        lines += [f"**{part} failed**: `{error.strip().splitlines()[-1]}`", ""]
    return "\n".join(lines)


# -- the plot -------------------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> str:
    """A PNG of the step time per variant, one panel per K (matplotlib, the ``bench`` extra). Returns what
    to say in the report: the file, or why there is none (never raises: a plot is not a measurement)."""
    training = report.get("training")
    if not training or "step_s" not in training.get("baseline", {}):
        return "none (no training part)"
    try:
        import matplotlib
    except ImportError:
        note = "none: matplotlib is not installed (`pip install matplotlib`, the `bench` extra)"
        print(f"plot: {note}", flush=True)
        return note
    try:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {"none": "tab:gray", Tierckpt.name: "tab:blue", DcpStager.name: "tab:orange", DcpClassic.name: "tab:red"}
        base_ms = 1e3 * training["baseline"]["step_s"]
        runs = training["runs"]
        fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs) + 1, 4.4), squeeze=False)
        for ax, run in zip(axes[0], runs):
            every = run["every"]
            names = ["none"] + [n for n, v in run["variants"].items() if "step_s" in v]
            values = [base_ms] + [1e3 * run["variants"][n]["step_s"] for n in names[1:]]
            bars = ax.bar(range(len(names)), values, color=[colors.get(n, "tab:green") for n in names])
            ax.plot([0] * len(training["baseline"]["rounds"]), [1e3 * r["step_s"] for r in training["baseline"]["rounds"]], "k.", markersize=4)
            for bar, name in zip(bars, names):
                v = run["variants"].get(name, {})
                text = f"{v['slowdown_pct']:+.1f}%" if "slowdown_pct" in v else f"{base_ms:.1f} ms"
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
            for name in names[1:]:  # every round's step time, over the bar of its median
                rounds = run["variants"][name]["rounds"]
                ax.plot([names.index(name)] * len(rounds), [1e3 * r["step_s"] for r in rounds], "k.", markersize=4)
            ax.axhline(base_ms * (1 + slowdown_target(every) / 100), color="gray", linestyle="--", linewidth=1, label=f"baseline + {slowdown_target(every):g}%")
            taken = capture_of(run["variants"].get(Tierckpt.name, {}))
            if taken is not None:
                ax.axhline(1e3 * taken / every, color="tab:blue", linestyle=":", linewidth=1, label="a tierckpt capture ÷ K")
            if max(values) / min(values) > 20:
                ax.set_yscale("log")
            ax.set_xticks(range(len(names)), [SHORT.get(n, n) for n in names], fontsize=8)
            ax.set(title=f"a checkpoint every {every} step(s)", ylabel="ms a step (mean of a round; median of rounds)")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=7)
        m = training["model"]
        gpu = report["gpu"] or "no GPU"
        fig.suptitle(
            f"{m['parameters'] / 1e6:.0f} M-parameter GPT, state {human(m['state_bytes'])}, batch {m['batch']} × {m['block']}, on {report['device']} "
            f"({gpu}), torch {report['machine']['torch']}",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    except Exception as exc:
        traceback.print_exc()
        return f"none: plotting failed ({type(exc).__name__}: {exc})"
    return f"`{path.name}`"


# -- main -----------------------------------------------------------------------------------------------


def elapsed(args: argparse.Namespace) -> str:
    """Seconds since the script started, for the log: where a GPU run's minutes went."""
    return f"{time.monotonic() - args.started:.0f} s"


def attempt(report: dict[str, Any], part: str, save: Callable[[], None], fn: Callable[[], dict[str, Any]]) -> None:
    """Run one part; a failure is printed and kept in the report, and the next part still runs."""
    print(f"-- {part}", flush=True)
    try:
        report.update(fn())
    except Exception:
        report.setdefault("errors", {})[part] = traceback.format_exc()
        traceback.print_exc()
    save()


def copy_parts(report: dict[str, Any], save: Callable[[], None], args: argparse.Namespace) -> None:
    """Parts 1-3 on one 200-tensor state, freed before the training part builds its model."""
    state = make_state(args.size, args.device)
    attempt(report, "peak", save, functools.partial(bench_peak, state, args.device, args.repeats))
    attempt(report, "capture", save, functools.partial(bench_capture, state, args.device, max(10, 6 * args.repeats), args.copy_threads))
    del state
    release(args.device)
    print(f"-- parts 1-3 done ({elapsed(args)})", flush=True)


def parse_args() -> tuple[argparse.Namespace, Profile]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=lambda s: parse_size(s, key="--size"), help="state size (2GiB on cuda, 256MiB on cpu, 32MiB with --quick)")
    parser.add_argument("--repeats", type=int, help="samples behind the medians of parts 1-3 (default 5; --quick 2)")
    parser.add_argument("--steps", type=int, help="timed training steps per round, in whole periods of K (default 15 on cuda, 8 on cpu; --quick 3)")
    parser.add_argument("--rounds", type=int, help="training rounds per variant and K (default 3; --quick 2)")
    parser.add_argument("--dcp-rounds", type=int, help="of which DCP's variants run (default 1 on cuda, 2 on cpu; 0: none)")
    parser.add_argument("--dcp-periods", type=int, help="DCP's timed periods of K steps per round, at most (default 2 on cuda, 3 on cpu)")
    parser.add_argument("--every", type=int, nargs="+", default=[1, 10], help="save every K steps in the training rounds, for each K given (default 1 10)")
    parser.add_argument("--batch", type=int, help="sequences per training step (default 64 on cuda, 8 on cpu; --quick 4)")
    parser.add_argument("--copy-threads", type=int, default=2, help="tierckpt's host.copy_threads")
    parser.add_argument("--precision", choices=("bf16", "fp32"), help="autocast of forward (default bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--dir", type=Path, default=None, help="where DCP writes, in a temporary directory removed after (default: $TMPDIR)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where the JSON, markdown and PNG go")
    parser.add_argument("--name", help="their file name without the suffix (default gpu_capture-<time>)")
    parser.add_argument("--budget-s", type=float, help="start no training round that would end later than this many seconds after the start")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats, few steps")
    args = parser.parse_args()
    args.started = time.monotonic()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available to this torch")
    if min(args.every) < 1:
        parser.error("--every must be at least 1")
    profile = PROFILES["quick" if args.quick else args.device]
    args.every = sorted(set(args.every))
    args.size = args.size or profile.size_bytes
    for name in ("repeats", "steps", "rounds", "dcp_rounds", "dcp_periods", "batch"):
        value = getattr(args, name)
        least = 0 if name == "dcp_rounds" else 1  # --dcp-rounds 0: tierckpt alone
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}")
        setattr(args, name, getattr(profile, name) if value is None else value)
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    args.deadline = None if args.budget_s is None else args.started + args.budget_s
    return args, profile


def main() -> int:
    args, profile = parse_args()
    # DCP says once per call that it runs in a single process: it does, on purpose (no_dist=True).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierckpt-gpu-capture-", dir=args.dir))
    name = args.name or f"gpu_capture-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path, md_path, png_path = args.out / f"{name}.json", args.out / f"{name}.md", args.out / f"{name}.png"
    report: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", *sys.argv]), "json": json_path.name,
        "machine": machine(work), "device": args.device, "quick": args.quick, "repeats": args.repeats,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "cuda": torch.version.cuda,
        "size_bytes": args.size, "copy_threads": args.copy_threads,
    }  # fmt: skip

    def save() -> None:
        """The JSON and the markdown of what was measured so far: a run cut short keeps it."""
        report["targets"] = verdicts(report)
        json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        md_path.write_text(markdown(report) + "\n")

    try:
        copy_parts(report, save, args)
        attempt(report, "training", save, lambda: {"training": bench_training(args, profile, work)})
        for run in report.get("training", {}).get("runs", []):
            for variant, result in run["variants"].items():
                # A failed DCP is a finding; a failed tierckpt, a failure; one the budget cut, neither.
                if "error" in result and variant not in {c.name for c in DCP_VARIANTS} and not result.get("cut"):
                    report.setdefault("errors", {})[f"training: {variant}"] = result["error"]
        if "error" in report.get("training", {}).get("baseline", {}):
            report.setdefault("errors", {})["training: baseline"] = report["training"]["baseline"]["error"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["plot"] = plot(report, png_path)
    save()
    print("\n" + md_path.read_text() + f"results: {json_path}, {md_path} ({elapsed(args)})", flush=True)
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
