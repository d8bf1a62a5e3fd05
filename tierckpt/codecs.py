"""Codecs turn a chunk's logical bytes into stored bytes and back: ``none`` and ``zstd``.

Each chunk is encoded independently, so chunks compress and decompress in parallel threads
(python-zstandard releases the GIL). Compressor objects are not thread-safe: one per thread.
"""

from __future__ import annotations

import threading
from typing import Protocol

import zstandard

from tierckpt.errors import ConfigError, CorruptCheckpointError


class Codec(Protocol):
    name: str

    def encode(self, data: memoryview) -> memoryview | bytes: ...

    def decode_into(self, data: memoryview, out: memoryview) -> None:
        """Decode ``data`` into ``out``, which must come out exactly full."""
        ...


class NoneCodec:
    name = "none"

    def encode(self, data: memoryview) -> memoryview:
        return data

    def decode_into(self, data: memoryview, out: memoryview) -> None:
        if data.nbytes != out.nbytes:
            raise CorruptCheckpointError(f"stored chunk holds {data.nbytes} bytes, expected {out.nbytes}")
        out[:] = data


class ZstdCodec:
    name = "zstd"

    def __init__(self, level: int = 3) -> None:
        self.level = level
        self._local = threading.local()

    def _contexts(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = (zstandard.ZstdCompressor(level=self.level), zstandard.ZstdDecompressor())
            self._local.ctx = ctx
        return ctx

    def encode(self, data: memoryview) -> bytes:
        return self._contexts()[0].compress(data)

    def decode_into(self, data: memoryview, out: memoryview) -> None:
        try:
            with self._contexts()[1].stream_reader(data) as reader:
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


def get_codec(name: str, level: int = 3) -> Codec:
    if name == "none":
        return NoneCodec()
    if name == "zstd":
        return ZstdCodec(level)
    raise ConfigError(f"unknown codec {name!r}; use one of: none, zstd")


def decoder(name: str) -> Codec:
    """The codec that reads chunks stored with ``name`` (level does not matter for decoding)."""
    try:
        return get_codec(name)
    except ConfigError as exc:
        raise CorruptCheckpointError(f"stored with unknown codec {name!r}") from exc
