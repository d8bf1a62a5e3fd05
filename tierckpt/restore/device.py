"""Restoring straight into GPU memory: a small ring of pinned bounce buffers, overlapped H2D copies.

A chunk bound for a CUDA template is read into a page-locked host buffer of the ring (O_DIRECT where
the tier allows), verified there, and copied to the device with a ``non_blocking`` copy on a stream
of the ring's own; the reader thread goes on to its next chunk at once, and the buffer is reused
only once its copy's event completed. Only the ring is pinned (a few chunks' worth, registered when
the first chunk comes and unregistered at the end), never the host pool: the pool may not even be
faulted in yet when a job restarts (:mod:`tierckpt.capture.prepare`), and pinning it would put its
whole size on the restore's path. A damaged chunk never reaches the device: it fails in the buffer.

Call order: :meth:`DeviceRing.start` once with the number of reader threads (it waits for what was
queued on the devices before the restore), :meth:`DeviceRing.land` from those threads,
:meth:`DeviceRing.close` once they are all done (it waits for every copy).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from tierckpt._buffers import address, aligned_buffer
from tierckpt.capture.pinning import pin, unpin
from tierckpt.format import TensorRecord
from tierckpt.format.source import VersionSource
from tierckpt.storage.scratch import scratch, scratch_bytes

__all__ = ["DeviceRing", "device_bytes"]


def device_bytes(value: torch.Tensor) -> torch.Tensor | None:
    """A flat byte view of a contiguous CUDA tensor's memory, which chunks can be copied into; None
    for anything else (staged, and copied by :func:`~tierckpt.restore.landing.finish`)."""
    if not value.is_cuda or not value.is_contiguous() or value.is_conj() or value.is_neg():
        return None
    return value.detach().reshape(-1).view(torch.uint8)


class _Bounce:
    def __init__(self, nbytes: int) -> None:
        self.memory = aligned_buffer(nbytes, populate=True)
        view = memoryview(self.memory)
        self.address = address(view)
        view.release()
        self.pinned = pin(self.address, nbytes, "auto", what=f"a {nbytes >> 20} MiB restore buffer")
        self.host: torch.Tensor | None = torch.frombuffer(self.memory, dtype=torch.uint8)
        self.done: torch.cuda.Event | None = None  # the copy out of it, while one is queued

    def close(self) -> None:
        """Unpin and unmap. A view of the buffer still alive (one held by the traceback of a chunk that
        failed in it, say) keeps the mapping until the collector frees that view: unmapping under it
        is refused, and must not replace the error being handled with a ``BufferError``."""
        if self.pinned:
            self.pinned = False
            unpin(self.address)
        self.host = None
        try:
            self.memory.close()
        except BufferError:
            pass  # freed with its last view (its pages are unpinned already)


class DeviceRing:
    """Pinned buffers of ``nbytes`` each, two per reader, made on first use (see the module docstring)."""

    def __init__(self, nbytes: int, devices: set[torch.device]) -> None:
        self._nbytes = nbytes
        self._count = 0  # set by start(): two per reader keep a copy in flight while the next chunk is read
        self._devices = devices
        self._free: queue.Queue[_Bounce] = queue.Queue()
        self._made: list[_Bounce] = []
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}

    def start(self, readers: int) -> None:
        """Wait for what was queued on the target devices before the restore (not this thread's streams:
        a restore is rare, and a device-wide wait costs nothing then), and make the copy streams;
        ``readers`` threads will land chunks."""
        self._count = 2 * readers
        for device in self._devices:
            torch.cuda.synchronize(device)
            self._streams[device] = torch.cuda.Stream(device)

    def _take(self) -> _Bounce:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if len(self._made) < self._count:
                self._made.append(_Bounce(self._nbytes))
                return self._made[-1]
        return self._free.get()

    def land(self, source: VersionSource, record: TensorRecord, chunk: int, dst: torch.Tensor) -> None:
        """Read chunk ``chunk`` of ``record`` into a ring buffer, verify it, and queue its copy into
        ``dst`` (bytes of a CUDA tensor, exactly the chunk's logical length)."""
        bounce = self._take()
        try:
            if bounce.done is not None:
                bounce.done.synchronize()  # its last copy has left it
                bounce.done = None
            nbytes = dst.numel()
            out = memoryview(bounce.memory)[:nbytes]
            try:
                source.read_logical(record, chunk, out, scratch(scratch_bytes(record.chunk_bytes)), private=True)
            finally:
                out.release()  # else a failed read's traceback would keep the buffer exported
            stream = self._streams[dst.device]
            with torch.cuda.stream(stream):
                assert bounce.host is not None  # until close()
                dst.copy_(bounce.host[:nbytes], non_blocking=bounce.pinned)
                bounce.done = torch.cuda.Event()
                bounce.done.record(stream)
        finally:
            self._free.put(bounce)

    def close(self) -> None:
        """Wait for every copy, then unpin and free the buffers (freed even when a wait failed)."""
        made, self._made = self._made, []
        self._free = queue.Queue()  # a start() after this makes buffers anew (Plan.run_deferred)
        try:
            for stream in self._streams.values():
                stream.synchronize()
        finally:
            for bounce in made:
                bounce.close()
