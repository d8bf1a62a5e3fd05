"""PCheck buffering under pressure: saves at a fixed rate, much faster than the tiers below can take them.

A state of ``--mib`` MiB is saved ``--saves`` times, one save every ``--interval-ms`` ms, into host
memory (``--snapshots`` slots) over two real filesystem tiers slowed down by an injected bandwidth
limit (:class:`tierckpt.testing.SlowTier`): nvme takes every ``--nvme-every``-th step and must write
each one (``newest_only: false``), pfs takes every ``--pfs-every``-th step, newest only; both have a
``max_staleness``. The training loop is simulated: the lazy barrier (``wait_captured``) runs before
each in-place update of the state, then the loop sleeps until the next tick. One run per
``host.on_full`` mode; each reports the save rate reached, the tiers' effective speeds, saves skipped
and evicted, ``save()`` call times against the host copy time, peak RSS over the baseline against
``host.capacity``, and how long after the last save that happened (not skipped) its version reached
pfs, against ``max_staleness`` (the last step is not a pfs step, so only ``max_staleness`` sends it
down; each tier is offered every save, so pfs takes it from host memory without waiting for nvme).
Appends a table to RESULTS.md.

    .venv/bin/python benchmarks/pressure.py --saves 200 --mib 32 --interval-ms 10
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import pieces_state
from tierckpt import Checkpointer
from tierckpt.config import TierConfig
from tierckpt.testing import SlowTier
from tierckpt.tiers.base import Staged, VersionInfo, VersionSource


class TimedTier(SlowTier):
    """A SlowTier that records, per version, when its write began and when its commit ended."""

    def __init__(self, config: TierConfig, bytes_per_s: float) -> None:
        super().__init__(config, bytes_per_s=bytes_per_s)
        self.begun: dict[int, float] = {}
        self.spans: list[tuple[int, float, float]] = []  # (bytes, begin, end)
        self.committed_at: dict[int, float] = {}

    async def write(self, source: VersionSource) -> Staged:
        self.begun[source.step] = time.perf_counter()
        return await super().write(source)

    async def commit(self, staged: Staged) -> VersionInfo:
        info = await super().commit(staged)
        now = time.perf_counter()
        self.spans.append((staged.nbytes, self.begun.pop(staged.step), now))
        self.committed_at[staged.step] = now
        return info


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5\n")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def memcpy_s(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(20):  # the best of many: the machine is shared
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return min(times)


class GcPauses:
    """The longest cyclic-GC pause (any thread) and how many full collections ran, while installed."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.full = 0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.longest = max(self.longest, time.perf_counter() - self._started)
        self.full += info["generation"] == 2

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run(args: argparse.Namespace, on_full: str, directory: Path, state: dict[str, Any], nbytes: int) -> dict[str, Any]:
    slot = nbytes + (1 << 20)
    config = {
        "host": {"capacity": slot * args.snapshots, "snapshots": args.snapshots, "on_full": on_full},
        "tiers": [
            {"name": "ram", "type": "memory", "keep": {"last": 1}},
            {
                "name": "nvme",
                "type": "filesystem",
                "path": str(directory / "nvme"),
                "flush": {"every_steps": args.nvme_every, "newest_only": False, "max_staleness": args.nvme_staleness},
                "keep": {"last": 3},
            },
            {
                "name": "pfs",
                "type": "filesystem",
                "path": str(directory / "pfs"),
                "flush": {"every_steps": args.pfs_every, "max_staleness": args.max_staleness},
                "keep": {"last": 2, "every_steps": args.pfs_every * 10},
            },
        ],
    }
    tiers: dict[str, TimedTier] = {}
    speeds = {"nvme": args.nvme_mbps * 1e6, "pfs": args.pfs_mbps * 1e6}

    def factory(cfg: TierConfig) -> TimedTier | None:
        if cfg.name not in speeds:
            return None
        tiers[cfg.name] = TimedTier(cfg, speeds[cfg.name])
        return tiers[cfg.name]

    rss_before = status_kib("VmRSS") * 1024
    ckpt = Checkpointer(config, tier_factory=factory)
    ckpt._pool.wait_prepared()  # the whole pool faulted in (in the background): what it costs in RSS
    rss_pool = status_kib("VmRSS") * 1024
    peak_reset = reset_peak_rss()
    save_s: list[float] = []
    barrier_s: list[float] = []
    captured_s: list[float] = []
    interval = args.interval_ms / 1000
    first = state["model"]["w0"]
    started = time.perf_counter()
    newest = None  # the newest save that happened, and when
    pauses = GcPauses().__enter__()
    for i in range(args.saves):
        next_tick = started + i * interval
        delay = next_tick - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = time.perf_counter()
        ckpt.wait_captured()  # the optimizer step's lazy barrier
        barrier_s.append(time.perf_counter() - t)
        first[0] = float(i)  # the "optimizer" updates the state in place
        state["step"] = i
        t = time.perf_counter()
        handle = ckpt.save_sync(i, state)
        save_s.append(time.perf_counter() - t)
        if not handle.skipped:
            newest = (handle, time.perf_counter())
            handle._tracker.captured.add_done_callback(lambda _, t0=t: captured_s.append(time.perf_counter() - t0))
    elapsed = time.perf_counter() - started
    pauses.__exit__()
    assert newest is not None
    handle, saved_at = newest
    reached = handle.committed_sync("pfs", 120)
    reached_s = tiers["pfs"].committed_at[handle.step] - saved_at if reached else float("nan")
    on_nvme = handle.committed_sync("nvme", 120)  # pfs does not wait for nvme: it may come later
    nvme_s = tiers["nvme"].committed_at[handle.step] - saved_at if on_nvme else float("nan")
    counters = ckpt.counters
    peak_rss = status_kib("VmHWM") * 1024
    ckpt.close_sync()
    result = {
        "on_full": on_full,
        "rate": args.saves / elapsed if elapsed else float("inf"),
        "counters": counters,
        "save_s": save_s,
        "barrier_s": barrier_s,
        "captured_s": [c for c in captured_s if c == c],
        "rss_before": rss_before,
        "rss_pool": rss_pool,
        "peak_rss": peak_rss,
        "peak_reset": peak_reset,
        "capacity": slot * args.snapshots,
        "reached_s": reached_s,
        "nvme_s": nvme_s,
        "newest_step": handle.step,
        "gc_longest": pauses.longest,
        "gc_full": pauses.full,
    }
    for name, tier in tiers.items():
        total = sum(b for b, _, _ in tier.spans)
        busy = sum(end - begin for _, begin, end in tier.spans)
        result[f"{name}_mbps"] = total / busy / 1e6 if busy else float("nan")
        result[f"{name}_writes"] = len(tier.spans)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=200)
    parser.add_argument("--mib", type=float, default=32.0, help="state size in MiB")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="one save every this many ms")
    parser.add_argument("--snapshots", type=int, default=4, help="host.snapshots")
    parser.add_argument("--nvme-every", type=int, default=5)
    parser.add_argument("--nvme-mbps", type=float, default=200.0, help="nvme's injected bandwidth limit, MB/s")
    parser.add_argument("--pfs-every", type=int, default=50)
    parser.add_argument("--pfs-mbps", type=float, default=50.0, help="pfs's injected bandwidth limit, MB/s")
    parser.add_argument("--nvme-staleness", type=float, default=0.5, help="nvme's flush.max_staleness, seconds")
    parser.add_argument("--max-staleness", type=float, default=1.0, help="pfs's flush.max_staleness, seconds")
    parser.add_argument("--modes", default="block,skip,evict", help="host.on_full modes to run")
    parser.add_argument("--no-gc-freeze", action="store_true", help="leave the objects made at start to the cyclic GC")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = parser.parse_args()
    if (args.saves - 1) % args.pfs_every == 0:
        parser.error("choose --saves so that the last step is not a pfs step: only max_staleness should send it down")
    if args.max_staleness < args.nvme_staleness:
        parser.error("--max-staleness (pfs) shorter than --nvme-staleness makes little sense")
    root = args.dir or Path(tempfile.mkdtemp(prefix="tierckpt-pressure-"))
    state = pieces_state(int(args.mib * 2**20))
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    copy = memcpy_s(nbytes)
    if not args.no_gc_freeze:
        # What a latency-sensitive training loop does once its model is built: a full collection
        # walking every object made at import (torch alone: ~170k) takes ~50 ms here, and lands in
        # whichever thread allocates next, save() included.
        gc.collect()
        gc.freeze()
    results = []
    for mode in args.modes.split(","):
        directory = root / mode
        shutil.rmtree(directory, ignore_errors=True)
        result = run(args, mode, directory, state, nbytes)
        results.append(result)
        shutil.rmtree(directory, ignore_errors=True)
        c = result["counters"]
        print(
            f"{mode}: {result['rate']:.0f} saves/s, skipped {c.skipped_saves}, evicted {c.evicted_saves}, "
            f"save() max {max(result['save_s']) * 1e3:.1f} ms, step {result['newest_step']} reached pfs "
            f"{result['reached_s']:.2f} s after it was saved",
            flush=True,
        )
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)

    mib = 2**20
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [
        f"### pressure: {args.saves} saves of a {nbytes / mib:.0f} MiB state every {args.interval_ms:g} ms ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, torch {torch.__version__}; shared with other "
        f"benchmarks. host: {args.snapshots} slots, capacity {results[0]['capacity'] / mib:.0f} MiB. nvme: every_steps "
        f"{args.nvme_every}, newest_only false, max_staleness {args.nvme_staleness:g} s, limited to {args.nvme_mbps:g} MB/s; "
        f"pfs: every_steps {args.pfs_every}, "
        f"max_staleness {args.max_staleness:g} s, limited to {args.pfs_mbps:g} MB/s (real ext4 writes behind the limit). "
        f"Wanted: {1000 / args.interval_ms:.0f} saves/s; nvme would need "
        f"{nbytes * 1000 / args.interval_ms / args.nvme_every / 1e6:.0f} MB/s. memcpy of the state: {copy * 1e3:.1f} ms.",
        "",
        "| host.on_full | saves/s | skipped | evicted | nvme writes (MB/s), forced | pfs writes (MB/s), forced | save() p50 / p99 / max ms | host copy p50 / max ms | barrier max ms | RSS over baseline: pool / peak (capacity) MiB | newest save → nvme / → pfs s (max_staleness) | longest GC pause ms (full GCs) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        c = r["counters"]
        saves, caps = r["save_s"], r["captured_s"]
        over = (r["peak_rss"] - r["rss_before"]) / mib
        lines.append(
            f"| {r['on_full']} | {r['rate']:.0f} | {c.skipped_saves} | {c.evicted_saves} "
            f"| {r['nvme_writes']} ({r['nvme_mbps']:.0f}), {c.forced.get('nvme', 0)} "
            f"| {r['pfs_writes']} ({r['pfs_mbps']:.0f}), {c.forced.get('pfs', 0)} "
            f"| {statistics.median(saves) * 1e3:.1f} / {percentile(saves, 0.99) * 1e3:.1f} / {max(saves) * 1e3:.1f} "
            f"| {statistics.median(caps) * 1e3:.1f} / {max(caps) * 1e3:.1f} | {max(r['barrier_s']) * 1e3:.1f} "
            f"| {(r['rss_pool'] - r['rss_before']) / mib:.0f} / {over:.0f} ({r['capacity'] / mib:.0f}) | step {r['newest_step']}: {r['nvme_s']:.2f} / {r['reached_s']:.2f} ({args.nvme_staleness:g} / {args.max_staleness:g}) "
            f"| {r['gc_longest'] * 1e3:.1f} ({r['gc_full']}) |"
        )
    lines += [
        "",
        "save() is the call the training loop makes; the host copy runs on copy threads after it returns and "
        "the barrier (before the in-place update) waits for it. RSS: VmRSS once the Checkpointer is made (its "
        "host pool allocated and pre-faulted), and the peak (VmHWM"
        f"{', reset then' if results[0]['peak_reset'] else ''}) during the run, both over VmRSS before the "
        "Checkpointer was made; the rest of the peak is the tiers' write buffers and threads. Skipped and evicted saves "
        "are counted by `ckpt.counters`; under block, save() waits for a slot instead. The newest save is a step "
        "neither tier selects: each tier takes it once overdue (max_staleness), after the write it may be busy "
        "with; nvme first writes the eligible versions queued before it. Every tier is offered every save, so pfs "
        "does not wait for nvme. Times run from "
        f"the save() call to the commit on each tier. Objects made before the run were {'left to the GC' if args.no_gc_freeze else 'frozen (gc.freeze())'}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    with open(args.results, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
