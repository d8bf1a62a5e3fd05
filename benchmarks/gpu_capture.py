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
   ``--size``, AdamW, real forward/backward/step on synthetic batches (bf16 autocast on CUDA), the
   compute stream synchronized at the end of each step. Time per step (a) without checkpoints,
   (b) with ``ckpt.save_sync(step, {"model": ..., "optim": ...})`` at the start of every
   ``--every``-th step and ``ckpt.attach(optimizer)`` as the only barrier, (c) DCP ``async_save`` with
   a ``DefaultStager``, following PyTorch's recipe as ``train_loop.py`` does (staging awaited before
   ``optimizer.step()``, the previous upload before the next save; output under ``--dir``), where the
   installed torch has it. Slowdown against (a) (target for (b): ≤ 5%), the time the training thread
   spent in checkpoint calls and waits per step, and how long a capture takes (idle, and during
   training) next to the step time: a capture longer than a step bounds how often one can save.
   The variants run in rounds of ``--steps`` steps, in alternating order; medians over the rounds.

Prints a markdown section and writes it with the raw numbers to ``--out``
(``gpu_capture-<time>.json``/``.md``; the JSON is rewritten after each part, so a run cut short keeps
what it measured). A part that fails is reported and the run goes on; the exit status is then 1. A
failed DCP variant is reported beside the others and does not fail the run.

    python3 benchmarks/gpu_capture.py --device cuda --out $OUT        # the GPU machine: ~2 GiB state, a few minutes
    .venv/bin/python benchmarks/gpu_capture.py --quick                 # tiny sizes, well under a minute
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
TARGETS = {"capture_share": 0.90, "save_call_ms": 1.0, "slowdown_pct": 5.0}


@dataclasses.dataclass(frozen=True)
class Profile:
    """Defaults per device: the GPU machine gets a ~2 GiB state; this 2-core CPU box something it can train."""

    size_bytes: int
    vocab: int
    block: int  # tokens of context
    batch: int  # sequences per step
    steps: int  # timed steps per round
    warmup: int  # untimed steps before anything is measured
    repeats: int


PROFILES = {
    "cuda": Profile(2 << 30, vocab=32768, block=512, batch=16, steps=15, warmup=3, repeats=5),
    "cpu": Profile(256 << 20, vocab=8192, block=128, batch=8, steps=8, warmup=2, repeats=5),
    "quick": Profile(32 << 20, vocab=4096, block=64, batch=4, steps=3, warmup=2, repeats=2),
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
    shapes = {"qkv.weight": (3 * hidden, hidden), "proj.weight": (hidden, hidden), "fc.weight": (4 * hidden, hidden), "out.weight": (hidden, 4 * hidden)}
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
    out = {"bytes": total, "pinned": pinned, "seconds": statistics.median(wall), "samples_s": wall}
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
        ckpt._pool.wait_prepared()  # every slot faulted and pinned, as a training job's pool is by then
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
    capture = {"bytes": total, "seconds": statistics.median(captures), "samples_s": captures, "pool_pinned": pinned}
    capture["gbps"] = total / capture["seconds"] / 1e9
    capture["counters"] = {"saves": counters.saves, "skipped_saves": counters.skipped_saves, "captures_failed": counters.captures_failed}
    call = {"tensors": len(state), "median_ms": statistics.median(calls_ms), "p90_ms": p90(calls_ms), "samples_ms": calls_ms}
    return {"capture": capture, "save_call": call}


# -- part 4: the training step --------------------------------------------------------------------------


def model_size(state_bytes: int, profile: Profile) -> ModelSize:
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
    return ModelSize(vocab=profile.vocab, d_model=d, layers=layers, heads=d // 64, block=profile.block, batch=profile.batch)


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

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

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
        return {}

    def _add(self, kind: str, since: float) -> None:
        self.spent[kind] = self.spent.get(kind, 0.0) + time.perf_counter() - since


class Tierckpt(NoCheckpoint):
    """``save_sync`` at the start of the step, ``attach(optimizer)`` the only barrier (timed by hooks around it);
    a thread records when each capture finished."""

    name = "tierckpt"

    def __init__(self, nbytes: int, tensors: int, copy_threads: int) -> None:
        super().__init__()
        self.ckpt = Checkpointer(capture_config(nbytes, tensors, copy_threads))
        self.ckpt._pool.wait_prepared()  # every slot faulted and pinned before anything is timed
        self.calls_s: list[float] = []
        self.captures_s: list[float] = []  # from the save call to captured, while training runs
        self.idle_captures_s: list[float] = []  # the same with nothing else running
        self.handles: queue.Queue[Any] = queue.Queue()
        self.hooks: list[Any] = []
        self.error: BaseException | None = None

    def warm(self, trainer: Trainer, step: int, repeats: int) -> None:
        """Before the rounds: one warm-up save, then ``repeats`` timed captures of the training state alone
        (steps ``step`` to ``step + repeats``)."""
        for i in range(repeats + 1):
            _, captured = timed_save(self.ckpt, step + i, trainer.state(), trainer.device)
            if i:
                self.idle_captures_s.append(captured)

    def begin(self, optimizer: torch.optim.Optimizer) -> None:
        super().begin(optimizer)
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
        self.pinned = getattr(self.ckpt, "pinned", None)
        self.ckpt.close_sync()

    def extra(self) -> dict[str, Any]:
        calls_ms = [1e3 * s for s in self.calls_s]
        return {
            "pool_pinned": getattr(self, "pinned", None),
            "capture_idle_s": statistics.median(self.idle_captures_s) if self.idle_captures_s else None,
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


class DcpAsync(NoCheckpoint):
    """PyTorch's recipe for ``async_save`` with a ``DefaultStager``: the staging done before ``optimizer.step()``
    changes the state, the previous upload before the next save. Keeps the newest 2 checkpoints on disk."""

    name = "dcp.async_save"

    def __init__(self, directory: Path, device: str, nbytes: int) -> None:
        super().__init__()
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager

        self.dcp = dcp
        self.directory = directory
        options, self.options_note = staging_options(device, nbytes)
        self.stager = DefaultStager(options)
        self.staging: Any = None
        self.upload: Any = None
        self.written: list[Path] = []

    def save(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        if self.upload is not None:
            t = time.perf_counter()
            self._finish_upload()
            self._add("upload", t)
        t = time.perf_counter()
        path = self.directory / f"step-{step:06d}"
        response = self.dcp.async_save(state(), checkpoint_id=path, async_stager=self.stager, no_dist=True)
        self.written.append(path)
        # With async staging it answers (staging, upload) futures; an older torch answers one future.
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

    def end(self) -> None:
        self.before_update()
        if self.upload is not None:
            self._finish_upload()

    def close(self) -> None:
        self.stager.close()

    def extra(self) -> dict[str, Any]:
        return {"staging_options": self.options_note, "directory": str(self.directory)}


def dcp_unavailable() -> str | None:
    """Why DCP ``async_save`` with a ``DefaultStager`` cannot run with this torch, or None."""
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this build"
    try:
        import torch.distributed.checkpoint.staging as staging
    except ImportError as exc:
        return f"no torch.distributed.checkpoint.staging in torch {torch.__version__}: {exc}"
    if not hasattr(staging, "DefaultStager") or not hasattr(staging, "StagingOptions"):
        return f"no DefaultStager in torch {torch.__version__}"
    return None


def run_round(trainer: Trainer, variant: NoCheckpoint, steps: int, every: int, first_step: int) -> list[float]:
    """``steps`` timed steps; a save at the start of every ``every``-th. Returns each step's seconds."""
    times = []
    variant.begin(trainer.optimizer)
    try:
        for i in range(steps):
            t = time.perf_counter()
            if every and i % every == 0:
                variant.save(first_step + i, trainer.state)
            trainer.step(variant.before_update)
            times.append(time.perf_counter() - t)
    finally:
        variant.end()
    return times


def warmed(variant: NoCheckpoint, warm: Callable[[], Any], missing: dict[str, str]) -> bool:
    """Run ``warm()``; on failure note it in ``missing``, close the variant and answer False."""
    try:
        warm()
        return True
    except Exception as exc:
        missing[variant.name] = f"failed while warming up: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    with contextlib.suppress(Exception):
        variant.close()
    return False


def build_variants(trainer: Trainer, args: argparse.Namespace, nbytes: int, tensors: int, work: Path) -> tuple[list[NoCheckpoint], dict[str, str], int]:
    """The baseline, tierckpt (warmed up, idle captures timed) and DCP where it runs (one warm-up checkpoint
    made durable: its stager allocates its buffers then); returns the variants, why any is missing, and the
    next free step number. A variant that fails here is left out, and the others still run."""
    variants: list[NoCheckpoint] = [NoCheckpoint()]
    missing: dict[str, str] = {}
    dcp_step = 2 + args.repeats  # tierckpt's warm-up saves steps 1 to 1 + repeats
    try:
        tier = Tierckpt(nbytes, tensors, args.copy_threads)
    except Exception as exc:
        missing[Tierckpt.name] = f"failed to construct: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    else:
        if warmed(tier, lambda: tier.warm(trainer, 1, args.repeats), missing):
            variants.append(tier)
    why = dcp_unavailable()
    if why is not None:
        missing[DcpAsync.name] = f"unavailable: {why}"
        return variants, missing, dcp_step + 1
    try:
        dcp = DcpAsync(work, args.device, nbytes)
    except Exception as exc:
        missing[DcpAsync.name] = f"failed to construct: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    else:
        if warmed(dcp, lambda: run_round(trainer, dcp, 1, 1, dcp_step), missing):
            variants.append(dcp)
    return variants, missing, dcp_step + 1


def summarize(name: str, rounds: list[dict[str, Any]], baseline_s: float | None) -> dict[str, Any]:
    """A variant's medians over its rounds: step time, slowdown against the baseline, seconds spent per step."""
    step_s = statistics.median(r["step_s"] for r in rounds)
    kinds = sorted({k for r in rounds for k in r["spent_per_step_s"]})
    out: dict[str, Any] = {"step_s": step_s, "rounds": rounds}
    out["stall_per_step_s"] = statistics.median(sum(r["spent_per_step_s"].values()) for r in rounds)
    out["spent_per_step_s"] = {k: statistics.median(r["spent_per_step_s"].get(k, 0.0) for r in rounds) for k in kinds}
    if baseline_s is not None and name != "none":
        out["slowdown_pct"] = 100 * (step_s / baseline_s - 1)
    return out


def bench_training(args: argparse.Namespace, profile: Profile, work: Path) -> dict[str, Any]:
    """Part 4: the variants in rounds of ``steps`` steps, in alternating order, the model trained throughout."""
    size = model_size(args.size, profile)
    parameters, nbytes, tensors = state_nbytes(size)
    trainer = Trainer(size, args.device, args.precision)
    for _ in range(profile.warmup):  # the AdamW moments exist from here on; kernels chosen, memory cached
        trainer.step()
    out: dict[str, Any] = {
        "model": dataclasses.asdict(size) | {"parameters": parameters, "state_bytes": nbytes, "tensors": tensors},
        "precision": args.precision, "every": args.every, "steps": args.steps, "rounds": args.repeats, "warmup": profile.warmup,
    }  # fmt: skip
    print(f"training: GPT {parameters / 1e6:.1f} M parameters, state {human(nbytes)} in {tensors} tensors", flush=True)
    variants, missing, step = build_variants(trainer, args, nbytes, tensors, work)
    rounds: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    errors: dict[str, str] = {}
    quiet_gc()
    for r in range(args.repeats):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            if variant.name in errors:
                continue
            try:
                times = run_round(trainer, variant, args.steps, args.every, step)
            except Exception as exc:
                errors[variant.name] = f"failed in round {r}: {type(exc).__name__}: {exc}"
                traceback.print_exc()
                continue
            finally:
                step += args.steps
            spent = {k: s / args.steps for k, s in variant.spent.items()}
            rounds[variant.name].append({"step_s": statistics.median(times), "steps_s": times, "spent_per_step_s": spent})
            print(f"round {r}: {variant.name:15s} {1e3 * statistics.median(times):8.1f} ms a step, {1e3 * sum(spent.values()):7.2f} ms in checkpointing", flush=True)
    for variant in variants:
        try:
            variant.close()
        except Exception as exc:
            errors.setdefault(variant.name, f"close failed: {type(exc).__name__}: {exc}")
    out["variants"] = {}
    baseline = statistics.median(r["step_s"] for r in rounds["none"]) if rounds.get("none") and "none" not in errors else None
    for variant in variants:
        result: dict[str, Any] = {"extra": variant.extra()}
        if variant.name in errors:
            result |= {"error": errors[variant.name], "unavailable": False}
        elif rounds[variant.name]:
            result |= summarize(variant.name, rounds[variant.name], baseline)
        out["variants"][variant.name] = result
    for name, why in missing.items():
        out["variants"][name] = {"error": why, "unavailable": why.startswith("unavailable:")}
    del trainer, variants
    release(args.device)
    return out


# -- the report -----------------------------------------------------------------------------------------


def verdicts(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, checked on the medians (reported, never tuned for)."""
    out = []
    peak, capture, call = report.get("peak"), report.get("capture"), report.get("save_call")
    if peak and capture:
        share = peak["seconds"] / capture["seconds"]
        out.append({"what": "capture throughput / peak", "value": f"{100 * share:.0f}%", "target": f"≥ {100 * TARGETS['capture_share']:.0f}%", "met": share >= TARGETS["capture_share"]})
    if call:
        ms = call["median_ms"]
        out.append({"what": f"save() call, {call['tensors']} tensors (median)", "value": f"{ms:.3f} ms", "target": f"≤ {TARGETS['save_call_ms']:g} ms", "met": ms <= TARGETS["save_call_ms"]})
    tier = report.get("training", {}).get("variants", {}).get("tierckpt", {})
    if "slowdown_pct" in tier:
        pct = tier["slowdown_pct"]
        every = report["training"]["every"]
        out.append({"what": f"training-step slowdown, tierckpt every {every} step(s)", "value": f"{pct:+.1f}%", "target": f"≤ {TARGETS['slowdown_pct']:g}%", "met": pct <= TARGETS["slowdown_pct"]})
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
    state = peak or capture
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


def training_table(training: dict[str, Any]) -> list[str]:
    m = training["model"]
    lines = [
        f"Training: GPT ({m['layers']} layers, d_model {m['d_model']}, vocab {m['vocab']}), {m['parameters'] / 1e6:.1f} M parameters; "
        f"state (weights + AdamW moments) {human(m['state_bytes'])} in {m['tensors']} tensors; batch {m['batch']} × {m['block']} tokens, "
        f"{training['precision']}; a checkpoint every {training['every']} step(s); {training['rounds']} rounds of {training['steps']} steps, "
        f"variants in alternating order, after {training['warmup']} warm-up steps and a warm-up checkpoint; medians over the rounds.",
        "",
        "| checkpointing | step ms | slowdown | in checkpointing, ms a step | of which, ms a step | capture ms: idle / during training |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for name, v in training["variants"].items():
        label = "no checkpoint" if name == "none" else name
        if "error" in v:
            lines.append(f"| {label} | {v['error']} | | | | |")
            continue
        slowdown = f"{v['slowdown_pct']:+.1f}%" if "slowdown_pct" in v else ""
        parts = ", ".join(f"{k} {1e3 * s:.2f}" for k, s in v["spent_per_step_s"].items())
        extra = v.get("extra", {})
        capture = ""
        if extra.get("capture_idle_s") is not None:
            during = extra.get("capture_in_training_s")
            capture = f"{1e3 * extra['capture_idle_s']:.1f} / {'' if during is None else f'{1e3 * during:.1f}'}"
        stall = f"{1e3 * v['stall_per_step_s']:.2f}" if name != "none" else ""
        lines.append(f"| {label} | {1e3 * v['step_s']:.1f} | {slowdown} | {stall} | {parts} | {capture} |")
    tier = training["variants"].get("tierckpt", {})
    during = tier.get("extra", {}).get("capture_in_training_s")
    if "step_s" in tier and during is not None and during > tier["step_s"]:
        lines += ["", "A capture takes longer than a step: saving every step is bounded by the copy (`--every K` spaces the saves)."]
    notes = "tierckpt: call = the `save_sync` call with the `state_dict()` calls; barrier = the wait `attach(optimizer)` adds before `optimizer.step()`."
    dcp = training["variants"].get("dcp.async_save", {}).get("extra", {})
    if dcp:
        notes += f" DCP: call = `async_save` with the `state_dict()` calls; staging = the wait before `optimizer.step()`; upload = the wait for the previous upload before a save (with deleting old checkpoints), writing to `{dcp['directory']}`. Stager: {dcp['staging_options']}."
    return lines + ["", notes, ""]


def markdown(report: dict[str, Any]) -> str:
    lines = header(report) + copy_table(report)
    if "training" in report:
        lines += training_table(report["training"])
    checks = report.get("targets", [])
    if checks:
        lines += ["Targets: " + "; ".join(f"{c['what']}: {c['value']} (target {c['target']}, {'met' if c['met'] else 'NOT met'})" for c in checks) + ".", ""]
    for part, error in report.get("errors", {}).items():
        lines += [f"**{part} failed**: `{error.strip().splitlines()[-1]}`", ""]
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------------


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


def parse_args() -> tuple[argparse.Namespace, Profile]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=lambda s: parse_size(s, key="--size"), help="state size (2GiB on cuda, 256MiB on cpu, 32MiB with --quick)")
    parser.add_argument("--repeats", type=int, help="samples behind each median (default 5; --quick 2)")
    parser.add_argument("--steps", type=int, help="timed training steps per round (default 15 on cuda, 8 on cpu; --quick 3)")
    parser.add_argument("--every", type=int, default=1, help="save every K steps in the training rounds")
    parser.add_argument("--copy-threads", type=int, default=2, help="tierckpt's host.copy_threads")
    parser.add_argument("--precision", choices=("bf16", "fp32"), help="autocast of forward (default bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--dir", type=Path, default=None, help="where DCP writes, in a temporary directory removed after (default: $TMPDIR)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where the JSON and markdown go")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats, few steps")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available to this torch")
    if args.every < 1:
        parser.error("--every must be at least 1")
    profile = PROFILES["quick" if args.quick else args.device]
    args.size = args.size or profile.size_bytes
    args.repeats = args.repeats or profile.repeats
    args.steps = args.steps or profile.steps
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    return args, profile


def main() -> int:
    args, profile = parse_args()
    # DCP says once per call that it runs in a single process: it does, on purpose (no_dist=True).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierckpt-gpu-capture-", dir=args.dir))
    name = f"gpu_capture-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path, md_path = args.out / f"{name}.json", args.out / f"{name}.md"
    report: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", *sys.argv]), "json": json_path.name,
        "machine": machine(work), "device": args.device, "quick": args.quick, "repeats": args.repeats,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "cuda": torch.version.cuda,
        "size_bytes": args.size, "copy_threads": args.copy_threads,
    }  # fmt: skip

    def save() -> None:
        json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")

    try:
        copy_parts(report, save, args)
        attempt(report, "training", save, lambda: {"training": bench_training(args, profile, work)})
        for variant, result in report.get("training", {}).get("variants", {}).items():
            if "error" in result and variant != DcpAsync.name:  # a failed DCP is a finding; a failed tierckpt, a failure
                report.setdefault("errors", {})[f"training: {variant}"] = result["error"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["targets"] = verdicts(report)
    save()
    text = markdown(report)
    md_path.write_text(text + "\n")
    print("\n" + text + f"\nresults: {json_path}, {md_path}", flush=True)
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
