"""The headline benchmark: a real training loop that checkpoints every k steps, tierckpt beside its peers.

A GPT-style transformer (weights + AdamW moments: ~0.56 GiB by default) trains for ``--steps`` steps on
a synthetic, learnable corpus, once without checkpoints and once per checkpointer and interval k:

- ``tierckpt``: ``save_sync`` into host RAM, every version flushed to a filesystem tier on ``--dir``
  (``newest_only``, keep 2), ``attach(optimizer)`` as the only barrier;
- ``dcp.async_save``: PyTorch DCP with its ``DefaultStager``, following PyTorch's recipe: wait for the
  staging before ``optimizer.step()`` and for the upload before the next save;
- ``torch.save``: into a file, fsynced with its directory;
- ``dcp.save``: synchronous DCP (its FileSystemWriter fsyncs its files).

torch.save and DCP keep the newest 2 checkpoints, as tierckpt's filesystem tier does. Each run is a new
process (``--worker``) that builds the model, trains ``--warmup`` steps, writes and makes durable one
warm-up checkpoint (one-time costs stay out of the clock, for every checkpointer), freezes the GC and
then times ``--steps`` steps. It reports the run time, the time spent inside checkpoint calls and waits,
when each step ended and when each checkpoint became durable; from those the parent computes, per
variant, the stall (run time minus the no-checkpoint run of the same repeat), ETTR (no-checkpoint time /
run time) and the work a crash at a random moment would lose (the mean, over the run's wall time, of
the steps finished since the newest durable checkpoint). Variants run in alternating order over the
repeats; medians. Results: a JSON file and a PNG plot (matplotlib: the ``bench`` extra) in
benchmarks/results/, a section appended to RESULTS.md (``--quick``: a small model and few steps, results
under ``--dir`` only). A default run takes ~30 minutes on 2 cores; ``--quick`` 1-2 minutes.

    flock /tmp/tierckpt-bench.lock .venv/bin/python benchmarks/train_loop.py
    .venv/bin/python benchmarks/train_loop.py --quick
    .venv/bin/python benchmarks/train_loop.py --replot benchmarks/results/train_loop-<time>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from gpt import GPT, ModelSize
from machine_limits import limits, machine
from tierckpt import Checkpointer
from tierckpt.storage.posix import fsync_dir

HERE = Path(__file__).resolve().parent
VARIANTS = ("tierckpt", "dcp.async_save", "torch.save", "dcp.save")
KEEP = 2  # checkpoints kept on disk by every checkpointer


FULL = ModelSize(vocab=8192, d_model=640, layers=8, heads=10, block=128, batch=8)  # 50 M parameters, ~1.1 s a step here
QUICK = ModelSize(vocab=4096, d_model=256, layers=4, heads=4, block=64, batch=8)  # 5 M parameters


# -- the training job ---------------------------------------------------------------------------------


def batches(size: ModelSize, device: str, seed: int = 0) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Sequences counting up from a random start (in the first 16th of the vocabulary) with a random stride:
    deterministic, and learnable (the loss falls from ~9.2 to ~7.5 in 26 steps of the default model)."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(size.block + 1)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(size.vocab // 16, (size.batch, 1), generator=generator)
        stride = torch.randint(1, 17, (size.batch, 1), generator=generator)
        rows = ((start + stride * positions) % size.vocab).to(device)
        return rows[:, :-1], rows[:, 1:]

    return next_batch


def state_nbytes(size: ModelSize) -> tuple[int, int, int]:
    """Parameters, bytes of weights + AdamW moments (+ step counters), tensors: counted on the meta device."""
    with torch.device("meta"):
        params = list(GPT(size).parameters())
    count = sum(p.numel() for p in params)
    return count, 3 * 4 * count + 4 * len(params), 4 * len(params)


# -- the checkpointers ---------------------------------------------------------------------------------


class NoCheckpoint:
    """The baseline; also the interface every checkpointer has."""

    def __init__(self, directory: Path, nbytes: int, tensors: int) -> None:
        self.directory = directory
        self.inside_s = 0.0  # time the training thread spent in checkpoint calls and waits
        self.durable: list[tuple[int, float]] = []  # (step, when it became durable)
        self.saved: dict[int, float] = {}  # step -> when its save() was called
        self.pruned: set[int] = set()

    def start(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Before the clock: write the warm-up checkpoint (step 0) and wait until it is durable."""

    def before_update(self) -> None:
        """Right before ``optimizer.step()``."""

    def save(self, step: int, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        """After the clock: wait for checkpoints still in flight."""

    def extra(self) -> dict[str, Any]:
        return {}

    def _prune(self) -> None:
        """Keep the newest ``KEEP`` durable checkpoints (torch.save and DCP; tierckpt prunes on its own)."""
        on_disk = sorted(step for step, _ in self.durable if step not in self.pruned)
        for step in on_disk[:-KEEP]:
            path = self.directory / f"step-{step:06d}"  # a DCP directory or a torch.save file
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            self.pruned.add(step)


class Tierckpt(NoCheckpoint):
    """``save_sync`` every k steps; ``attach(optimizer)`` is the lazy barrier. A thread records, in save
    order, when each version commits on the filesystem tier (``handle.committed_sync``)."""

    def __init__(self, directory: Path, nbytes: int, tensors: int) -> None:
        super().__init__(directory, nbytes, tensors)
        slot = nbytes + 4096 * tensors + (16 << 20)  # tensors start 4 KiB-aligned in a slot
        self.config = {
            "host": {"capacity": 2 * slot, "snapshots": 2, "on_full": "block"},
            "tiers": [
                {"name": "ram", "type": "memory", "keep": {"last": 1}},
                {"name": "nvme", "type": "filesystem", "path": str(directory / "nvme"), "flush": {"every": 1, "newest_only": True}, "keep": {"last": KEEP}},
            ],
        }
        self.ckpt = Checkpointer(self.config)
        self.handles: queue.Queue[Any] = queue.Queue()
        self.passed_over: list[int] = []
        self.waiter = threading.Thread(target=self._wait_commits, daemon=True)

    def _wait_commits(self) -> None:
        while (handle := self.handles.get()) is not None:
            if handle.committed_sync("nvme"):
                self.durable.append((handle.step, time.perf_counter()))
            else:
                self.passed_over.append(handle.step)

    def start(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        barrier_started = 0.0

        def before(*_: Any) -> None:
            nonlocal barrier_started
            barrier_started = time.perf_counter()

        def after(*_: Any) -> None:
            self.inside_s += time.perf_counter() - barrier_started

        # Hooks run in the order registered: the barrier that attach() installs is timed by the two around it.
        optimizer.register_step_pre_hook(before)
        self.ckpt.attach(optimizer)
        optimizer.register_step_pre_hook(after)
        assert self.ckpt.save_sync(0, state).committed_sync("nvme")
        self.waiter.start()

    def save(self, step: int, state: dict[str, Any]) -> None:
        t = time.perf_counter()
        self.saved[step] = t
        self.handles.put(self.ckpt.save_sync(step, state))
        self.inside_s += time.perf_counter() - t

    def drain(self) -> None:
        self.ckpt.wait_sync()
        self.handles.put(None)
        self.waiter.join()
        self.counters = dataclasses.asdict(self.ckpt.counters)
        self.ckpt.close_sync()

    def extra(self) -> dict[str, Any]:
        return {"counters": self.counters, "passed_over": self.passed_over, "config": self.config}


class DcpAsync(NoCheckpoint):
    """PyTorch's recipe for ``async_save`` with a ``DefaultStager``: the staging must be done before
    ``optimizer.step()`` changes the state, and the previous upload before the next save. On a CPU-only
    machine the stager's pinned/shared memory and non-blocking copies are off (they need an accelerator)."""

    def __init__(self, directory: Path, nbytes: int, tensors: int) -> None:
        super().__init__(directory, nbytes, tensors)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        on_gpu = torch.accelerator.is_available()
        cpu_only = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False)
        self.stager = DefaultStager() if on_gpu else DefaultStager(cpu_only)
        self.staging: Any = None
        self.upload: Any = None

    def _async_save(self, step: int, state: dict[str, Any]) -> Any:
        import torch.distributed.checkpoint as dcp

        response = dcp.async_save(state, checkpoint_id=self.directory / f"step-{step:06d}", async_stager=self.stager, no_dist=True)

        def uploaded(future: Any) -> None:  # runs in the thread that finished the upload
            if future.exception() is None:
                self.durable.append((step, time.perf_counter()))

        response.upload_completion.add_done_callback(uploaded)
        return response

    def start(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self._async_save(0, state).upload_completion.result()

    def before_update(self) -> None:
        if self.staging is not None:
            t = time.perf_counter()
            self.staging.result()
            self.staging = None
            self.inside_s += time.perf_counter() - t

    def save(self, step: int, state: dict[str, Any]) -> None:
        t = time.perf_counter()
        self.saved[step] = t
        if self.upload is not None:
            self.upload.result()
            self._prune()
        response = self._async_save(step, state)
        self.staging, self.upload = response.staging_completion, response.upload_completion
        self.inside_s += time.perf_counter() - t

    def drain(self) -> None:
        if self.upload is not None:
            self.upload.result()
        self.stager.close()


class TorchSave(NoCheckpoint):
    def _write(self, step: int, state: dict[str, Any]) -> None:
        with open(self.directory / f"step-{step:06d}", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.directory)

    def start(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self._write(0, state)
        self.durable.append((0, time.perf_counter()))

    def save(self, step: int, state: dict[str, Any]) -> None:
        t = time.perf_counter()
        self.saved[step] = t
        self._write(step, state)
        self.durable.append((step, time.perf_counter()))
        self._prune()
        self.inside_s += time.perf_counter() - t


class DcpSave(TorchSave):
    def _write(self, step: int, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=self.directory / f"step-{step:06d}", no_dist=True)


CHECKPOINTERS: dict[str, type[NoCheckpoint]] = {
    "none": NoCheckpoint,
    "tierckpt": Tierckpt,
    "dcp.async_save": DcpAsync,
    "torch.save": TorchSave,
    "dcp.save": DcpSave,
}


# -- one run (a worker process) ------------------------------------------------------------------------


def tensor_bytes(state: Any) -> tuple[int, int]:
    """Bytes and count of the tensors in a nested state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size(), 1
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    sums = [tensor_bytes(item) for item in items]
    return sum(b for b, _ in sums), sum(n for _, n in sums)


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Train ``steps`` steps, checkpointing every ``every`` steps with ``variant``; times from the clock's start."""
    size, device, every = ModelSize(**job["size"]), job["device"], job["every"]
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    model = GPT(size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    next_batch = batches(size, device)
    synchronize = torch.cuda.current_stream().synchronize if device == "cuda" else (lambda: None)

    def state(step: int) -> dict[str, Any]:
        # References, not copies: every checkpointer copies (or writes) them itself.
        return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}

    def train_step(before_update: Callable[[], None]) -> torch.Tensor:
        inputs, targets = next_batch()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        before_update()
        optimizer.step()
        synchronize()  # the compute stream only: a copy stream keeps running
        return loss.detach()

    for _ in range(job["warmup"]):  # the AdamW moments exist from here on; pages are faulted in
        train_step(lambda: None)
    nbytes, tensors = tensor_bytes(state(0))
    checkpointer = CHECKPOINTERS[job["variant"]](Path(job["dir"]), nbytes, tensors)
    checkpointer.start(optimizer, state(0))
    gc.collect()
    gc.freeze()  # a full collection in a torch process takes tens of ms, and would land anywhere
    losses, step_ends = [], []
    cpu = time.process_time()  # every thread of this process: training, and the checkpointer's own
    started = time.perf_counter()
    for step in range(1, job["steps"] + 1):
        losses.append(train_step(checkpointer.before_update))
        step_ends.append(time.perf_counter() - started)
        if every and step % every == 0:
            checkpointer.save(step, state(step))
    total_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu
    checkpointer.drain()
    drain_s = time.perf_counter() - started - total_s
    return {
        "variant": job["variant"],
        "every": every,
        "total_s": total_s,
        "drain_s": drain_s,
        "inside_s": checkpointer.inside_s,
        "cpu_s": cpu_s,
        "step_ends": step_ends,
        "saved": {str(s): t - started for s, t in checkpointer.saved.items()},
        "durable": sorted((s, t - started) for s, t in checkpointer.durable if s > 0),
        "losses": [float(x) for x in losses],
        "state_bytes": nbytes,
        "tensors": tensors,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_rss": peak_rss_bytes(),
        **checkpointer.extra(),
    }


# -- the parent: runs, metrics, report -------------------------------------------------------------------


def lost_work(step_ends: list[float], durable: list[tuple[int, float]], total_s: float) -> float:
    """Mean over [0, total_s] of (steps finished) - (newest durable step); the start state counts as durable."""
    events = sorted([(t, "step", i + 1) for i, t in enumerate(step_ends)] + [(t, "durable", s) for s, t in durable])
    finished = newest = 0
    area, last = 0.0, 0.0
    for t, kind, value in events:
        t = min(max(t, 0.0), total_s)
        area += (finished - newest) * (t - last)
        last = t
        if kind == "step":
            finished = value
        else:
            newest = max(newest, value)
    area += (finished - newest) * (total_s - last)
    return area / total_s


def metrics(run: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    """What the table shows, for one run against the no-checkpoint run of the same repeat."""
    durable = [(s, t) for s, t in run["durable"]]
    in_run = [s for s, t in durable if t <= run["total_s"]]
    latency = [t - run["saved"][str(s)] for s, t in durable if str(s) in run["saved"]]
    steps = run["step_ends"]
    return {
        "total_s": run["total_s"],
        "stall_s": run["total_s"] - baseline["total_s"],
        "inside_s": run["inside_s"],
        "ettr": baseline["total_s"] / run["total_s"],
        "saves": len(run["saved"]),
        "durable_in_run": len(in_run),
        "durable": len(durable),
        "lost_steps": lost_work(steps, durable, run["total_s"]),
        "save_to_durable_s": statistics.median(latency) if latency else float("nan"),
        "step_s": statistics.median(b - a for a, b in zip([0.0, *steps], steps)),
        "drain_s": run["drain_s"],
        "cpu_per_step_s": run["cpu_s"] / len(steps),
        "peak_rss_gib": run["peak_rss"] / 2**30,
        "others_cores": run.get("others_cores", float("nan")),
    }


def busy_cpu_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat; iowait and idle excluded)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    """One run in a new process; also how many cores the rest of the machine kept busy meanwhile."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy, started = busy_cpu_s(), time.perf_counter()
    result = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    if result.returncode != 0:
        raise RuntimeError(f"{job['variant']} every {job['every']} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1]) | {"others_cores": max(0.0, busy_cpu_s() - busy - own) / wall}


def table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| checkpointing | every k steps | run s | stall s | in checkpoint calls s | ETTR (min–max) | saves | durable in the run (+ at the end) | lost work, steps | save → durable s | CPU s per step | peak RSS GiB | other processes, cores |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report["rows"]:
        m = row["median"]
        ettrs = [sample["ettr"] for sample in row["samples"]]
        late = m["durable"] - m["durable_in_run"]
        lag = f"{m['save_to_durable_s']:.2f}" if m["save_to_durable_s"] == m["save_to_durable_s"] else ""
        bold = "**" if row["variant"] == "tierckpt" else ""
        k = row["every"] or ""
        lines.append(
            f"| {bold}{'no checkpoint' if row['variant'] == 'none' else row['variant']}{bold} | {k} | {m['total_s']:.1f} | {m['stall_s']:+.1f} | {m['inside_s']:.2f} | "
            f"{bold}{m['ettr']:.3f}{bold} ({min(ettrs):.2f}–{max(ettrs):.2f}) | {m['saves']:.0f} | {m['durable_in_run']:.0f}" + (f" (+{late:.0f})" if late else "") + " | "
            f"{m['lost_steps']:.2f} | {lag} | {m['cpu_per_step_s']:.2f} | {m['peak_rss_gib']:.2f} | {m['others_cores']:.2f} |"
        )
    return lines


def summary(report: dict[str, Any]) -> list[str]:
    """The key numbers, one row per checkpointer: ETTR and lost work at each k (the table in README.md and docs/performance.md)."""
    med = {(r["variant"], r["every"]): r["median"] for r in report["rows"]}
    ks = report["every"]
    base = med["none", 0]
    head = " | ".join(f"ETTR k={k}" for k in ks) + " | " + " | ".join(f"lost work k={k}" for k in ks)
    lost = f" {base['lost_steps']:.1f} |"
    lines = [f"| checkpointing | {head} |", "| --- |" + " ---: |" * (2 * len(ks)), "| no checkpoint |" + " 1 |" * len(ks) + lost * len(ks)]
    for variant in VARIANTS:
        if all((variant, k) in med for k in ks):
            bold = "**" if variant == "tierckpt" else ""
            ettr = " | ".join(f"{bold}{med[variant, k]['ettr']:.2f}{bold}" for k in ks)
            lost = " | ".join(f"{bold}{med[variant, k]['lost_steps']:.2f}{bold}" for k in ks)
            lines.append(f"| {bold}{variant}{bold} | {ettr} | {lost} |")
    return lines


def verdicts(report: dict[str, Any]) -> list[str]:
    """The issue's targets, checked on the medians (reported, never tuned for)."""
    med = {(r["variant"], r["every"]): r["median"] for r in report["rows"]}
    ks = report["every"]
    out = []
    if ("tierckpt", 1) in med:
        out.append(f"tierckpt ETTR at k=1: {med['tierckpt', 1]['ettr']:.3f} (target ≥ 0.97)")
    for k in ks:
        if ("tierckpt", k) not in med:
            continue
        t = med["tierckpt", k]
        async_ettr = med.get(("dcp.async_save", k), {}).get("ettr")
        peers = {v: med[v, k]["lost_steps"] for v in VARIANTS[1:] if (v, k) in med}
        worse = [v for v, lost in peers.items() if lost < t["lost_steps"]]
        cmp = f"ETTR {t['ettr']:.3f} vs DCP async_save {async_ettr:.3f} ({'≥' if t['ettr'] >= async_ettr else '<'})" if async_ettr else ""
        lw = f"lost work {t['lost_steps']:.2f} steps, " + ("≤ every peer" if not worse else f"more than {', '.join(worse)}")
        out.append(f"k={k}: {cmp}; {lw}")
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ks = report["every"]
    colors = {"tierckpt": "tab:blue", "dcp.async_save": "tab:orange", "torch.save": "tab:green", "dcp.save": "tab:red"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    baseline = next(r for r in report["rows"] if r["variant"] == "none")["median"]
    for variant in VARIANTS:
        rows = sorted((r["every"], r["median"]) for r in report["rows"] if r["variant"] == variant)
        if not rows:
            continue
        style = {"color": colors[variant], "marker": "o", "linewidth": 2.5 if variant == "tierckpt" else 1.5, "label": variant}
        left.plot([k for k, _ in rows], [m["ettr"] for _, m in rows], **style)
        right.plot([k for k, _ in rows], [m["lost_steps"] for _, m in rows], **style)
    left.axhline(1.0, color="gray", linewidth=1, label="no checkpoint")
    left.axhline(0.97, color="gray", linewidth=1, linestyle="--", label="0.97")
    right.axhline(baseline["lost_steps"], color="gray", linewidth=1, label="no checkpoint")
    left.set(title="effective training time ratio (higher is better)", ylabel="ETTR = no-checkpoint time / run time")
    right.set(title="work a crash would lose (lower is better)", ylabel="mean steps since the newest durable checkpoint")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_xlabel("checkpoint every k steps")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.set_yscale("log")
    right.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    right.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    right.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    m = report["model"]
    threads = f", training on {report['threads']} thread(s)" if "threads" in report else ""  # older JSON lacks it
    fig.suptitle(
        f"{report['steps']} training steps of a {m['parameters'] / 1e6:.0f} M-parameter GPT (state {m['state_bytes'] / 2**30:.2f} GiB), "
        f"{baseline['step_s']:.2f} s a step; {report['machine']['cores']} cores{threads}, {report['device']}; medians of {report['repeats']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe_machine(report: dict[str, Any]) -> str:
    m = report["machine"]
    gb = report["model"]["state_bytes"] / 1e9
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, GPU: {report['gpu']}, Linux {m['kernel']}; disk: "
        f"{m['disk']}, O_DIRECT: {m['o_direct']}, O_DIRECT write + fsync of a state-sized buffer {report['write_s']:.2f} s "
        f"({gb / report['write_s']:.2f} GB/s, median over repeats); Python {m['python']}, torch {m['torch']}. "
        f"Other processes kept {report.get('others_cores', float('nan')):.2f} of the {m['cores']} cores busy on average during the runs."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="timed training steps per run (default 24; --quick 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the warm-up checkpoint")
    parser.add_argument("--every", type=int, nargs="+", help="checkpoint intervals k (default 1 5 20; --quick 1 5)")
    parser.add_argument("--repeats", type=int, help="runs of every variant, in alternating order (default 3; --quick 2)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tierckpt-train-bench"), help="on the disk to measure; emptied between runs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, help="training's intra-op threads (default: torch's, one per core); fewer leave cores to the checkpointers, as a GPU host does")
    parser.add_argument("--quick", action="store_true", help="a 5 M-parameter model and few steps; results under --dir only")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--replot", type=Path, help="draw the plot (next to it) and print the table of a saved JSON; run nothing")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one run, as JSON
    args = parser.parse_args()
    # DCP says once per call that it runs in a single process: it does, on purpose (no_dist=True).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if importlib.util.find_spec("matplotlib") is None:  # fail now, not after the runs
        parser.error("the plot needs matplotlib: pip install -e '.[bench]'")
    if args.replot:
        saved = json.loads(args.replot.read_text())
        plot(saved, args.replot.with_suffix(".png"))
        print("\n".join([describe_machine(saved), *table(saved), "", *verdicts(saved), "", *summary(saved)]))
        return
    size = QUICK if args.quick else FULL
    steps = args.steps or (10 if args.quick else 24)
    ks = args.every or ([1, 5] if args.quick else [1, 5, 20])
    repeats = args.repeats or (2 if args.quick else 3)
    work = args.dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    parameters, nbytes, tensors = state_nbytes(size)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    report: dict[str, Any] = {
        "time": stamp, "machine": machine(work), "gpu": gpu, "device": args.device, "steps": steps, "warmup": args.warmup,
        "every": ks, "repeats": repeats, "size": dataclasses.asdict(size), "command": " ".join(["python", *sys.argv]),
        "model": {"parameters": parameters, "state_bytes": nbytes, "tensors": tensors},
        "threads": args.threads or torch.get_num_threads(),
    }  # fmt: skip
    print(f"{describe_machine({**report, 'write_s': float('nan')})}\nmodel: {parameters / 1e6:.1f} M parameters, state {nbytes / 2**30:.2f} GiB", flush=True)
    plan = [("none", 0)] + [(v, k) for k in ks for v in args.variants]
    runs: list[dict[str, Any]] = []
    write_s: list[float] = []
    for r in range(repeats):
        work.mkdir(exist_ok=True)
        write_s.append(limits(work, nbytes, 2, cold=False)["write_s"])
        shutil.rmtree(work)
        order = plan if r % 2 == 0 else plan[::-1]
        for variant, every in order:
            work.mkdir()
            os.sync()  # nothing of the previous run left to write back
            job = {"variant": variant, "every": every, "steps": steps, "warmup": args.warmup, "dir": str(work), "device": args.device, "size": dataclasses.asdict(size), "threads": args.threads}
            run = run_worker(job) | {"repeat": r}
            runs.append(run)
            shutil.rmtree(work)
            print(f"repeat {r}: {variant:15s} k={every:<3d} {run['total_s']:6.1f} s, in checkpoint calls {run['inside_s']:5.2f} s, durable {len(run['durable'])}/{len(run['saved'])}, others {run['others_cores']:.2f} cores, final loss {run['losses'][-1]:.4f}", flush=True)
    report["write_s"] = statistics.median(write_s)
    report["others_cores"] = statistics.fmean(run["others_cores"] for run in runs)
    report["write_s_samples"] = write_s
    rows = []
    for variant, every in plan:
        samples = []
        for r in range(repeats):
            baseline = next(x for x in runs if x["repeat"] == r and x["variant"] == "none")
            samples.append(metrics(next(x for x in runs if x["repeat"] == r and x["variant"] == variant and x["every"] == every), baseline))
        median = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
        rows.append({"variant": variant, "every": every, "median": median, "samples": samples})
    report["rows"] = rows
    report["runs"] = runs
    finals = {round(run["losses"][-1], 5) for run in runs}
    report["same_final_loss"] = len(finals) == 1
    step_s = rows[0]["median"]["step_s"]
    lines = table(report)
    checks = verdicts(report)
    print("\n".join(["", describe_machine(report), *lines, "", *checks, "", *summary(report)]), flush=True)
    out = args.dir if args.quick else HERE / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = f"train_loop-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, png_path)
    print(f"raw numbers: {json_path}\nplot: {png_path}")
    if args.quick:
        return
    section = [
        f"### training loop, a checkpoint every k steps: tierckpt vs DCP async_save, torch.save, DCP save ({stamp})",
        "",
        describe_machine(report) + f" Shared with other engineers' test runs. Training runs {report['threads']} "
        f"intra-op thread(s) on the {report['machine']['cores']} cores; every checkpointer's copies, hashing and "
        "writes take what is left, or compete with training where nothing is.",
        "",
        f"Model: a GPT ({size.layers} layers, d_model {size.d_model}, vocab {size.vocab}), {parameters / 1e6:.1f} M parameters; "
        f"state (weights + AdamW moments) {nbytes / 2**30:.2f} GiB in {tensors} tensors; batch {size.batch} × {size.block} tokens, "
        f"{step_s:.2f} s a step without checkpoints, against {report['write_s']:.2f} s to write the state to this disk. "
        f"{steps} timed steps per run, after {args.warmup} warm-up steps and one warm-up checkpoint made durable (every "
        f"checkpointer); each run its own process, the order reversed every other repeat; medians of {repeats}. The loss "
        f"falls from {runs[0]['losses'][0]:.2f} to {runs[0]['losses'][-1]:.2f}, identical in every run (checkpointing never "
        f"changed the training): {report['same_final_loss']}. "
        f"Command: `flock /tmp/tierckpt-bench.lock {report['command']}`; raw numbers: `{json_path.name}`; plot: `{png_path.name}`.",
        "",
        "tierckpt: `save_sync` into 2 host slots, RAM tier keeps 1, filesystem tier takes every version (`newest_only`) "
        "and keeps 2, `attach(optimizer)` the only barrier. DCP async_save: `DefaultStager` (on CPU without pinned or shared "
        "memory), staging waited for before `optimizer.step()`, the upload before the next save. torch.save: file and "
        "directory fsynced. DCP save: its FileSystemWriter fsyncs its files. torch.save and DCP delete all but the newest 2.",
        "",
        *lines,
        "",
        "Stall: run time minus the no-checkpoint run of the same repeat. In checkpoint calls: time the training thread "
        "spent inside save calls and their waits (tierckpt: `save_sync` plus the barrier before `optimizer.step()`; DCP "
        "async: the call, the staging wait and the previous upload's wait, with deletions). ETTR: no-checkpoint time / run "
        "time (min–max over the repeats). Durable in the run: checkpoints durable before the last step ended (+ those that became durable after it). "
        "Lost work: the mean, over the run's wall time, of steps finished since the newest durable checkpoint (what a crash "
        "at a random moment would cost; no checkpoint: about half the run). Save → durable: from the save call to durable "
        "on disk (median over versions). CPU s per step: CPU time of the training process, every thread, over the steps. "
        "Peak RSS: the whole training process. Other processes: CPU the rest of the machine used during the run (in cores).",
        "",
        "Targets: " + "; ".join(checks) + ".",
        "",
    ]
    with open(args.results, "a") as f:
        f.write("\n".join(section) + "\n")
    print(f"results: {args.results}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
