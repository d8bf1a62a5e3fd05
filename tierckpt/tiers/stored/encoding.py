"""A filesystem tier's compression policy: which codec each tensor gets, when a chunk is kept raw,
and (``when: faster``) whether a version is compressed at all, from what the tier measured.

Compression must not make a tier slower than its disk. Two measurements decide it:

- compressor throughput: logical bytes encoded per second of encoding, times the number of threads
  that encoded side by side (the tier's I/O threads and the thread running the write, at most one per
  chunk);
- write throughput: logical bytes per second of a whole version written raw (writes and fsync).

Under ``when: faster`` the tier writes a version raw while it has no write measurement yet, then one
compressed to measure the compressor, and from then on compresses only while the compressor keeps up
with the disk. Every ``PROBE_EVERY``-th version takes the other choice once, so a measurement that
went stale (a busier CPU, a slower disk) is taken again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierckpt.codecs import Codec, get_codec
from tierckpt.config import CompressionConfig
from tierckpt.format import TensorRecord
from tierckpt.state import numpy_dtype, torch_dtype
from tierckpt.xordelta import XorHistory

if TYPE_CHECKING:
    from tierckpt.tiers.stored.delta import DeltaBase

log = logging.getLogger("tierckpt")

PROBE_EVERY = 10


@dataclass(frozen=True)
class CompressionStats:
    """What one filesystem tier's compression did so far (``Checkpointer.counters.compression[tier]``).

    Ratios and throughputs are 0.0 until there is something to measure.
    """

    logical_bytes: int = 0  # tensor bytes of the versions this tier wrote
    stored_bytes: int = 0  # what they took on the tier
    chunks_compressed: int = 0
    chunks_raw: int = 0  # chunks stored raw in a compressing version: min_ratio was not met
    chunks_referenced: int = 0  # chunks of differential versions equal to their base's: nothing stored
    chunks_delta: int = 0  # chunks of differential versions stored as their XOR against the base's
    versions_delta: int = 0  # versions written against a base (``delta``)
    versions_compressed: int = 0
    versions_bypassed: int = 0  # versions written raw under when: faster (slower to compress, or measuring)
    compress_bytes_per_s: float = 0.0  # the compressor, with the tier's threads, in logical bytes
    write_bytes_per_s: float = 0.0  # the tier writing raw: whole versions, fsync included
    bypassing: bool = False  # the latest decision of ``when: faster``

    @property
    def ratio(self) -> float:
        """Logical bytes per stored byte (1.0 when nothing was compressed)."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0


def element(record: TensorRecord) -> tuple[int, bool]:
    """A record's item size, and whether its elements are floating-point (complex included)."""
    if record.kind == "torch":
        dtype = torch_dtype(record.dtype)
        return dtype.itemsize, dtype.is_floating_point or dtype.is_complex
    np_dtype = numpy_dtype(record.dtype)
    return np_dtype.itemsize, np_dtype.kind in "fc"


class VersionEncoding:
    """How one version is written: the codec per record, and the accounting of its chunks."""

    def __init__(self, tier: TierEncoding, compress: bool, *, digests: bool = False, delta: DeltaBase | None = None) -> None:
        self._tier = tier
        self.compress = compress
        # A tier with ``delta``: every chunk's logical digest is taken (a whole version keeps them), and
        # ``delta``, this rank's part of the base open, makes this a differential version. A changed
        # chunk is XOR-encoded unless ``when: faster`` chose to write this version raw.
        self.digests = digests or delta is not None
        self.delta = delta
        self.xor = delta is not None and (compress or tier.config.codec == "none")
        self.xor_paid: dict[str, bool] = {}  # of each value whose frames were tried: whether one was kept
        self._lock = threading.Lock()
        self.logical = 0
        self.stored = 0
        self.encoded = 0  # logical bytes that went through an encoder
        self.encode_s = 0.0  # thread-seconds spent encoding them
        self.encoders: set[int] = set()  # the threads that did
        self.chunks_compressed = 0
        self.chunks_raw = 0
        self.chunks_referenced = 0
        self.chunks_delta = 0

    @property
    def raw_layout(self) -> bool:
        """Every record stored uncompressed, in the host slot's 4 KiB-aligned layout (a differential
        version's chunks are packed: a reference takes no room)."""
        return not self.compress and self.delta is None

    def codec_for(self, record: TensorRecord) -> str:
        """The codec ``record`` is stored with on this tier for this version."""
        if not self.compress:
            return "none"
        config = self._tier.config
        if config.shuffle:
            itemsize, floating = element(record)
            if floating and itemsize >= 2:
                return "zstd+shuffle"
        return config.codec

    def encode(self, codec: str, data: memoryview, itemsize: int) -> tuple[str, memoryview]:
        """The chunk codec and stored bytes for the logical chunk ``data`` (raw when it does not pay)."""
        if codec == "none" or not data.nbytes:
            self.account(data.nbytes, data.nbytes, compressed=False)
            return "none", data
        started = time.perf_counter()
        result = self._tier.codec(codec).encode(data, itemsize)
        self.account_encoding(data.nbytes, time.perf_counter() - started)
        out = memoryview(result)
        if result is data or out.nbytes * self._tier.config.min_ratio > data.nbytes:
            self.account(data.nbytes, data.nbytes, compressed=False)
            return "none", data
        self.account(data.nbytes, out.nbytes, compressed=True)
        return codec, out

    def try_xor(self, key: str) -> bool:
        """Whether to try XOR frames for value ``key``'s changed chunks (:class:`~tierckpt.xordelta.XorHistory`)."""
        return self.xor and self._tier.xor_history.worth_trying(key)

    def xor_tried(self, key: str, paid: bool) -> None:
        """A chunk of value ``key`` was tried as a frame; ``paid``: the frame was kept."""
        with self._lock:
            self.xor_paid[key] = self.xor_paid.get(key, False) or paid

    def account_encoding(self, logical: int, seconds: float) -> None:
        """``logical`` bytes went through an encoder (a codec, or a delta frame) in ``seconds`` of this thread."""
        with self._lock:
            self.encoded += logical
            self.encode_s += seconds
            self.encoders.add(threading.get_ident())

    def account_reference(self, logical: int) -> None:
        with self._lock:
            self.logical += logical
            self.chunks_referenced += 1

    def account_delta(self, logical: int, stored: int) -> None:
        with self._lock:
            self.logical += logical
            self.stored += stored
            self.chunks_delta += 1

    def account(self, logical: int, stored: int, *, compressed: bool) -> None:
        with self._lock:
            self.logical += logical
            self.stored += stored
            if self.compress:
                if compressed:
                    self.chunks_compressed += 1
                else:
                    self.chunks_raw += 1


class TierEncoding:
    """One filesystem tier's compression settings, measurements and ``when: faster`` decisions."""

    def __init__(self, config: CompressionConfig, tier: str) -> None:
        self.config = config
        self.tier = tier
        self._codecs: dict[str, Codec] = {}
        self._lock = threading.Lock()
        self._stats = CompressionStats()
        self._versions = 0
        self._compress_bps: float | None = None
        self._write_bps: float | None = None
        self.xor_history = XorHistory()

    def codec(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            with self._lock:
                codec = self._codecs.setdefault(name, get_codec(name, self.config.level, self.config.min_ratio))
        return codec

    @property
    def stats(self) -> CompressionStats:
        with self._lock:
            return self._stats

    def begin(self, *, digests: bool = False, delta: DeltaBase | None = None) -> VersionEncoding:
        """How the next version is written (``digests``, ``delta``: see :class:`VersionEncoding`)."""
        if self.config.codec == "none":
            return VersionEncoding(self, compress=False, digests=digests, delta=delta)
        if self.config.when == "always":
            return VersionEncoding(self, compress=True, digests=digests, delta=delta)
        self._versions += 1
        if self._write_bps is None:
            compress = False
        elif self._compress_bps is None:
            compress = True
        else:
            compress = self._compress_bps >= self._write_bps
            if self._versions % PROBE_EVERY == 0:
                compress = not compress
        return VersionEncoding(self, compress=compress, digests=digests, delta=delta)

    def finish(self, version: VersionEncoding, seconds: float) -> None:
        """Account a version that was written in ``seconds`` (wall clock, fsync included)."""
        compress_bps = write_bps = None
        if version.encoded and version.encode_s > 0:
            # Per-thread rate times the threads that ran side by side: with more threads than cores,
            # each thread's rate already shows the sharing; with one chunk, one thread compressed.
            compress_bps = version.encoded / version.encode_s * len(version.encoders)
        if not version.compress and version.delta is None and version.logical and seconds > 0:  # references write nothing
            write_bps = version.logical / seconds
        with self._lock:
            if version.delta is not None:
                self.xor_history.finish(version.xor_paid)
            self._compress_bps = compress_bps or self._compress_bps
            self._write_bps = write_bps or self._write_bps
            s = self._stats
            bypassing = self.config.codec != "none" and not version.compress
            if bypassing and not s.bypassing and self._compress_bps is not None and self._write_bps is not None:
                log.info(
                    "tier %r: compressing (%.0f MB/s) is slower than writing raw (%.0f MB/s); writing uncompressed",
                    self.tier,
                    self._compress_bps / 1e6,
                    self._write_bps / 1e6,
                )
            self._stats = dataclasses.replace(
                s,
                logical_bytes=s.logical_bytes + version.logical,
                stored_bytes=s.stored_bytes + version.stored,
                chunks_compressed=s.chunks_compressed + version.chunks_compressed,
                chunks_raw=s.chunks_raw + version.chunks_raw,
                chunks_referenced=s.chunks_referenced + version.chunks_referenced,
                chunks_delta=s.chunks_delta + version.chunks_delta,
                versions_delta=s.versions_delta + (1 if version.delta is not None else 0),
                versions_compressed=s.versions_compressed + (1 if version.compress else 0),
                versions_bypassed=s.versions_bypassed + (1 if bypassing else 0),
                compress_bytes_per_s=self._compress_bps or 0.0,
                write_bytes_per_s=self._write_bps or 0.0,
                bypassing=bypassing,
            )
