"""This machine's limits for moving checkpoint bytes, measured on the benchmark's own directory.

Used by save_restore.py, which reports every time as a fraction of the limit measured next to it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import mmap
import os
import platform
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from tierckpt.storage.posix import O_DIRECT, fsync_dir, probe_direct_io

CHUNK = 16 << 20


def buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned, faulted-in buffer (independent of tierckpt's own helpers)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, max(nbytes, 4096), flags=flags)


def shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies under it, else absolute (for reports)."""
    path = path.resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def drop_caches() -> bool:
    """Empty the page cache so reads come from the disk; False where not allowed (not root)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def limit_memcpy(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # touched: the reused-buffer case
    times = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return min(times)


def read_thread_counts(threads: int) -> tuple[int, ...]:
    """The thread counts a read limit is taken with, the best of them counting: the tier's threads,
    one more (a restore reads with the tier's threads and its caller), and twice that (a virtio
    disk served 4 readers faster than 2 here)."""
    return (threads, threads + 1, 2 * (threads + 1))


@contextlib.contextmanager
def _workers(threads: int) -> Iterator[tuple[concurrent.futures.ThreadPoolExecutor, threading.local]]:
    """``threads`` threads, each with a reused 16 MiB buffer (``local.view``) faulted in, all started
    before the caller's clock does."""
    local = threading.local()
    ready = threading.Barrier(threads)

    def start(_: int) -> None:
        local.view = memoryview(buffer(CHUNK))
        ready.wait()

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(start, range(threads)))
        yield pool, local


def _direct_io(path: Path, nbytes: int, threads: int, *, write: bool, whole: memoryview | None) -> float:
    """O_DIRECT (where allowed) in 16 MiB requests from/into ``whole`` (a state-sized, faulted-in
    buffer: where a checkpointer's bytes really come from and go to) or, with None, a reused 16 MiB
    buffer per thread (the disk alone: a buffer that stays in cache flatters the transfer)."""
    direct = O_DIRECT if probe_direct_io(path.parent) else 0

    def job(offset: int) -> None:
        length = min(CHUNK, nbytes - offset)
        view = whole[offset : offset + length] if whole is not None else local.view[:length]
        done = os.pwrite(fd, view, offset) if write else os.preadv(fd, [view], offset)
        assert done == view.nbytes

    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL) if write else os.O_RDONLY
    if write:
        path.unlink(missing_ok=True)  # truncating a large file costs ~0.15 s/GiB here: not the disk's speed
    with _workers(threads) as (pool, local):
        t = time.perf_counter()
        fd = os.open(path, flags | direct, 0o644)
        list(pool.map(job, range(0, nbytes, CHUNK)))
        if write:
            os.fsync(fd)
        os.close(fd)
        if write:
            fsync_dir(path.parent)
        return time.perf_counter() - t


def read_files(paths: list[Path], threads: int, cold: bool) -> float:
    """O_DIRECT reads of ``paths`` whole, in 16 MiB requests into a reused buffer per thread, with
    ``threads`` threads (page cache dropped first when ``cold``): the disk reading a version's own
    files, the same bytes a restore reads, at the same moment of the run."""
    fds = {path: os.open(path, os.O_RDONLY | O_DIRECT) for path in paths}
    jobs = [(fds[path], offset) for path in paths for offset in range(0, path.stat().st_size, CHUNK)]

    def job(item: tuple[int, int]) -> None:
        fd, offset = item
        os.preadv(fd, [local.view], offset)  # the last request of a file comes back short

    try:
        if cold:
            drop_caches()
        with _workers(threads) as (pool, local):
            t = time.perf_counter()
            list(pool.map(job, jobs))
            return time.perf_counter() - t
    finally:
        for fd in fds.values():
            os.close(fd)


def fault_in(nbytes: int) -> float:
    """Fault a state-sized buffer of new memory in, and give it back; returns the time it took.

    Each load process does this before its clock starts. Memory a process touches for the first
    time is slow on some virtual machines (here: 0.7-2.3 s per GiB, the hypervisor backing pages
    the guest had reported free, against 0.25-0.3 s once the guest holds them), and every loader
    that allocates pays it, whatever it reads with. Faulting the same amount in and freeing it first
    gives each loader memory as fast as a bare-metal kernel gives it; the time reported is what
    that first touch costs on this machine.
    """
    t = time.perf_counter()
    memory = buffer(nbytes)
    elapsed = time.perf_counter() - t
    memory.close()
    return elapsed


def limits(directory: Path, nbytes: int, threads: int, cold: bool) -> dict[str, float]:
    path = directory / "limit.bin"
    nbytes = -(-nbytes // 4096) * 4096
    out = {"memcpy_s": limit_memcpy(nbytes)}
    whole = buffer(nbytes)
    view = memoryview(whole)
    torch.frombuffer(whole, dtype=torch.uint8).fill_(0x5A)  # not zeros: no disk may skip them
    for name, source in (("", view), ("_disk", None)):
        out[f"write{name}_s"] = _direct_io(path, nbytes, threads, write=True, whole=source)
        if cold:
            drop_caches()
        out[f"read{name}_s"] = _direct_io(path, nbytes, threads, write=False, whole=source)
    # More reads in flight, which the disk may serve faster (read_thread_counts): the limit is the
    # best the disk does, so measure those too.
    more = []
    for n in read_thread_counts(threads)[1:]:
        if cold:
            drop_caches()
        more.append(_direct_io(path, nbytes, n, write=False, whole=None))
    out["read_disk_more_s"] = min(more)
    view.release()
    whole.close()
    path.unlink()
    return out


def machine(directory: Path) -> dict[str, Any]:
    def first(path: str, key: str) -> str:
        try:
            return next(line.split(":", 1)[1].strip() for line in open(path) if line.startswith(key))
        except (OSError, StopIteration):
            return "?"

    try:
        df = subprocess.run(["df", "-T", str(directory)], capture_output=True, text=True).stdout.splitlines()[-1].split()
        device, fstype = df[0], df[1]
    except (OSError, IndexError):
        device = fstype = "?"
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        thp = "?"
    return {
        "cpu": first("/proc/cpuinfo", "model name"),
        "cores": os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "disk": f"{device} ({fstype})",
        "o_direct": probe_direct_io(directory),
        "transparent_hugepage": thp,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
