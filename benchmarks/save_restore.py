"""tierckpt against this machine's limits, torch.save/torch.load, DCP and torch_checkpointing, in one run.

Disks on shared machines differ from day to day and from minute to minute, so every repeat first
measures the limits on the benchmark's own directory (memcpy into a reused buffer, O_DIRECT write +
fsync, O_DIRECT read, with as many threads as the tier has) and reports every time as a fraction of
the limit measured next to it; medians over the repeats. Each state is model-like: ~200 fp32 and bf16
tensors, large matrices and small unaligned vectors. Every load runs in a new process, as a job
resuming after a failure does, from a cold page cache where the benchmark may drop it (root).
The peers: torch.save/torch.load, DCP async_save/load, and Meta's torch_checkpointing
(CheckpointManager: async save through a background process; its ``tc_*`` keys), which is optional:
without it installed (``pip install --no-deps torch_checkpointing==0.1.1``) its rows are left out.
Results: a JSON file and a markdown section appended to RESULTS.md.

    .venv/bin/python benchmarks/save_restore.py --gib 1 4 --repeats 3 --dir /tmp/tierckpt-bench
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

import common
from machine_limits import drop_caches, fault_in, limits, machine, read_files, read_thread_counts
from tierckpt import Checkpointer
from tierckpt.storage.posix import fsync_dir
LAYERS = 24  # 8 tensors each, plus a few: ~200 tensors
LATER_S = 3.0  # the later restore starts this long after construction


def make_state(nbytes: int) -> dict[str, Any]:
    """A transformer-like state of about ``nbytes``: even layers fp32, odd layers bf16."""
    hidden = max(64, int((nbytes / (LAYERS * 12 * 3)) ** 0.5) // 8 * 8 + 4)  # +4: unaligned vectors
    g = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    for i in range(LAYERS):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        shapes = {
            "attn.qkv.weight": (3 * hidden, hidden),
            "attn.proj.weight": (hidden, hidden),
            "mlp.fc.weight": (4 * hidden, hidden),
            "mlp.proj.weight": (hidden, 4 * hidden),
            "ln1.weight": (hidden,),
            "ln1.bias": (hidden,),
            "ln2.weight": (hidden,),
            "ln2.bias": (hidden,),
        }
        for name, shape in shapes.items():
            model[f"layers.{i}.{name}"] = torch.randn(shape, generator=g).to(dtype)
    model["norm.weight"] = torch.ones(hidden)
    model["rope.inv_freq"] = torch.rand(hidden // 2, generator=g)
    return {"model": model, "rng": torch.get_rng_state(), "step": 1000}


def tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [*state["model"].values(), state["rng"]]


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


# -- the contenders -----------------------------------------------------------------------------------


def tier_config(directory: Path, nbytes: int, threads: int) -> dict[str, Any]:
    nvme = common.disk_tier(directory, "nvme", keep={"last": 1}, io_threads=threads)
    return common.tier_config(nvme, capacity=nbytes + (64 << 20), snapshots=1, copy_threads=2)


def spec_of(state: dict[str, Any]) -> list[tuple[str, str, list[int]]]:
    return [(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state["model"].items()] + [
        ("rng", "uint8", list(state["rng"].shape))
    ]


def template_from(spec: list[tuple[str, str, list[int]]]) -> dict[str, Any]:
    """A freshly built model's state (touched memory), the same structure as the saved one."""
    tensors = {k: torch.zeros(shape, dtype=getattr(torch, dtype)) for k, dtype, shape in spec}
    return {"model": {k: tensors[k] for k, _, _ in spec[:-1]}, "rng": tensors["rng"], "step": 0}


def digest(state: dict[str, Any]) -> str:
    h = xxhash.xxh3_64()
    for t in tensors(state):
        h.update(t.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def load_in_child(job: dict[str, Any], expected: str) -> dict[str, float]:
    """Time one load in a new process, as a job resuming after a failure does it."""
    result = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{job['kind']} load failed:\n{result.stderr}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    if out.pop("digest") != expected:
        raise RuntimeError(f"{job['kind']} loaded different bytes")
    return out


def child(job: dict[str, Any]) -> None:
    """One timed load (``--child``): set up as a resuming job would, then load a cold page cache.

    The template is built, then a state-sized buffer of new memory is faulted in and freed
    (:func:`fault_in`) and the page cache dropped; then the loader is made and the clock starts at
    once (``construct_s`` is that construction), as a restarted job restores: every GPU waits for
    it. ``tierckpt_template_later`` starts the same restore ``LATER_S`` after construction instead.
    """
    import torch.distributed.checkpoint as dcp  # imported at start-up by a job that uses it

    kind, path, nbytes = job["kind"], Path(job["path"]), job["nbytes"]
    template = template_from(job["spec"]) if kind != "torch" else None
    fault_s = fault_in(nbytes)
    if job["cold"]:
        drop_caches()
    t = time.perf_counter()
    ckpt = Checkpointer(tier_config(path, nbytes, job["threads"])) if kind.startswith("tierckpt") else None
    manager = tc_loader() if kind == "tc" else None
    construct_s = time.perf_counter() - t
    if kind == "tierckpt_template_later":
        time.sleep(LATER_S)
    t = time.perf_counter()
    if kind == "tierckpt":
        loaded = ckpt.restore_latest_sync().state
    elif kind in ("tierckpt_template", "tierckpt_template_later", "tierckpt_verify_first"):
        restored = ckpt.restore_latest_sync(template, verify_first=kind == "tierckpt_verify_first")
        assert restored.state["model"]["norm.weight"] is template["model"]["norm.weight"]
        loaded = template
    elif kind == "torch":
        loaded = torch.load(path, weights_only=True)
    elif kind == "tc":
        restored = manager.load(str(path), into=template)
        assert restored["model"]["norm.weight"] is template["model"]["norm.weight"]  # copied in place
        loaded = template
    else:
        dcp.load(template, checkpoint_id=path, no_dist=True)
        loaded = template
    seconds = time.perf_counter() - t
    if ckpt is not None:
        ckpt.close_sync()
    if manager is not None:
        manager.close()
    print(json.dumps({"seconds": seconds, "construct_s": construct_s, "fault_s": fault_s, "digest": digest(loaded)}))


def bench_tierckpt(
    directory: Path, state: dict[str, Any], nbytes: int, threads: int, load: Callable[..., dict[str, float]], cold: bool, repeat: int
) -> dict[str, float]:
    out: dict[str, float] = {}
    with Checkpointer(tier_config(directory, nbytes, threads)) as ckpt:
        for step in (1, 2):  # the first save warms code paths; the second is the one reported
            t = time.perf_counter()
            handle = ckpt.save_sync(step, state)
            call = time.perf_counter() - t
            handle.captured_sync()
            captured = time.perf_counter() - t
            assert handle.committed_sync("nvme")
            durable = time.perf_counter() - t
        out.update(save_call_s=call, captured_s=captured, durable_s=durable, flush_s=durable - captured)
    first = load(kind="tierckpt", path=directory)
    out.update(restore_s=first["seconds"], fault_s=first["fault_s"])
    # Right after construction and LATER_S after it, in alternating order: neither always goes first.
    loads = {kind: load(kind=kind, path=directory) for kind in ("tierckpt_template", "tierckpt_template_later")[:: 1 if repeat % 2 == 0 else -1]}
    out["restore_template_s"] = loads["tierckpt_template"]["seconds"]
    out["construct_s"] = loads["tierckpt_template"]["construct_s"]
    out["restore_template_later_s"] = loads["tierckpt_template_later"]["seconds"]
    out["restore_verify_first_s"] = load(kind="tierckpt_verify_first", path=directory)["seconds"]
    # The limit for those restores, measured on the very files they read (read_thread_counts).
    files = sorted(p for p in directory.glob("step-*/data-*") if p.is_file())
    out["read_same_s"] = min(read_files(files, n, cold) for n in read_thread_counts(threads))
    return out


def bench_torch(directory: Path, state: dict[str, Any], load: Callable[..., dict[str, float]]) -> dict[str, float]:
    path = directory / "state.pt"

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(directory)

    out = {"torch_save_s": timed(save)[0]}
    out["torch_load_s"] = load(kind="torch", path=path)["seconds"]
    path.unlink()
    return out


def bench_dcp(directory: Path, state: dict[str, Any], load: Callable[..., dict[str, float]]) -> dict[str, float]:
    """DCP's own recipe: async_save with a DefaultStager (its staging runs on a background thread),
    then dcp.load into a template. Single process: ``no_dist=True``, no process group needed. The
    stager's pinned/shared-memory and non-blocking options need an accelerator, so they are off
    on a CPU-only machine and on (the defaults) where one is present."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    on_gpu = torch.accelerator.is_available()
    cpu_only = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False)
    stager = DefaultStager() if on_gpu else DefaultStager(cpu_only)
    out: dict[str, float] = {}
    try:
        for step in (1, 2):  # as for tierckpt, the second save is reported
            target = directory / f"dcp-{step}"
            t = time.perf_counter()
            response = dcp.async_save(state, checkpoint_id=target, async_stager=stager, no_dist=True)
            call = time.perf_counter() - t
            response.staging_completion.result()
            staged = time.perf_counter() - t
            response.upload_completion.result()  # FileSystemWriter fsyncs its files (sync_files=True)
            durable = time.perf_counter() - t
            if step == 1:
                shutil.rmtree(target)
    finally:
        stager.close()
    out.update(dcp_call_s=call, dcp_staged_s=staged, dcp_durable_s=durable)
    out["dcp_load_s"] = load(kind="dcp", path=directory / "dcp-2")["seconds"]
    shutil.rmtree(directory / "dcp-2")
    return out


def tc_storage() -> Any:
    """torch_checkpointing's local filesystem storage with buffered writes. Its default opens files
    O_DIRECT and writes torch.save's unaligned chunks through them: ext4 accepts the open and refuses
    the writes (EINVAL, the save fails); it falls back only where the open itself is refused."""
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    return LocalFileSystemStorageConfig(use_direct_io=False)


def tc_loader() -> Any:
    """A manager for a resuming job's load: a synchronous saver starts no writer process."""
    from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig

    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=tc_storage()))


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``, then ``root``'s parent (where it was renamed in)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))
    fsync_dir(root.parent)


def bench_tc(directory: Path, state: dict[str, Any], load: Callable[..., dict[str, float]]) -> dict[str, float]:
    """torch_checkpointing's async recipe: CheckpointManager.save() stages on a thread, then its writer
    process writes into ``tmp_<name>`` and renames it onto ``<name>``; the returned future resolves then.
    Single process: no process group is needed (its store barrier is a no-op for one rank). Its
    troubleshooting guide's CPU-only stager: pinned memory and non-blocking copies only with an
    accelerator; staging into shared memory (the default) on both. ``with manager.lock()`` is what a
    training loop wraps optimizer.step() in: it waits until staging is done (the staged time).

    Nothing in its writer fsyncs (files, the renamed directory, its parent): the future means written
    into the page cache. "Written" is when it resolves; "durable" adds the fsyncs it leaves out."""
    from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager, CheckpointStagerConfig

    on_gpu = torch.accelerator.is_available()
    staging = CheckpointStagerConfig(use_pinned_memory=on_gpu, use_non_blocking_copy=on_gpu)
    config = CheckpointManager.Config(save=AsyncCheckpointSaverConfig(staging_config=staging), storage_config=tc_storage())
    manager = CheckpointManager(config)  # starts its writer process (spawn) in the background
    out: dict[str, float] = {}
    try:
        for step in (1, 2):  # as for the others, the second save is reported (the first waits for the spawn)
            target = directory / f"tc-{step}"
            t = time.perf_counter()
            future = manager.save(str(target), state)
            call = time.perf_counter() - t
            with manager.lock():
                staged = time.perf_counter() - t
            future.result()
            written = time.perf_counter() - t
            fsync_tree(target)
            durable = time.perf_counter() - t
            if step == 1:
                shutil.rmtree(target)
    finally:
        manager.close()
    out.update(tc_call_s=call, tc_staged_s=staged, tc_written_s=written, tc_durable_s=durable)
    out["tc_load_s"] = load(kind="tc", path=directory / "tc-2")["seconds"]
    shutil.rmtree(directory / "tc-2")
    return out


def tc_version() -> str | None:
    """torch_checkpointing's version, None where it is not installed (its rows are then left out)."""
    if importlib.util.find_spec("torch_checkpointing") is None:
        return None
    from torch_checkpointing import __version__

    return str(__version__)


# -- reporting ----------------------------------------------------------------------------------------


ROWS = [
    # (label, key, limit key or None, peer key for the "vs" column or None)
    ("limit: memcpy into a reused buffer", "memcpy_s", "memcpy_s", None),
    ("limit: O_DIRECT write + fsync from a state-sized buffer", "write_s", "write_s", None),
    ("limit: O_DIRECT read into a state-sized buffer", "read_s", "read_s", None),
    ("disk alone: O_DIRECT write + fsync, reused 16 MiB buffers", "write_disk_s", "write_s", None),
    ("disk alone: O_DIRECT read, reused 16 MiB buffers", "read_disk_s", "read_s", None),
    ("disk alone: O_DIRECT read, reused 16 MiB buffers, one thread more (the restore's caller) or twice that (the faster)", "read_disk_more_s", "read_s", None),
    ("disk alone: O_DIRECT read of tierckpt's own data file, reused 16 MiB buffers (best of the three thread counts)", "read_same_s", "read_s", None),
    ("new memory: first touch of a state-sized buffer (see above)", "fault_s", None, None),
    ("tierckpt `save()` call (training blocked)", "save_call_s", None, "dcp_call_s"),
    ("tierckpt host copy done (captured)", "captured_s", "memcpy_s", "dcp_staged_s"),
    ("tierckpt durable on the filesystem tier (from `save()`)", "durable_s", "write_s", "dcp_durable_s"),
    ("tierckpt flush alone (durable − captured)", "flush_s", "write_s", None),
    ("tierckpt restore_latest, new tensors", "restore_s", "read_s", "torch_load_s"),
    ("tierckpt `Checkpointer()` in the new process (before the restore below)", "construct_s", None, None),
    ("tierckpt restore_latest into a template (chunks land as they verify), right after `Checkpointer()`", "restore_template_s", "read_s", "dcp_load_s"),
    ("the same, starting 3 s after `Checkpointer()`", "restore_template_later_s", "read_s", "dcp_load_s"),
    ("tierckpt restore_latest into a template, `verify_first=True` (staged)", "restore_verify_first_s", "read_s", "dcp_load_s"),
    ("torch.save + fsync", "torch_save_s", "write_s", None),
    ("torch.load (weights_only)", "torch_load_s", "read_s", None),
    ("DCP async_save call (blocked)", "dcp_call_s", None, None),
    ("DCP async_save staged (DefaultStager)", "dcp_staged_s", "memcpy_s", None),
    ("DCP async_save durable", "dcp_durable_s", "write_s", None),
    ("DCP load into a template", "dcp_load_s", "read_s", None),
    ("torch_checkpointing save call (blocked)", "tc_call_s", None, None),
    ("torch_checkpointing staged (`lock()` free again)", "tc_staged_s", "memcpy_s", None),
    ("torch_checkpointing written (its future resolved, no fsync)", "tc_written_s", "write_s", None),
    ("torch_checkpointing durable (written + fsync of its files and directories)", "tc_durable_s", "write_s", None),
    ("torch_checkpointing load into a template", "tc_load_s", "read_s", None),
]
_DISK = {"write_s": "write_disk_s", "read_s": "read_disk_s"}


def best_limit(med: dict[str, float], limit: str) -> float:
    """The limit's time: the fastest of the ways the disk was measured (state-sized buffer, reused
    16 MiB buffers, for reads also with more threads), since the limit is the best the hardware
    did in the run."""
    more = min(med.get("read_disk_more_s", math.inf), med.get("read_same_s", math.inf)) if limit == "read_s" else math.inf
    return min(med[limit], med.get(_DISK.get(limit, ""), math.inf), more)


def table(size: dict[str, Any]) -> list[str]:
    """% of the limit: the limit's time over this one (throughput as a share of the limit)."""
    med, gb = size["median"], size["bytes"] / 1e9
    lines = [
        f"**{size['bytes'] / 2**30:.2f} GiB, {size['tensors']} tensors** (fp32 and bf16; medians of {size['repeats']})",
        "",
        "| measure | seconds | GB/s | % of the limit (the fastest disk row) | beside it: % of the state-sized buffer row | vs the peer |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, key, limit, peer in ROWS:
        if key not in med:  # a peer that was not installed
            continue
        s = med[key]
        rate = f"{gb / s:.2f}" if not key.endswith(("call_s", "construct_s")) else ""
        share = f"{100 * best_limit(med, limit) / s:.0f}%" if limit else ""
        disk = f"{100 * med[limit] / s:.0f}%" if limit in _DISK and not key.startswith(("read", "write")) else ""
        versus = ""
        if peer in med:
            ratio, name = med[peer] / s, peer.removesuffix("_s").replace("_", " ")
            versus = f"{ratio:.1f}× faster than {name}" if ratio >= 1 else f"{1 / ratio:.1f}× slower than {name}"
        lines.append(f"| {label} | {s:.4f} | {rate} | {share} | {disk} | {versus} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0], help="state sizes in GiB")
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure (default: a new one under /tmp)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--io-threads", type=int, default=2, help="the tier's io_threads, and the limits' threads")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    parser.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/save_restore-<time>.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one timed load in a new process
    args = parser.parse_args()
    if args.child:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        child(json.loads(args.child))
        return
    # DCP says once per call that it runs in a single process: it does, on purpose (no_dist=True).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    base = args.dir or Path(tempfile.mkdtemp(prefix="tierckpt-bench-"))
    directory = base / "work"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    cold = drop_caches()
    stamp = time.strftime("%Y-%m-%d %H:%M")
    tc = tc_version()
    if tc is None:
        print("torch_checkpointing is not installed: its rows are left out (pip install --no-deps torch_checkpointing==0.1.1)", flush=True)
    report: dict[str, Any] = {"time": stamp, "machine": machine(directory), "torch_checkpointing": tc, "cold_cache": cold,
                              "io_threads": args.io_threads, "sizes": []}
    for gib in args.gib:
        state = make_state(int(gib * 2**30))
        nbytes = state_bytes(state)
        samples: list[dict[str, float]] = []
        expected = digest(state)
        job = {"spec": spec_of(state), "nbytes": nbytes, "threads": args.io_threads, "cold": cold}

        def load(kind: str, path: Path) -> dict[str, float]:
            return load_in_child({**job, "kind": kind, "path": str(path)}, expected)

        for r in range(args.repeats):
            sample = limits(directory, nbytes, args.io_threads, cold)
            sample.update(bench_tierckpt(directory / "tierckpt", state, nbytes, args.io_threads, load, cold, r))
            shutil.rmtree(directory / "tierckpt")
            gc.collect()
            sample.update(bench_torch(directory, state, load))
            gc.collect()
            sample.update(bench_dcp(directory, state, load))
            gc.collect()
            if tc is not None:
                sample.update(bench_tc(directory, state, load))
                gc.collect()
            samples.append(sample)
            print(f"{gib:g} GiB, repeat {r}: " + ", ".join(f"{k}={v:.3f}" for k, v in sample.items()), flush=True)
        median = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        size = {"gib": gib, "bytes": nbytes, "tensors": len(tensors(state)), "repeats": args.repeats, "median": median, "samples": samples}
        report["sizes"].append(size)
        print("\n".join(table(size)), flush=True)
        del state
        gc.collect()
    json_path = args.json or Path(__file__).with_name("results") / f"save_restore-{time.strftime('%Y%m%d-%H%M%S')}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    m = report["machine"]
    peers = "torch.save, DCP and torch_checkpointing" if tc else "torch.save and DCP"
    versions = f"torch {m['torch']}" + (f", torch_checkpointing {tc}" if tc else "")
    lines = [
        f"### tierckpt vs limits, {peers} ({stamp})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}, THP {m['transparent_hugepage']}; "
        f"disk: {m['disk']}, O_DIRECT: {m['o_direct']}; Python {m['python']}, {versions}. Page cache dropped "
        f"before every read: {cold}. {args.io_threads} I/O threads for the tier and the limits. "
        f"Command: `{' '.join(['python', *sys.argv])}`; raw numbers: `{json_path.name}`.",
        "",
        "Limits move the same bytes between the disk and a state-sized, faulted-in buffer, or (the 'disk alone' "
        "rows) reused 16 MiB buffers, as the tier's threads read and write; reads also with one thread more, as a "
        "restore reads with the tier's threads and its caller, and with twice that many (more requests in flight). Every load runs in a new "
        "process (template built before the clock), which first faults a state-sized buffer of "
        "new memory in and frees it, so that no loader pays for memory the machine has not backed yet (the 'new "
        "memory' row: that first touch); then the page cache is dropped, the loader made, and the restore starts at "
        "once (tierckpt's construction timed apart), or 3 s later in the 'starting 3 s after' row. % of the limit = the limit's time / this time, the limit's time being "
        "the fastest of its rows: the best the disk did in the run. Beside it, for reference only, the share of the "
        "state-sized buffer row.",
        "",
    ]
    for size in report["sizes"]:
        lines += table(size)
    common.append_section(args.results, lines, json_path)
    shutil.rmtree(directory, ignore_errors=True)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
