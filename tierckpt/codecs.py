"""Codecs turn a chunk's logical bytes into stored bytes and back: ``none``, ``zstd``, ``zstd+shuffle``.

Each chunk is encoded independently, so chunks compress and decompress in parallel threads
(python-zstandard and numpy's copies release the GIL). Compressor objects are not thread-safe: one
per thread.

``zstd+shuffle`` is for floating-point tensors. Trained weights and optimizer moments are noise to a
general compressor in their mantissa bytes, while the sign/exponent byte of each value takes few
distinct values. The chunk is split into byte planes (plane ``j`` holds byte ``j`` of every element),
and each plane is compressed only when a sample of it compresses by ``min_ratio``: on trained fp32
weights only the top plane does, so the other three are stored as they are, at memcpy speed, instead
of being fed through zstd for nothing. The stored chunk is a small frame::

    "TKS1" | planes u8 | tail u8 | 0 u16 | mode u8 × planes | stored length u64 × planes
    | plane 0 | plane 1 | ... | tail bytes (length % planes, stored raw)

with mode 0 = raw, 1 = zstd. A chunk in which no plane is worth compressing is not framed at all:
it is stored raw and its manifest entry says ``none`` (see :class:`tierckpt.format.Chunk`).
"""

from __future__ import annotations

import struct
import threading
from typing import Protocol

import numpy as np
import zstandard

from tierckpt.errors import ConfigError, CorruptCheckpointError

CODECS = ("none", "zstd", "zstd+shuffle")

_MAGIC = b"TKS1"
_RAW, _ZSTD = 0, 1
_MAX_PLANES = 16  # complex128
# A plane larger than twice this is judged by compressing this much of its middle first.
_SAMPLE = 64 << 10
_MAX_WINDOW = 64 << 20  # the largest chunk a manifest may declare (tierckpt.tiers.stored.read)


class Codec(Protocol):
    name: str

    def encode(self, data: memoryview, itemsize: int = 1) -> memoryview | bytes:
        """Stored bytes for ``data``. May be a view of a per-thread buffer, valid until the thread's next encode."""
        ...

    def decode_into(self, data: memoryview, out: memoryview) -> None:
        """Decode ``data`` into ``out``, which must come out exactly full."""
        ...


class NoneCodec:
    name = "none"

    def encode(self, data: memoryview, itemsize: int = 1) -> memoryview:
        return data

    def decode_into(self, data: memoryview, out: memoryview) -> None:
        if data.nbytes != out.nbytes:
            raise CorruptCheckpointError(f"stored chunk holds {data.nbytes} bytes, expected {out.nbytes}")
        out[:] = data


def _plane_parameters(level: int) -> zstandard.ZstdCompressionParameters | None:
    """zstd's parameters for byte planes at ``level``, or None: the level's own.

    A float plane that compresses (the sign/exponent plane; XOR planes of a delta) is a stream of few
    distinct byte values with almost no repeats worth a match: its bytes go to the entropy coder.
    Level 1's match finder spends most of the time on it looking for matches in a 16 K-entry table
    (``hash_log`` 14). At level 1, the table is cut to 512 entries (``hash_log`` 9); matches are of 7
    bytes or more (level 1's own for a plane over 256 KiB; it looks for 6 below that). Measured on a trained GPT's weights and AdamW moments: whole chunks
    encoded 1.36x faster, their XOR frames 1.15x faster, 0.5% smaller both, and decoded ~10% faster
    (fewer, longer sequences). Decoding does not depend on these parameters. Other levels keep their
    own: a user who asked for more compression gets it.
    """
    if level != 1:
        return None
    return zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=9, search_log=1, target_length=0)


class _Zstd:
    """Per-thread zstd contexts at one level (``planes``: tuned for byte planes, see :func:`_plane_parameters`)."""

    def __init__(self, level: int, *, planes: bool = False) -> None:
        self.level = level
        self._parameters = _plane_parameters(level) if planes else None
        self._local = threading.local()

    def compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            if self._parameters is not None:
                c = zstandard.ZstdCompressor(compression_params=self._parameters)
            else:
                c = zstandard.ZstdCompressor(level=self.level)
            self._local.c = c
        return c

    def decompress_into(self, data: memoryview, out: memoryview) -> None:
        d = getattr(self._local, "d", None)
        if d is None:
            # A frame may ask for a window of its own choosing: no chunk needs more than 64 MiB.
            d = self._local.d = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW)
        try:
            with d.stream_reader(data) as reader:
                filled = 0
                while filled < out.nbytes:
                    n = reader.readinto(out[filled:])
                    if n == 0:
                        break
                    filled += n
                extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"zstd frame does not decode: {exc}") from exc
        if filled != out.nbytes or extra:
            raise CorruptCheckpointError(f"zstd frame decodes to the wrong length (expected {out.nbytes} bytes)")


class ZstdCodec:
    name = "zstd"

    def __init__(self, level: int = 3) -> None:
        self.level = level
        self._zstd = _Zstd(level)

    def encode(self, data: memoryview, itemsize: int = 1) -> bytes:
        return self._zstd.compressor().compress(data)

    def decode_into(self, data: memoryview, out: memoryview) -> None:
        self._zstd.decompress_into(data, out)


def _header(planes: int) -> struct.Struct:
    return struct.Struct(f"<4sBBH{planes}B{planes}Q")


class ShuffleCodec:
    """Byte planes, each compressed with zstd or stored raw (see the module docstring)."""

    name = "zstd+shuffle"

    def __init__(self, level: int = 3, min_ratio: float = 1.05) -> None:
        self.level = level
        self.min_ratio = min_ratio
        self._zstd = _Zstd(level, planes=True)
        self._local = threading.local()

    def _buffer(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "frame", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.frame = np.empty(max(nbytes, 1), np.uint8)
        return buf

    def _worth(self, plane: np.ndarray) -> bytes | None:
        """The plane compressed, or None when it does not shrink by ``min_ratio``."""
        compressor = self._zstd.compressor()
        if plane.nbytes > 2 * _SAMPLE:
            mid = (plane.nbytes - _SAMPLE) // 2
            if len(compressor.compress(plane[mid : mid + _SAMPLE].data)) * self.min_ratio > _SAMPLE:
                return None
        packed = compressor.compress(plane.data)
        return packed if len(packed) * self.min_ratio <= plane.nbytes else None

    def encode(self, data: memoryview, itemsize: int = 1) -> memoryview:
        """A frame of ``itemsize`` planes; the data itself when no plane is worth compressing."""
        k = itemsize
        if not 2 <= k <= _MAX_PLANES or data.nbytes < k:
            return data
        n = data.nbytes
        m, tail = divmod(n, k)
        header = _header(k)
        src = np.frombuffer(data, np.uint8)
        frame = self._buffer(header.size + n)
        # Plane j goes to its own slot first; a plane that compresses is then replaced by its packed
        # bytes and later raw planes move down behind it (usually none: the exponent plane is last).
        columns = src[: m * k].reshape(m, k)
        for j in range(k):
            np.copyto(frame[header.size + j * m : header.size + (j + 1) * m], columns[:, j])
        modes, lengths = [], []
        cursor = header.size
        for j in range(k):
            start = header.size + j * m
            plane = frame[start : start + m]
            packed = self._worth(plane)
            if packed is None:
                if cursor != start:
                    frame[cursor : cursor + m] = plane.copy()
                modes.append(_RAW)
                lengths.append(m)
                cursor += m
            else:
                frame[cursor : cursor + len(packed)] = np.frombuffer(packed, np.uint8)
                modes.append(_ZSTD)
                lengths.append(len(packed))
                cursor += len(packed)
        if _ZSTD not in modes or cursor + tail >= n:
            return data
        frame[cursor : cursor + tail] = src[m * k :]
        header.pack_into(frame.data, 0, _MAGIC, k, tail, 0, *modes, *lengths)
        return frame.data[: cursor + tail]

    def decode_into(self, data: memoryview, out: memoryview) -> None:
        if data.nbytes < 8 or bytes(data[:4]) != _MAGIC:
            raise CorruptCheckpointError("byte-shuffle frame has no valid header")
        k, tail = data[4], data[5]
        if not 2 <= k <= _MAX_PLANES or tail >= k:
            raise CorruptCheckpointError(f"byte-shuffle frame declares {k} planes and a {tail}-byte tail")
        header = _header(k)
        if data.nbytes < header.size:
            raise CorruptCheckpointError("byte-shuffle frame is shorter than its header")
        fields = header.unpack_from(data, 0)
        modes, lengths = fields[4 : 4 + k], fields[4 + k :]
        m, rest = divmod(out.nbytes - tail, k)
        if rest or out.nbytes < tail:
            raise CorruptCheckpointError(f"byte-shuffle frame of {k} planes cannot fill {out.nbytes} bytes")
        if any(mode not in (_RAW, _ZSTD) for mode in modes) or any(
            mode == _RAW and length != m for mode, length in zip(modes, lengths)
        ):
            raise CorruptCheckpointError("byte-shuffle frame has an invalid plane table")
        if header.size + sum(lengths) + tail != data.nbytes:
            raise CorruptCheckpointError("byte-shuffle frame's planes do not add up to its length")
        src = np.frombuffer(data, np.uint8)
        dst = np.frombuffer(out, np.uint8)
        columns = dst[: m * k].reshape(m, k)
        plane_buf = None
        offset = header.size
        for j, (mode, length) in enumerate(zip(modes, lengths)):
            stored = src[offset : offset + length]
            if mode == _ZSTD:
                if plane_buf is None:
                    plane_buf = self._buffer(m)[:m]
                self._zstd.decompress_into(stored.data, plane_buf.data)
                stored = plane_buf
            np.copyto(columns[:, j], stored)
            offset += length
        dst[m * k :] = src[offset:]


def get_codec(name: str, level: int = 3, min_ratio: float = 1.05) -> Codec:
    if name == "none":
        return NoneCodec()
    if name == "zstd":
        return ZstdCodec(level)
    if name == "zstd+shuffle":
        return ShuffleCodec(level, min_ratio)
    raise ConfigError(f"unknown codec {name!r}; use one of: {', '.join(CODECS)}")


_DECODERS: dict[str, Codec] = {}
_DECODERS_LOCK = threading.Lock()


def decoder(name: str) -> Codec:
    """The codec that reads chunks stored with ``name`` (level does not matter for decoding); shared."""
    codec = _DECODERS.get(name)
    if codec is None:
        try:
            made = get_codec(name)
        except ConfigError as exc:
            raise CorruptCheckpointError(f"stored with unknown codec {name!r}") from exc
        with _DECODERS_LOCK:
            codec = _DECODERS.setdefault(name, made)
    return codec
