"""Checksums of stored bytes.

xxh3-64 measured 13.6 GB/s on one core here (18 GB/s on two), five times the fastest disk we write
to, and it releases the GIL, so hashing runs in the writer threads right before each write while the
chunk is still in cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"


def checksum(data: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def checksum_pieces(pieces: Sequence[memoryview]) -> int:
    """:func:`checksum` of the pieces' bytes one after the other, without joining them."""
    if len(pieces) == 1:
        return checksum(pieces[0])
    state = xxhash.xxh3_64()
    for piece in pieces:
        state.update(piece)  # releases the GIL as the one-shot call does
    return state.intdigest()
