"""Delta frames: a changed floating-point chunk stored as its XOR against the base chunk, in byte planes.

Trained floats move a little from save to save: their sign, exponent and high mantissa bits mostly
stay. XOR against the base's bytes turns what stayed into zero bytes, and splitting the result into
byte planes (plane ``j`` holds byte ``j`` of every element) gathers those zeros into planes that zstd
packs to almost nothing, while the low mantissa planes, noise either way, are stored as they are. The
frame is :class:`~tierckpt.codecs.ShuffleCodec`'s, of the XOR's bytes: decoding is that codec's
decode, then an XOR into the base's bytes (measured: 1.2x faster than XORing each plane into the
base's bytes as it comes, whose strided read-modify-write costs more than a second pass).

A chunk is stored this way only when the frame is ``min_ratio`` times smaller than the chunk would be
stored whole (estimated by its base chunk's stored size: measured, a frame that only beats the raw
bytes is larger than the whole chunk's zstd+shuffle encoding three times in four at 100 steps from
its base); a chunk equal to its base is not stored at all (a reference, decided on the digests: :func:`digest`). Both
are decided per chunk by the writer (:mod:`tierckpt.tiers.stored.write`).

The XOR runs on 8-byte words where the length allows (numpy releases the GIL).

Trying a frame costs: the base chunk read from the tier and decoded, then the XOR encoded (measured,
more than encoding the chunk whole). A value that changes wholesale between saves never pays (AdamW's
``exp_avg``, with its beta1 of 0.9, moves a tenth of the way to each new gradient: all its mantissa
bits change). :class:`XorHistory` remembers, per value, whether its frames paid in the tier's last
differential versions, and skips the attempt for a while where they did not.
"""

from __future__ import annotations

import threading

import numpy as np
import xxhash

from tierckpt.codecs import ShuffleCodec
from tierckpt.errors import CorruptCheckpointError

__all__ = ["DeltaCodec", "XorHistory", "digest", "xor_into"]

# A value whose frames did not pay is not tried again in the tier's next SKIP_AFTER_MISS differential
# versions: with full_every 10, three tries a cycle instead of nine. A value that starts paying again
# (a learning rate that decays, a frozen part unfrozen) is found out within that many versions.
SKIP_AFTER_MISS = 3


def digest(data: memoryview) -> bytes:
    """A chunk's logical digest: xxh3-128 of its bytes (16 bytes).

    Two chunks with the same digest are taken as equal: 128 bits make an accidental match (about
    2^-128 a pair) far less likely than an undetected memory error; the checksum of what is stored
    still guards every byte read back.
    """
    return xxhash.xxh3_128_digest(data)


def _words(data: memoryview) -> np.ndarray:
    raw = np.frombuffer(data, np.uint8)
    return raw.view(np.uint64) if raw.nbytes % 8 == 0 and raw.ctypes.data % 8 == 0 else raw


def _xor(a: memoryview, b: memoryview, out: memoryview) -> None:
    x, y, z = _words(a), _words(b), _words(out)
    if not x.dtype == y.dtype == z.dtype:
        x, y, z = (np.frombuffer(v, np.uint8) for v in (a, b, out))
    np.bitwise_xor(x, y, out=z)


def xor_into(a: memoryview, out: memoryview) -> None:
    """``out ^= a`` (equal lengths)."""
    if a.nbytes != out.nbytes:
        raise CorruptCheckpointError(f"a delta of {a.nbytes} bytes against a base of {out.nbytes}")
    _xor(a, out, out)


class DeltaCodec:
    """Encodes a chunk against its base chunk, and applies a stored frame to the base's bytes."""

    def __init__(self, level: int = 1, min_ratio: float = 1.05) -> None:
        self.min_ratio = min_ratio
        self._planes = ShuffleCodec(level, min_ratio)
        self._local = threading.local()

    def _buffer(self, nbytes: int) -> memoryview:
        buf: np.ndarray | None = getattr(self._local, "xor", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.xor = np.empty(max(nbytes, 1), np.uint8)
        return memoryview(buf.data)[:nbytes]

    def encode(self, data: memoryview, base: memoryview, itemsize: int, *, ceiling: int | None = None) -> memoryview | None:
        """The frame of ``data`` against ``base`` (a view of a per-thread buffer, valid until this
        thread's next encode), or None when it is not ``min_ratio`` times smaller than ``ceiling``
        (by default ``data``'s length): what the chunk would take stored whole.

        ``base`` is left as it was.
        """
        if data.nbytes != base.nbytes or not data.nbytes:
            return None
        work = self._buffer(data.nbytes)
        _xor(data, base, work)
        frame = self._planes.encode(work, itemsize)
        limit = data.nbytes if ceiling is None else min(ceiling, data.nbytes)
        if frame is work or frame.nbytes * self.min_ratio > limit:
            return None  # it does not pay: the chunk is stored as its tier stores it
        return memoryview(frame)

    def apply(self, frame: memoryview, out: memoryview) -> None:
        """``out`` (the base chunk's logical bytes) becomes the chunk ``frame`` encodes.

        Raises CorruptCheckpointError when the frame does not decode to ``out``'s length.
        """
        work = self._buffer(out.nbytes)
        self._planes.decode_into(frame, work)
        xor_into(work, out)


class XorHistory:
    """Of one tier's values (record keys), whether their XOR frames paid in its last differential
    versions: :meth:`worth_trying` says whether to try a value's frames in the next one.

    Per process: after a restart every value is tried again. Each rank keeps its own (the frames are
    its own business: no rank needs to agree with another on them).
    """

    def __init__(self, skip: int = SKIP_AFTER_MISS) -> None:
        self.skip = skip
        self._versions = 0  # differential versions finished
        self._missed: dict[str, int] = {}  # a value whose frames did not pay: in which version

    def worth_trying(self, key: str) -> bool:
        """Whether the version being written should try frames for value ``key``."""
        missed = self._missed.get(key)
        return missed is None or self._versions - missed >= self.skip

    def finish(self, paid: dict[str, bool]) -> None:
        """A differential version was written: ``paid``, of each value whose frames it tried, whether
        any of its chunks was stored as a frame."""
        self._versions += 1
        for key, ok in paid.items():
            if ok:
                self._missed.pop(key, None)
            else:
                self._missed[key] = self._versions
