"""Time-to-captured, time-to-durable and restore time for one large state, against this machine's limits.

Everything is measured in one run on one directory, because disks here differ from machine to
machine and from day to day: memcpy into a reused buffer, O_DIRECT write + fsync and O_DIRECT read
of the same number of bytes, then tierckpt (ram -> filesystem tier), and torch.save/torch.load as the
common baseline. Results are reported as ratios to the limits, printed and appended to RESULTS.md.

    .venv/bin/python benchmarks/save_restore.py --gib 1 --dir /tmp/tierckpt-bench
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tierckpt import Checkpointer
from tierckpt._buffers import aligned_buffer
from tierckpt.tiers.fsio import O_DIRECT, fsync_dir, probe_direct_io

CHUNK = 16 << 20


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def make_state(nbytes: int) -> dict:
    """A model-like state: a few big matrices and many small vectors, fp32 and bf16."""
    torch.manual_seed(0)
    state: dict = {"model": {}, "optim": {}, "step": 1}
    big = nbytes // 3 // 8  # eight big fp32 tensors take two thirds of the bytes
    for i in range(8):
        state["model"][f"layer{i}.weight"] = torch.randn(big // 4)
    for i in range(64):
        state["model"][f"layer{i}.bias"] = torch.randn(1024)
    moments = (nbytes - sum(t.numel() * t.element_size() for t in state["model"].values())) // 2 // 2
    state["optim"]["exp_avg"] = torch.randn(moments).to(torch.bfloat16)
    state["optim"]["exp_avg_sq"] = torch.rand(moments).to(torch.bfloat16)
    return state


def state_bytes(state: dict) -> int:
    total = 0
    for part in ("model", "optim"):
        total += sum(t.numel() * t.element_size() for t in state[part].values())
    return total


def limit_memcpy(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)  # touched: the reused-buffer case
    times = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return min(times)


def limit_direct_write(directory: Path, nbytes: int, threads: int) -> float:
    buf = aligned_buffer(CHUNK, populate=True)
    view = memoryview(buf)
    path = directory / "limit.bin"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (O_DIRECT if probe_direct_io(directory) else 0)
    t = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda off: os.pwrite(fd, view, off), range(0, nbytes, CHUNK)))
    os.fsync(fd)
    os.close(fd)
    fsync_dir(directory)
    return time.perf_counter() - t


def limit_direct_read(directory: Path, nbytes: int, threads: int) -> float:
    path = directory / "limit.bin"
    flags = os.O_RDONLY | (O_DIRECT if probe_direct_io(directory) else 0)
    local = __import__("threading").local()

    def read(off: int) -> int:
        if not hasattr(local, "buf"):
            local.buf = aligned_buffer(CHUNK)
        return os.preadv(fd, [memoryview(local.buf)], off)

    t = time.perf_counter()
    fd = os.open(path, flags)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, range(0, nbytes, CHUNK)))
    os.close(fd)
    elapsed = time.perf_counter() - t
    path.unlink()
    return elapsed


def bench_tierckpt(directory: Path, state: dict, nbytes: int, io_threads: int) -> dict[str, float]:
    config = {
        "host": {"capacity": int(nbytes * 1.05) + (64 << 20), "snapshots": 1, "copy_threads": 2},
        "tiers": [
            {"name": "ram", "type": "memory"},
            {"name": "nvme", "type": "filesystem", "path": str(directory / "nvme"), "keep": {"last": 1}, "io_threads": io_threads},
        ],
    }
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    ckpt = Checkpointer(config)
    out["pool_setup_s"] = time.perf_counter() - t0
    try:
        # The first save also warms code paths; the second is the one reported.
        for step in (1, 2):
            t = time.perf_counter()
            handle = ckpt.save_sync(step, state)
            t_call = time.perf_counter() - t
            handle.captured_sync()
            t_captured = time.perf_counter() - t
            assert handle.committed_sync("nvme")
            t_durable = time.perf_counter() - t
        out.update(save_call_s=t_call, captured_s=t_captured, durable_s=t_durable)
    finally:
        ckpt.close_sync()
    cold = drop_caches()
    out["restore_cold_cache"] = float(cold)
    # zeros_like: a live model's tensors are touched memory, as a template in real use is.
    template = {k: {n: torch.zeros_like(v) for n, v in state[k].items()} for k in ("model", "optim")}
    with Checkpointer(config) as ckpt:
        t = time.perf_counter()
        restored = ckpt.restore_latest_sync()
        out["restore_s"] = time.perf_counter() - t
        assert restored is not None and restored.tier == "nvme"
        assert all(torch.equal(restored.state["model"][k], v) for k, v in state["model"].items())
        drop_caches()
        t = time.perf_counter()
        ckpt.restore_latest_sync(template=template)
        out["restore_template_s"] = time.perf_counter() - t
    return out


def bench_torch_save(directory: Path, state: dict) -> dict[str, float]:
    path = directory / "torch.pt"
    t = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - t
    drop_caches()
    t = time.perf_counter()
    torch.load(path, weights_only=True)
    load_s = time.perf_counter() - t
    path.unlink()
    return {"torch_save_s": save_s, "torch_load_s": load_s}


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, torch {torch.__version__}"


def fs_of(directory: Path) -> str:
    try:
        return subprocess.run(["df", "-hT", str(directory)], capture_output=True, text=True).stdout.splitlines()[-1]
    except (OSError, IndexError):
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--io-threads", type=int, default=2)
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = parser.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="tierckpt-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    state = make_state(int(args.gib * 2**30))
    nbytes = state_bytes(state)
    rows: dict[str, list[float]] = {}
    for r in range(args.repeats):
        sample = {
            "memcpy_s": limit_memcpy(nbytes),
            "direct_write_s": limit_direct_write(directory, nbytes, args.io_threads),
        }
        drop_caches()
        sample["direct_read_s"] = limit_direct_read(directory, nbytes, args.io_threads)
        sample.update(bench_tierckpt(directory / f"run{r}", state, nbytes, args.io_threads))
        sample.update(bench_torch_save(directory, state))
        shutil.rmtree(directory / f"run{r}", ignore_errors=True)
        for k, v in sample.items():
            rows.setdefault(k, []).append(v)
        print(f"repeat {r}: " + ", ".join(f"{k}={v:.3f}" for k, v in sample.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    gb = nbytes / 1e9
    lines = [
        f"### save/restore of a {nbytes / 2**30:.2f} GiB state ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Machine: {machine()}; disk: `{fs_of(directory)}`; O_DIRECT: {probe_direct_io(directory)}; "
        f"page cache dropped before reads: {bool(med['restore_cold_cache'])}; medians of {args.repeats}.",
        "",
        "| measure | seconds | GB/s | ratio to the limit |",
        "| --- | ---: | ---: | --- |",
        f"| limit: memcpy into a reused buffer | {med['memcpy_s']:.3f} | {gb / med['memcpy_s']:.1f} | 1 |",
        f"| limit: O_DIRECT write + fsync ({args.io_threads} threads) | {med['direct_write_s']:.3f} | {gb / med['direct_write_s']:.2f} | 1 |",
        f"| limit: O_DIRECT read ({args.io_threads} threads) | {med['direct_read_s']:.3f} | {gb / med['direct_read_s']:.2f} | 1 |",
        f"| tierckpt `save()` call (training blocked) | {med['save_call_s']:.4f} | | {med['save_call_s'] / med['memcpy_s']:.3f} × memcpy |",
        f"| tierckpt host copy done (captured) | {med['captured_s']:.3f} | {gb / med['captured_s']:.1f} | {med['captured_s'] / med['memcpy_s']:.2f} × memcpy |",
        f"| tierckpt durable on the filesystem tier | {med['durable_s']:.3f} | {gb / med['durable_s']:.2f} | {med['durable_s'] / med['direct_write_s']:.2f} × O_DIRECT write |",
        f"| tierckpt restore_latest (new CPU tensors) | {med['restore_s']:.3f} | {gb / med['restore_s']:.2f} | {med['restore_s'] / med['direct_read_s']:.2f} × O_DIRECT read |",
        f"| tierckpt restore_latest (into a template) | {med['restore_template_s']:.3f} | {gb / med['restore_template_s']:.2f} | {med['restore_template_s'] / med['direct_read_s']:.2f} × O_DIRECT read |",
        f"| peer: torch.save + fsync | {med['torch_save_s']:.3f} | {gb / med['torch_save_s']:.2f} | {med['torch_save_s'] / med['direct_write_s']:.2f} × O_DIRECT write |",
        f"| peer: torch.load (weights_only) | {med['torch_load_s']:.3f} | {gb / med['torch_load_s']:.2f} | {med['torch_load_s'] / med['direct_read_s']:.2f} × O_DIRECT read |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    with open(args.results, "a") as f:
        f.write(text + "\n")
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
