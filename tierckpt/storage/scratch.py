"""Worker-thread helpers for bulk I/O, shared by the tiers, restore and the CLI: per-thread aligned
scratch, its size for one stored chunk, and the chunk job runner.

The system calls themselves (O_DIRECT reads and writes, fsync, removal) are in
:mod:`tierckpt.storage.posix`; what a tier stores and reads through them, in :mod:`tierckpt.storage`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Callable, Generic, TypeVar

from tierckpt._buffers import align_up, aligned_buffer

__all__ = ["ChunkJobs", "scratch", "scratch2", "scratch_bytes"]

T = TypeVar("T")

_local = threading.local()


def scratch_bytes(chunk_bytes: int) -> int:
    """Room for one stored chunk: zstd's worst case grows a chunk by well under 1%."""
    return align_up(chunk_bytes + chunk_bytes // 64 + (1 << 16))


def scratch(nbytes: int) -> memoryview:
    """A page-aligned per-thread buffer of at least ``nbytes``, reused across calls."""
    buf = getattr(_local, "scratch", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.scratch = aligned_buffer(nbytes)
    return memoryview(buf)


def scratch2(nbytes: int) -> memoryview:
    """A second per-thread buffer, for decoding from one scratch into another."""
    buf = getattr(_local, "scratch2", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.scratch2 = aligned_buffer(nbytes)
    return memoryview(buf)


class ChunkJobs(Generic[T]):
    """Chunk jobs run in order by ``threads`` threads of ``executor`` and by the calling thread.

    The caller usually has other work first (faulting destination pages in) and joins the readers or
    writers in :meth:`join` instead of waiting idle: while one thread hashes a chunk, the others keep
    the disk busy. Measured here with two tier threads: a restore went from 1.20 to 1.13-1.18 times
    a plain O_DIRECT read of the same file, a flush ran ~15% faster. Jobs are taken front to back,
    so the file is read or written roughly in order. The first error stops the jobs not yet
    started; :meth:`join` returns only once no job runs.
    """

    def __init__(self, jobs: list[Callable[[], T]], executor: concurrent.futures.Executor, threads: int) -> None:
        self._jobs = collections.deque(enumerate(jobs))
        self.results: list[T | None] = [None] * len(jobs)
        self.started = -1  # the highest index taken so far (a hint for work ahead of the jobs)
        self.error: BaseException | None = None
        self._helpers = [executor.submit(self._run) for _ in range(min(threads, len(jobs)))]

    def _run(self) -> None:
        while self.error is None:
            try:
                index, job = self._jobs.popleft()
            except IndexError:
                return
            self.started = max(self.started, index)
            try:
                self.results[index] = job()
            except BaseException as exc:  # noqa: BLE001 - re-raised by join()
                if self.error is None:
                    self.error = exc
                return

    def stop(self) -> None:
        """Start no more jobs, and return once none runs (the caller's own work failed)."""
        if self.error is None:
            self.error = concurrent.futures.CancelledError()
        concurrent.futures.wait(self._helpers)

    def join(self) -> list[T | None]:
        """Run jobs in this thread too until none is left; raises the first error."""
        try:
            self._run()
        finally:
            concurrent.futures.wait(self._helpers)
        for helper in self._helpers:
            helper.result()  # only a bug in _run itself would raise here
        if self.error is not None:
            raise self.error
        return self.results
