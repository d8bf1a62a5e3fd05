"""What checkpointing takes from the host, per rank: memory, copies, background CPU and the training thread's lock wait (issue 57).

Real jobs of 1, 2 and 4 DDP ranks on this machine (gloo on 127.0.0.1, CPU; this script with
``--rank-worker``), each rank holding the same replicated state: a model of ``Linear(--width,
--width)`` layers and its Adam state, ``--mib`` MiB together. Each job saves it with one checkpointer:

- ``tierckpt``: ``save_sync(step, state, replicated=["model", "optim"])`` (as the Hugging Face and
  Lightning integrations name a DDP job's values), a memory tier and a filesystem tier on tmpfs
  (``--dir``, /dev/shm by default, so that no disk dominates), every save flushed, keep 1;
- ``tierckpt zstd``: the same, the tmpfs tier compressing (``compression: {codec: zstd, level: 1,
  shuffle: true}``);
- ``dcp thread`` / ``dcp process``: PyTorch DCP ``async_save(state, checkpoint_id=...)`` into the same
  tmpfs, its default stager (a copy into new CPU memory inside the call), with the thread executor
  and with ``AsyncCheckpointerType.PROCESS`` (a checkpoint process per rank); the newest kept. DCP
  writes a tensor saved under the same key by every rank once, as tierckpt's ``replicated=`` does.

What each rank measures:

1. **Host memory**: its resident memory's growth (``VmRSS``) from before the checkpointer existed to
   after the saves (held), and its peak over them (``VmHWM``, reset first); the checkpoint process's
   peak beside it (``dcp process``). Each growth is also given as a share of the 1-rank job's growth
   (issue 57's goals: at most 0.6 at 2 ranks, 0.35 at 4). On a CPU-only host nothing is pinned:
   tierckpt's host slots (``host_pool(ckpt)``) are given instead, with whether they are page-locked.
2. **Bytes copied into host memory**, a save: tierckpt's own count (the ``captured`` event, read from its
   ``tierckpt.metrics`` records); DCP's computed: its default stager copies every storage of the state,
   and the process executor moves that copy into shared memory again to hand it to its process
   (``torch.multiprocessing`` pickles a storage with ``_share_fd_cpu_``).
3. **Background CPU per GiB saved, by thread**: every thread's CPU seconds (``/proc/self/task/<tid>/schedstat``)
   over the window of the saves, grouped by name (Python's thread names, with their numbers dropped;
   threads of C++, such as gloo's, by ``comm``), the threads that ended in the window together (the
   process's CPU clock less the live threads'), and the child processes' (``/proc/<pid>/stat``).
   The main thread's own time in the save calls is given apart, as is the one-time CPU of
   construction, the first save and the slots' fault-in (by the main thread after the first save,
   sooner than ``tierckpt-pool``'s quarter of a core: the window starts in the steady state).
4. **The main thread's lock wait per GiB saved**: the main thread runs a Python-bound step (no I/O, no
   call that lets go of the interpreter lock) pinned to CPU ``--cores[0]``, every other thread and
   process of the rank to ``--cores[1]`` (``sched_setaffinity``, from the first save on, re-applied
   after each save call: a thread inherits its creator's cores). At several ranks, their main threads
   share the first CPU (which shows as run-queue wait, not as lock wait). Over the steps, the time the main thread was neither running
   nor waiting to run (wall - run time - run-queue wait, from its schedstat, less the hypervisor's
   steal on its CPU from /proc/stat) counts as waiting for the interpreter lock. The saves' window (a
   save whenever the previous one is committed, until ``--saves`` are) is compared with a window of
   the same steps without saves (the baseline, ``--baseline-s``, just before), the save calls left out
   of both and reported as "blocked in the call".

"GiB saved" is the rank's whole state times the saves of the window, whatever share of it the rank
writes. Jobs run in alternating order over ``--repeats`` (a VM's first run is often slower); each
figure is the median over a job's ranks, then the median over repeats, the spread the lowest and
highest repeat. In the same run, the floor of the raw path's background work on one thread: one copy
of the state into faulted memory, one xxh3 pass over it, and its writes to the tmpfs directory.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/host_cost.py
    .venv/bin/python benchmarks/host_cost.py --ranks 1 2 --mib 64 --repeats 1

Results: JSON in ``--out``/host_cost.json and a markdown section (printed, and written to
``--markdown``). Per rank throughout: a capture of each rank's share of replicated values (issue 57,
part 1) shows as a smaller growth, fewer bytes copied and less background CPU at 2 and 4 ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

import common

HERE = Path(__file__).resolve().parent
VARIANTS = ("tierckpt", "tierckpt zstd", "dcp thread", "dcp process")
LABELS = {
    "tierckpt": "tierckpt, raw", "tierckpt zstd": "tierckpt, zstd-1 + shuffle",
    "dcp thread": "DCP `async_save`, thread", "dcp process": "DCP `async_save`, process",
}
ZSTD = {"codec": "zstd", "level": 1, "shuffle": True}
TIER = "shm"  # tierckpt's filesystem tier, on tmpfs
REPLICATED = ["model", "optim"]
MAIN = "MainThread"
ENDED = "(threads that ended)"
CHILD = "[child] "  # before a child process's group name
GROUPED = ("by_group_s_per_gib", "setup_by_group_s")  # figures by thread group
GOAL_RSS = {2: 0.6, 4: 0.35}  # a rank's RSS growth, × the 1-rank job's
GOAL_LOCK_MS = {"tierckpt": 20.0, "tierckpt zstd": 60.0}  # lock wait per GiB saved
GOAL_FLOOR = 1.5  # background CPU per GiB on the raw path, × the floor
GIB = 2**30
MIB = 2**20


# -- what /proc says ---------------------------------------------------------------------------------


def tasks(pid: int | str = "self") -> list[int]:
    """The thread ids of a process (of this one by default)."""
    try:
        return [int(p.name) for p in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:  # the process ended
        return []


def schedstat(tid: int, pid: int | str = "self") -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting on a run queue) of one thread so far."""
    run, queued, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
    return int(run) / 1e9, int(queued) / 1e9


def stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat after its command name (which may hold spaces): [state, ppid, ...]."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def process_cpu_s(pid: int) -> float:
    """user + system seconds of every thread a process ran, ended ones too (clock ticks)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def steal_s(cpu: int) -> float:
    """Seconds the hypervisor has taken from ``cpu`` so far (/proc/stat's steal)."""
    for line in open("/proc/stat"):
        if line.startswith(f"cpu{cpu} "):
            return int(line.split()[8]) / os.sysconf("SC_CLK_TCK")
    return 0.0


def status_bytes(key: str, pid: int | str = "self") -> int:
    """A size from /proc/<pid>/status (``VmRSS``, ``VmHWM``), in bytes; 0 once the process is gone."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> None:
    """Start this process's ``VmHWM`` afresh at its present RSS (clear_refs: 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def children(pid: int) -> list[int]:
    """The processes that ``pid``'s threads started (/proc/<pid>/task/<tid>/children)."""
    found = []
    for tid in tasks(pid):
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:  # ended while we looked
            pass
    return found


def descendants(root: int) -> list[int]:
    """Every process below ``root``: its children, theirs, ..."""
    found, todo = [], [root]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found


def child_name(pid: int) -> str:
    """What a child process is, in a word: DCP's checkpoint process is a ``spawn`` child."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "process"
    if "resource_tracker" in command:
        return "resource tracker"
    if "spawn_main" in command:
        return "spawned process"
    return Path(command.split(" ", 1)[0]).name or "process"


def thread_group(name: str) -> str:
    """A thread's name without its numbers: ``tierckpt-copy_1`` and ``tierckpt-copy_0`` are one group."""
    return re.sub(r"-\d+", "", re.sub(r"_\d+$", "", name))


# -- where the CPU went ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuSample:
    """This process's CPU seconds so far: by live thread, in all (ended threads too), and its children's."""

    threads: dict[int, tuple[str, float]]  # tid: (group, seconds on a CPU)
    process_s: float
    children: dict[int, tuple[str, float]]  # pid: (group, seconds)


def sample_cpu() -> CpuSample:
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    main = threading.main_thread().native_id
    threads = {}
    for tid in tasks():
        try:
            name = MAIN if tid == main else names.get(tid) or Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            threads[tid] = (thread_group(name), schedstat(tid)[0])
        except OSError:  # ended while we looked: its time is in process_s
            pass
    children = {}
    for pid in descendants(os.getpid()):
        try:
            children[pid] = (CHILD + child_name(pid), process_cpu_s(pid))
        except (OSError, ValueError):
            pass
    return CpuSample(threads, time.process_time(), children)


def cpu_by_group(before: CpuSample, after: CpuSample) -> dict[str, float]:
    """CPU seconds between two samples, by thread group; the threads that ended between them as one."""
    groups: dict[str, float] = {}
    live = 0.0
    for tid, (group, seconds) in after.threads.items():
        spent = seconds - before.threads.get(tid, (group, 0.0))[1]
        live += spent
        groups[group] = groups.get(group, 0.0) + spent
    groups[ENDED] = max(0.0, after.process_s - before.process_s - live)
    for pid, (group, seconds) in after.children.items():
        groups[group] = groups.get(group, 0.0) + seconds - before.children.get(pid, (group, 0.0))[1]
    return {g: s for g, s in groups.items() if s > 0.0}


# -- the cores ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cores:
    """The main thread on one CPU, every other thread and process of the rank on another."""

    main: int
    background: int

    def pin_main(self) -> None:
        os.sched_setaffinity(threading.get_native_id(), {self.main})

    def pin_background(self) -> None:
        """Move every thread but the main one, and every child's, to the background CPU. Called after each
        save call: a thread starts on its creator's CPUs, and the main thread creates some (DCP's)."""
        main = threading.main_thread().native_id
        others = [tid for tid in tasks() if tid != main] + [tid for pid in descendants(os.getpid()) for tid in tasks(pid)]
        for tid in others:  # a thread id names the thread whatever its process
            try:
                os.sched_setaffinity(tid, {self.background})
            except OSError:  # ended meanwhile
                pass


# -- the training thread -----------------------------------------------------------------------------


def python_step(ops: int) -> int:
    """A training step's Python: interpreter-bound work holding the lock throughout (no I/O, no C call
    that lets go of it), so that any time off the CPU that is not a run queue's is the lock's."""
    total = 0
    for i in range(ops):
        total += i * i % 7
    return total


@dataclass(frozen=True)
class Clock:
    """The main thread at one moment: wall time, its seconds on a CPU and on a run queue."""

    wall_s: float
    run_s: float
    queued_s: float

    @staticmethod
    def now() -> Clock:
        run, queued = schedstat(threading.get_native_id())
        return Clock(time.perf_counter(), run, queued)

    def __sub__(self, other: Clock) -> Clock:
        return Clock(self.wall_s - other.wall_s, self.run_s - other.run_s, self.queued_s - other.queued_s)

    def __add__(self, other: Clock) -> Clock:
        return Clock(self.wall_s + other.wall_s, self.run_s + other.run_s, self.queued_s + other.queued_s)


class Saver(Protocol):
    """One checkpointer as the window drives it: start a save, ask without waiting whether it is done."""

    def save(self, step: int) -> None: ...

    def busy(self) -> bool: ...  # the newest save's copy, writes or commit still going

    def settle(self, timeout: float) -> None: ...  # wait for the newest save, and for the steady state after it

    def copied_bytes(self, step: int) -> int: ...

    def host(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def run_window(cores: Cores, ops: int, *, baseline_s: float = 0.0, saver: Saver | None = None, saves: int = 0,
               first_step: int = 1) -> dict[str, Any]:
    """Steps on the main thread: for ``baseline_s`` without saves, or with ``saves`` saves (each as soon as
    the one before is committed) until the last is committed. The main thread's figures over the steps,
    the save calls apart, and every thread's CPU over the whole window."""
    cores.pin_background()
    calls: list[Clock] = []
    pinning = Clock(0.0, 0.0, 0.0)
    before_cpu, steal0, start = sample_cpu(), steal_s(cores.main), Clock.now()
    steps = issued = 0
    while True:
        python_step(ops)
        steps += 1
        if saver is None:
            if time.perf_counter() - start.wall_s >= baseline_s:
                break
            continue
        if saver.busy():
            continue
        if issued == saves:
            break
        called = Clock.now()
        saver.save(first_step + issued)
        returned = Clock.now()
        calls.append(returned - called)
        cores.pin_background()  # this benchmark's own work: neither the steps' nor the call's
        pinning += Clock.now() - returned
        issued += 1
    whole = Clock.now() - start
    steal, cpu = steal_s(cores.main) - steal0, cpu_by_group(before_cpu, sample_cpu())
    in_calls = sum(calls, Clock(0.0, 0.0, 0.0))
    stepping = whole - in_calls - pinning
    steal_in_steps = steal * stepping.wall_s / whole.wall_s if whole.wall_s > 0 else 0.0
    return {
        "steps": steps, "wall_s": stepping.wall_s, "run_s": stepping.run_s, "queued_s": stepping.queued_s, "steal_s": steal_in_steps,
        "off_s": stepping.wall_s - stepping.run_s - stepping.queued_s - steal_in_steps,
        "calls_s": [c.wall_s for c in calls], "call_run_s": in_calls.run_s, "pinning_s": pinning.wall_s, "window_s": whole.wall_s, "cpu_s": cpu,
    }


# -- the checkpointers -------------------------------------------------------------------------------


def state_bytes(state: Any) -> int:
    """Bytes of the state's tensors, each storage once (what DCP's stager copies)."""
    seen: dict[int, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    visit(state)
    return sum(seen.values())


class CapturedBytes(logging.Handler):
    """The bytes each save copied into host memory, by step, from tierckpt's dotted log records
    (``tierckpt.checkpoint.capture.bytes`` of the ``tierckpt.metrics`` logger: the ``captured`` event)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_step: dict[int, int] = {}
        log = logging.getLogger("tierckpt.metrics")
        log.setLevel(logging.DEBUG)
        log.propagate = False  # counted here, printed nowhere
        log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "metric", None) == "tierckpt.checkpoint.capture.bytes":
            self.by_step[int(getattr(record, "step"))] = int(getattr(record, "value"))


class TierckptSaver:
    def __init__(self, state: dict[str, Any], job: dict[str, Any]) -> None:
        from tierckpt import Checkpointer

        compression = {"compression": ZSTD} if job["variant"] == "tierckpt zstd" else {}
        tier = common.disk_tier(job["dir"], name=TIER, keep={"last": 1}, **compression)
        config = common.tier_config(tier, capacity=None, snapshots=2, ram=common.ram_tier(keep={"last": 1}),
                                    distributed={"timeout": job["timeout"]})
        self._state = state
        self._captured = CapturedBytes()
        self._ckpt = Checkpointer(config)
        self._handle: Any = None

    def save(self, step: int) -> None:
        self._handle = self._ckpt.save_sync(step, self._state, replicated=REPLICATED)

    def busy(self) -> bool:
        from tierckpt.testing.inspect import committed_done

        if self._handle is None:
            return False
        if not committed_done(self._handle, TIER):
            return True
        if not self._handle.committed_sync(TIER, 0):  # decided: raises a failed flush, False if passed over
            raise RuntimeError(f"step {self._handle.step} was not committed on {TIER}")
        return False

    def settle(self, timeout: float) -> None:
        from tierckpt.testing.inspect import host_pool

        if not self._handle.committed_sync(TIER, timeout):
            raise RuntimeError(f"step {self._handle.step} was not committed on {TIER}")
        pool = host_pool(self._ckpt)
        for slot in pool.slots:  # the steady state, every slot faulted in, sooner than tierckpt-pool's quarter core
            pool.prepare(slot)

    def copied_bytes(self, step: int) -> int:
        return self._captured.by_step[step]

    def host(self) -> dict[str, Any]:
        from tierckpt.testing.inspect import host_pool

        pool = host_pool(self._ckpt)
        pinned = bool(pool.memory.is_pinned())
        return {"slot_bytes": pool.slot_size, "slots": len(pool.slots), "mapped_bytes": pool.capacity_bytes,
                "pinned_bytes": pool.capacity_bytes if pinned else 0, "copied": "counted"}

    def close(self) -> None:
        self._ckpt.close_sync()


class DcpSaver:
    def __init__(self, state: dict[str, Any], job: dict[str, Any]) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self._process = job["variant"] == "dcp process"
        self._kind = AsyncCheckpointerType.PROCESS if self._process else AsyncCheckpointerType.THREAD
        self._state, self._root, self._first = state, Path(job["dir"]), dist.get_rank() == 0
        self._bytes = state_bytes(state)
        self._upload: Any = None
        self._saved: list[int] = []

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        self._drop_older()
        response = dcp.async_save(self._state, checkpoint_id=self._root / f"step-{step}", async_checkpointer_type=self._kind)
        self._upload = getattr(response, "upload_completion", response)  # a Future where staging is synchronous
        self._saved.append(step)

    def _drop_older(self) -> None:
        """Keep the newest, as the tierckpt tier does (rank 0, once every rank's upload of a newer one is done)."""
        if self._first:
            while len(self._saved) > 1:
                shutil.rmtree(self._root / f"step-{self._saved.pop(0)}", ignore_errors=True)

    def busy(self) -> bool:
        if self._upload is None:
            return False
        if not self._upload.done():
            return True
        self._upload.result()  # raises what the upload raised
        return False

    def settle(self, timeout: float) -> None:
        self._upload.result(timeout)

    def copied_bytes(self, step: int) -> int:
        return self._bytes * (2 if self._process else 1)  # the staged copy; moved into shared memory for the process

    def host(self) -> dict[str, Any]:
        return {"slot_bytes": None, "slots": None, "mapped_bytes": None, "pinned_bytes": 0, "copied": "computed"}

    def close(self) -> None:
        self._drop_older()


SAVERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], Saver]] = {
    "tierckpt": TierckptSaver, "tierckpt zstd": TierckptSaver, "dcp thread": DcpSaver, "dcp process": DcpSaver,
}


# -- one rank ----------------------------------------------------------------------------------------


def build_state(mib: float, width: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A DDP model of ``Linear(width, width)`` layers after one Adam step: ~``mib`` MiB of weights and moments,
    the same on every rank (one seed; DDP keeps them so)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    layers = max(1, round(mib * MIB / 3 / (4 * width * (width + 1))))  # weights, exp_avg, exp_avg_sq
    model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, {"model": model.module.state_dict(), "optim": optimizer.state_dict()}


class Phases:
    """How long a rank spent in each part of its job (to see where a run's time goes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now


def rank_worker(job: dict[str, Any]) -> None:
    common.start_rank(job["timeout"] * 4)
    import torch.distributed as dist

    from tierckpt.testing.ranks import end_job

    phases = Phases()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, state = build_state(job["mib"], job["width"])
    gc.collect()
    dist.barrier()
    phases.end("start and build")
    rss_before = status_bytes("VmRSS")
    reset_peak_rss()
    setup_cpu = sample_cpu()
    saver = SAVERS[job["variant"]](state, job)
    saver.save(0)  # the first save: a pool mapped and faulted in, a checkpoint process started
    saver.settle(job["timeout"])
    setup = cpu_by_group(setup_cpu, sample_cpu())
    dist.barrier()
    phases.end("first save")
    cores = Cores(*job["cores"])  # from here on: the ranks' setup above had every CPU
    cores.pin_main()
    baseline = run_window(cores, job["ops"], baseline_s=job["baseline_s"])
    dist.barrier()
    phases.end("baseline")
    window = run_window(cores, job["ops"], saver=saver, saves=job["saves"])
    phases.end("saves")
    children = descendants(os.getpid())
    out = {
        "rank": rank, "world": world, "variant": job["variant"], "state_bytes": state_bytes(state), "saves": job["saves"],
        "rss": {"before": rss_before, "held_growth": status_bytes("VmRSS") - rss_before, "peak_growth": status_bytes("VmHWM") - rss_before,
                "children_peak": sum(status_bytes("VmHWM", pid) for pid in children)},
        "host": saver.host(), "copied_bytes": [saver.copied_bytes(s) for s in range(1, job["saves"] + 1)],
        "setup_cpu_s": setup, "baseline": baseline, "window": window, "phases_s": phases.seconds,
    }
    saver.close()
    dist.barrier()
    Path(job["results"], f"rank-{rank}.json").write_text(json.dumps(out))
    del model, state, saver
    end_job()


# -- the parent --------------------------------------------------------------------------------------


def rank_figures(r: dict[str, Any]) -> dict[str, Any]:
    """One rank's figures per GiB saved (the rank's whole state times the window's saves)."""
    gib = r["state_bytes"] * r["saves"] / GIB
    base, window = r["baseline"], r["window"]
    expected_off = window["steps"] * base["off_s"] / base["steps"]
    background = {g: s / gib for g, s in window["cpu_s"].items() if g != MAIN}
    lock_s = window["off_s"] - expected_off
    return {
        "lock_ms_per_gib": 1e3 * lock_s / gib, "lock_ms_per_save": 1e3 * lock_s / r["saves"],
        "call_ms_per_gib": 1e3 * sum(window["calls_s"]) / gib,
        "call_cpu_ms_per_gib": 1e3 * window["call_run_s"] / gib,
        "background_s_per_gib": sum(background.values()),
        "by_group_s_per_gib": background,
        "setup_cpu_s": sum(r["setup_cpu_s"].values()),
        "setup_by_group_s": r["setup_cpu_s"],
        "peak_growth_mib": r["rss"]["peak_growth"] / MIB, "held_growth_mib": r["rss"]["held_growth"] / MIB,
        "children_peak_mib": r["rss"]["children_peak"] / MIB,
        "copied_per_save_mib": statistics.median(r["copied_bytes"]) / MIB, "state_mib": r["state_bytes"] / MIB,
    }


def over_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The median rank's figures of one job (each figure's median over the ranks), and the largest growth."""
    figures = [rank_figures(r) for r in ranks]
    out: dict[str, Any] = {k: statistics.median(f[k] for f in figures) for k, v in figures[0].items() if isinstance(v, float)}
    for key in GROUPED:
        out[key] = median_groups([f[key] for f in figures])
    out["peak_growth_mib_max"] = max(f["peak_growth_mib"] for f in figures)
    out["host"] = ranks[0]["host"]
    return out


def median_groups(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each thread group's median over ``samples`` (0 where a sample lacks it)."""
    groups = sorted({g for sample in samples for g in sample})
    return {g: statistics.median(sample.get(g, 0.0) for sample in samples) for g in groups}


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def summarize(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (ranks, variant)'s repeats: each figure's median and spread over them."""
    numbers = [k for k, v in jobs[0].items() if isinstance(v, float)]
    out: dict[str, Any] = {k: spread([j[k] for j in jobs]) for k in numbers}
    for key in GROUPED:
        out[key] = median_groups([j[key] for j in jobs])
    out["host"] = jobs[0]["host"]
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's RSS growth as a share of the 1-rank job's growth for the same variant (issue 57's goal);
    None where the 1-rank job grew by less than a tenth of its state (nothing held: DCP after its saves)."""
    single = {r["variant"]: r for r in rows if r["ranks"] == 1}
    for row in rows:
        one = single.get(row["variant"])
        for key in ("peak_growth_mib", "held_growth_mib"):
            base = one[key]["median"] if one else 0.0
            enough = one is not None and base >= 0.1 * one["state_mib"]["median"]
            row[key.replace("_mib", "_ratio")] = row[key]["median"] / base if enough else None


def floor_s_per_gib(nbytes: int, directory: Path) -> dict[str, float]:
    """The raw path's least work on one thread, CPU seconds per GiB: a copy into faulted memory, one
    xxh3 pass, the writes of the bytes to ``directory`` (a tmpfs)."""
    import xxhash

    src = torch.randn(nbytes // 4)
    dst = torch.zeros_like(src)  # touched: the reused slot
    view = dst.numpy().data.cast("B")
    piece = 16 << 20
    out: dict[str, float] = {}
    t = time.thread_time()
    dst.copy_(src)
    out["copy"] = time.thread_time() - t
    t = time.thread_time()
    xxhash.xxh3_64_intdigest(view)
    out["xxh3"] = time.thread_time() - t
    path = directory / "floor.bin"
    t = time.thread_time()
    with open(path, "wb", buffering=0) as f:
        for at in range(0, len(view), piece):
            f.write(view[at:at + piece])
    out["write"] = time.thread_time() - t
    path.unlink()
    view.release()
    gib = nbytes / GIB
    return {k: v / gib for k, v in out.items()} | {"total": sum(out.values()) / gib}


def run_job(base: Path, world: int, variant: str, repeat: int, args: argparse.Namespace) -> dict[str, Any]:
    name = f"w{world}-{variant.replace(' ', '-')}-r{repeat}"
    directory = base / name
    directory.mkdir(parents=True)
    job = {"variant": variant, "dir": str(directory), "results": str(base / f"results-{name}"), "mib": args.mib, "width": args.width,
           "saves": args.saves, "ops": args.step_ops, "baseline_s": args.baseline_s, "cores": args.cores, "timeout": args.timeout}
    started = time.perf_counter()
    try:
        ranks = common.run_ranks(__file__, job, world, base / "logs" / name, timeout_s=args.timeout * 6, what=f"{variant} at {world} ranks")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    figures = over_ranks(ranks)
    print(f"{world} ranks, {variant:14s} repeat {repeat}: peak RSS growth {figures['peak_growth_mib']:.0f} MiB, "
          f"lock wait {figures['lock_ms_per_gib']:.0f} ms/GiB, background {figures['background_s_per_gib']:.2f} s/GiB "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    return {"ranks": ranks, "figures": figures}


def run_all(args: argparse.Namespace, base: Path) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    """Every (ranks, variant), the variants in alternating order over the repeats; the floor once a repeat."""
    jobs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    floors = []
    for repeat in range(args.repeats):
        floors.append(floor_s_per_gib(int(args.mib * MIB), base))
        for world in args.ranks:
            order = args.variants if (repeat + world) % 2 == 0 else list(reversed(args.variants))
            for variant in order:
                gc.collect()
                jobs.setdefault((world, variant), []).append(run_job(base, world, variant, repeat, args))
    rows = []
    for (world, variant), runs in sorted(jobs.items(), key=lambda kv: (kv[0][0], args.variants.index(kv[0][1]))):
        rows.append({"ranks": world, "variant": variant, **summarize([r["figures"] for r in runs]), "jobs": [r["ranks"] for r in runs]})
    add_ratios(rows)
    return rows, floors


# -- the report --------------------------------------------------------------------------------------


def ranged(s: dict[str, Any], fmt: str, scale: float = 1.0) -> str:
    """A median and, over several repeats, its spread: ``41 (38-45)``."""
    text = format(s["median"] * scale, fmt)
    return text if len(s["runs"]) < 2 else f"{text} ({format(s['min'] * scale, fmt)}-{format(s['max'] * scale, fmt)})"


def ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def memory_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| ranks | variant | RSS growth per rank, peak (MiB) | × the 1-rank job's | held after the saves (MiB) | × the 1-rank job's | "
        "checkpoint process's peak RSS (MiB) | host slots per rank | pinned | copied into host memory a save, per rank (MiB) | × the state |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        host = r["host"]
        slots = f"{host['slots']} × {host['slot_bytes'] / MIB:.0f} MiB" if host["slot_bytes"] else "— (new memory a save)"
        children = f"{r['children_peak_mib']['median']:.0f}" if r["children_peak_mib"]["median"] else "—"
        copied = r["copied_per_save_mib"]["median"]
        lines.append(
            f"| {r['ranks']} | {LABELS[r['variant']]} | {ranged(r['peak_growth_mib'], '.0f')} | {ratio(r['peak_growth_ratio'])} | "
            f"{ranged(r['held_growth_mib'], '.0f')} | {ratio(r['held_growth_ratio'])} | {children} | {slots} | {host['pinned_bytes'] / MIB:.0f} MiB | "
            f"{copied:.0f} ({host['copied']}) | {copied / r['state_mib']['median']:.2f} |"
        )
    return lines


def top_groups(groups: dict[str, float], n: int = 5) -> str:
    """The ``n`` busiest thread groups, ``name s``; the rest together."""
    ordered = sorted(groups.items(), key=lambda kv: -kv[1])
    shown = [f"{g} {s:.2f}" for g, s in ordered[:n] if s >= 0.005]
    rest = sum(s for _, s in ordered[n:])
    return ", ".join(shown + ([f"others {rest:.2f}"] if rest >= 0.005 else []))


def lock_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| ranks | variant | main thread's lock wait (ms/GiB) | a save (ms) | blocked in the call (ms/GiB) | main thread's CPU in the call (ms/GiB) | "
        "background CPU (s/GiB) | by thread (s/GiB) | one-time CPU: construction, first save (s) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {LABELS[r['variant']]} | {ranged(r['lock_ms_per_gib'], '.0f')} | {r['lock_ms_per_save']['median']:.0f} | "
            f"{ranged(r['call_ms_per_gib'], '.0f')} | "
            f"{r['call_cpu_ms_per_gib']['median']:.0f} | {ranged(r['background_s_per_gib'], '.2f')} | {top_groups(r['by_group_s_per_gib'])} | "
            f"{r['setup_cpu_s']['median']:.2f} ({top_groups(r['setup_by_group_s'], 2)}) |"
        )
    return lines


def goal_lines(rows: list[dict[str, Any]], floor: dict[str, float]) -> list[str]:
    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = []
    for r in rows:
        if r["variant"] == "tierckpt" and r["ranks"] in GOAL_RSS and r["peak_growth_ratio"] is not None:
            goal = GOAL_RSS[r["ranks"]]
            lines.append(f"- RSS growth of a rank at {r['ranks']} ranks ≤ {goal}× the 1-rank job's: {r['peak_growth_ratio']:.2f}× "
                         f"({met(r['peak_growth_ratio'] <= goal)}).")
    for r in rows:
        if r["variant"] in GOAL_LOCK_MS and r["ranks"] == 1:
            goal, got = GOAL_LOCK_MS[r["variant"]], r["lock_ms_per_gib"]["median"]
            lines.append(f"- Lock wait per GiB, {LABELS[r['variant']]}, 1 rank, ≤ {goal:g} ms: {got:.0f} ms ({met(got <= goal)}).")
    raw = next((r for r in rows if r["variant"] == "tierckpt" and r["ranks"] == 1), None)
    if raw is not None:
        times = raw["background_s_per_gib"]["median"] / floor["total"]
        lines.append(f"- Background CPU per GiB on the raw path, 1 rank, ≤ {GOAL_FLOOR}× the floor ({floor['total']:.2f} s: copy "
                     f"{floor['copy']:.2f}, xxh3 {floor['xxh3']:.2f}, writes {floor['write']:.2f}): "
                     f"{raw['background_s_per_gib']['median']:.2f} s, {times:.1f}× ({met(times <= GOAL_FLOOR)}).")
    return lines


def markdown(report: dict[str, Any]) -> list[str]:
    m, a = report["machine"], report["args"]
    rows, floor = report["rows"], report["floor_s_per_gib"]
    state_mib = rows[0]["state_mib"]["median"] if rows else a["mib"]
    return [
        f"## What checkpointing takes from the host, per rank (issue 57) ({report['time']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; tier directory: {m['disk']}; "
        f"Python {m['python']}, torch {m['torch']}. Command: `{report['command']}`; raw numbers: `{report['json']}`.",
        "",
        f"Every rank of a DDP job (gloo on 127.0.0.1) holds the same {state_mib:.0f} MiB: `Linear({a['width']}, {a['width']})` layers "
        f"and their Adam moments. tierckpt saves it with `replicated=[\"model\", \"optim\"]` into a memory tier and a filesystem "
        f"tier on tmpfs (keep 1, every save flushed; host slots sized to the state, 2 snapshots); DCP `async_save` with its "
        f"default stager into the same tmpfs. One warm-up save, then {a['saves']} saves, each when the one before is committed, "
        f"beside a Python-bound step on CPU {a['cores'][0]} (everything else on CPU {a['cores'][1]}); a baseline of the same steps "
        f"without saves ({a['baseline_s']:g} s) just before. Per GiB saved: the rank's whole state × the saves. Each figure: the "
        f"median rank of a job, the median over {a['repeats']} repeat(s) (alternating order), in brackets the lowest and highest repeat.",
        "",
        "### Host memory and copies per rank",
        "",
        *memory_table(rows),
        "",
        "No CUDA here: nothing is pinned (tierckpt's slots are page-locked only with CUDA; DCP's pinned staging needs an "
        "accelerator), so the host slots are given instead. Copied: tierckpt's `captured` bytes (counted); DCP's computed from "
        "the state (its stager copies every storage; the process executor moves the copy into shared memory again).",
        "",
        "### The training thread and the background, per GiB saved",
        "",
        *lock_table(rows),
        "",
        f"Lock wait: the main thread's time neither on a CPU nor on a run queue over the steps (steal taken off), less the "
        f"baseline's for as many steps; per save too, for what does not grow with the bytes. Blocked in the call: the `save_sync`/`async_save` calls' wall time. Background: every "
        f"thread but the main one, the threads that ended in the window, and child processes (`{CHILD.strip()}`). "
        f"`uvloop`: the engine loop's default executor (`asyncio.to_thread`), where a tier's flush runs, writing and "
        f"compressing chunks beside the tier's `io` threads. `Thread (_serve)`: multiprocessing's resource sharer, handing "
        f"the shared memory's descriptors to DCP's checkpoint process. One-time: every thread's CPU (the main one's too) from the "
        f"checkpointer's construction through the first save, committed, to every host slot faulted in (tierckpt; by the main "
        f"thread here, rather than by `tierckpt-pool` at a quarter of a core) or the checkpoint process started (DCP's process "
        f"executor), with its busiest threads; the ranks had every CPU until then.",
        "",
        "Goals (issue 57):",
        "",
        *goal_lines(rows, floor),
        "",
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="job sizes (the first should be 1: the ratios' base)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--mib", type=float, default=512, help="MiB of replicated state a rank holds (weights + Adam moments)")
    parser.add_argument("--width", type=int, default=1024, help="the Linear layers' width")
    parser.add_argument("--saves", type=int, default=3, help="saves in the measured window, after one warm-up save")
    parser.add_argument("--repeats", type=int, default=2, help="jobs of each (ranks, variant), in alternating order")
    parser.add_argument("--baseline-s", type=float, default=2.0, help="seconds of steps without saves, the baseline")
    parser.add_argument("--step-ops", type=int, default=20000, help="Python operations in a step")
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1], metavar=("MAIN", "BACKGROUND"),
                        help="the CPU of each rank's main thread, and of everything else")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="a tmpfs for the tier's and DCP's files")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds: tierckpt's distributed timeout and each wait")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where host_cost.json goes")
    parser.add_argument("--markdown", type=Path, default=Path("/tmp/host_cost_results.md"))
    parser.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return
    if not set(args.cores) <= os.sched_getaffinity(0) or args.cores[0] == args.cores[1]:
        raise SystemExit(f"--cores {args.cores}: two different CPUs of this process's {sorted(os.sched_getaffinity(0))} needed")
    from machine_limits import machine

    base = Path(tempfile.mkdtemp(prefix="tierckpt-host-cost-", dir=args.dir))
    started = time.perf_counter()
    command = " ".join(["python", os.path.relpath(__file__), *sys.argv[1:]])
    results = args.out / "host_cost.json"
    report: dict[str, Any] = {"time": time.strftime("%Y-%m-%d %H:%M"), "command": command, "json": str(results), "machine": machine(base),
                              "args": vars(args) | {"out": str(args.out), "dir": str(args.dir), "markdown": str(args.markdown)}}
    try:
        report["rows"], floors = run_all(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report["floor_s_per_gib"] = {k: statistics.median(f[k] for f in floors) for k in floors[0]}
    report["total_s"] = time.perf_counter() - started
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=1) + "\n")
    common.show_report(markdown(report), args.markdown, results, report["total_s"])


if __name__ == "__main__":
    main()
