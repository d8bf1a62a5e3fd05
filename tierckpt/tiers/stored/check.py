"""Checking a manifest's records against the data files they point into, before anything is read.

A manifest is untrusted even once its own checksum matches (another tool, a tampered file, a bug), so
restore, promotion and the peer tier check its records (:func:`check_records`) before a byte is
allocated or read:

- every record has a dtype this release can create and a known codec, a shape
  whose element count times the item size is its logical length and whose strides fit 64 bits, and
  chunks of at most :data:`MAX_CHUNK_BYTES`; every chunk lies inside its data file, no two chunks
  overlap, a raw chunk's stored length is its logical length, and a compressed chunk's logical length
  is at most what zstd can expand its stored bytes into (:data:`ZSTD_MAX_EXPANSION`). So what restore
  allocates is backed by bytes on disk: the data file's size for raw versions, at most
  ``ZSTD_MAX_EXPANSION`` times it for compressed ones (a tensor of zeros legitimately compresses that
  far; only decoding could tell it from a bomb, and decoding fails on the first frame that lies).

Every failure is a :class:`CorruptCheckpointError` naming tier, step, the file and the record's key.
"""

from __future__ import annotations

import math
from typing import Any

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import CHUNK_BYTES, MANIFEST_FILE, TensorRecord
from tierckpt.format.layout import where
from tierckpt.state import numpy_dtype, torch_dtype
from tierckpt.storage.scratch import scratch_bytes

__all__ = ["MAX_CHUNK_BYTES", "ZSTD_MAX_EXPANSION", "check_records"]

# Readers keep a scratch buffer of one stored chunk per thread; every writer uses CHUNK_BYTES.
MAX_CHUNK_BYTES = 4 * CHUNK_BYTES
# A zstd block decodes to at most 128 KiB and takes at least 4 stored bytes (3 of header and the byte
# of an RLE block); a byte-shuffle frame is zstd frames and raw planes. Nothing stored expands further.
ZSTD_MAX_EXPANSION = (128 << 10) // 4
_MAX_OFFSET = 2**63 - 1  # off_t, and torch's and numpy's strides
_NUMPY_MAX_DIMS = 64


def check_records(records: tuple[TensorRecord, ...], sizes: dict[str, int], *, tier: str | None, step: int | None) -> None:
    """Check that ``records`` can be allocated and read from data files of these ``sizes`` (by name).

    Raises:
        CorruptCheckpointError: see the module docstring for what is checked; names the file and key.
    """
    extents: dict[str, list[tuple[int, int, str, int]]] = {}
    for r in records:

        def bad(why: str) -> CorruptCheckpointError:
            text = f"{where(tier, step)}: {MANIFEST_FILE}: {r.key}: {why}"
            return CorruptCheckpointError(text, tier=tier, step=step, key=r.key)

        try:
            itemsize = torch_dtype(r.dtype).itemsize if r.kind == "torch" else numpy_dtype(r.dtype).itemsize
        except CorruptCheckpointError as exc:
            raise bad(str(exc)) from None
        if r.kind == "numpy" and len(r.shape) > _NUMPY_MAX_DIMS:
            raise bad(f"{len(r.shape)} dimensions (numpy has at most {_NUMPY_MAX_DIMS})")
        span = max(itemsize, 1)
        for d in r.shape:
            span *= max(d, 1)
            if span > _MAX_OFFSET:
                raise bad(f"shape {_dims(r.shape)} does not fit 64-bit strides")
        if math.prod(r.shape) * itemsize != r.nbytes:
            raise bad(f"{r.nbytes} bytes cannot hold {r.dtype}{_dims(r.shape)}")
        if r.chunk_bytes > MAX_CHUNK_BYTES:
            raise bad(f"chunks of {r.chunk_bytes} bytes, more than the {MAX_CHUNK_BYTES} a reader takes")
        for i, c in enumerate(r.chunks):
            if c is None:  # stored by another rank: checked when resolved, by that rank's files
                continue
            _, length = r.chunk_span(i)
            codec = r.chunk_codec(i)
            if c.base is not None:  # stored against a base chunk, which must hold the chunk's bytes
                _check_stored(bad, i, c.base.codec, c.base.stored, length, r.chunk_bytes, what="its base chunk")
                if codec == "ref":
                    continue  # nothing of it is in this version's files
                if not 0 < c.stored <= scratch_bytes(r.chunk_bytes):
                    raise bad(f"chunk {i} is a delta frame of {c.stored} bytes")
            else:
                _check_stored(bad, i, codec, c.stored, length, r.chunk_bytes)
            file = r.chunk_file(i)
            size = sizes[file]
            if c.offset + c.stored > size:
                raise CorruptCheckpointError(
                    f"{where(tier, step)}: {file}: {r.key} chunk {i} (bytes {c.offset}..{c.offset + c.stored}) lies past "
                    f"the end of the file ({size} bytes): truncated?",
                    tier=tier,
                    step=step,
                    key=r.key,
                )
            if c.stored:
                extents.setdefault(file, []).append((c.offset, c.offset + c.stored, r.key, i))
    for name, spans in extents.items():
        spans.sort()
        for (_, end, key, i), (start, _, other, j) in zip(spans, spans[1:]):
            if start < end:
                raise CorruptCheckpointError(
                    f"{where(tier, step)}: {MANIFEST_FILE}: {key} chunk {i} and {other} chunk {j} overlap in {name}",
                    tier=tier,
                    step=step,
                    key=other,
                )


def _check_stored(bad: Any, i: int, codec: str, stored: int, length: int, chunk_bytes: int, *, what: str = "") -> None:
    """That ``stored`` bytes in ``codec`` can hold a chunk of ``length`` logical bytes."""
    of = f" ({what})" if what else ""
    if codec == "none":
        if stored != length:
            raise bad(f"chunk {i}{of} is stored raw in {stored} bytes, but holds {length}")
    elif not 0 < stored <= scratch_bytes(chunk_bytes) or length > stored * ZSTD_MAX_EXPANSION:
        raise bad(f"chunk {i}{of} cannot decode {stored} stored bytes into {length}")


def _dims(shape: tuple[int, ...]) -> str:
    text = str(list(shape))
    return text if len(text) <= 80 else text[:77] + "..."
