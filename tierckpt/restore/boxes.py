"""Boxes of a row-major tensor: which part of a stored chunk lands where in a destination piece.

A *box* is ``(start, size)``, one int per dimension, in some tensor's coordinates. A stored piece of
a tensor is cut into chunks of consecutive bytes; :func:`linear_boxes` turns the elements of one chunk
into at most ``2 * ndim - 1`` boxes of the piece, and :func:`copy_boxes` copies whatever part of
them falls in a destination box, straight from the chunk's bytes into the destination's, with one
strided ``copy_`` per box: never through a buffer of the whole tensor.

Copies move whole elements as same-sized integers (bf16 as int16, complex128 as two int64s), so no
dtype needs a copy kernel of its own and no value is ever converted.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from tierckpt.format.saved_layout import Box

__all__ = ["Box", "linear_boxes", "intersect", "copy_boxes", "strides"]

# Element size -> (integer dtype of that size, how many make one element).
_WORDS = {1: (torch.uint8, 1), 2: (torch.int16, 1), 4: (torch.int32, 1), 8: (torch.int64, 1), 16: (torch.int64, 2)}


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return tuple(out)


def linear_boxes(shape: Sequence[int], first: int, stop: int) -> list[Box]:
    """The elements ``first .. stop - 1`` (row-major) of a tensor of ``shape``, as disjoint boxes.

    A range of a row-major tensor is a partial row at each end around whole rows, at every level:
    at most ``2 * len(shape) - 1`` boxes, in order.
    """
    if first >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    row, col = divmod(first, inner)
    last_row, last_col = divmod(stop, inner)
    if row == last_row:  # within one row
        return [((row, *s), (1, *z)) for s, z in linear_boxes(shape[1:], col, last_col)]
    boxes: list[Box] = []
    if col:
        boxes += [((row, *s), (1, *z)) for s, z in linear_boxes(shape[1:], col, inner)]
        row += 1
    if last_row > row:
        boxes.append(((row, *[0] * (len(shape) - 1)), (last_row - row, *shape[1:])))
    if last_col:
        boxes += [((last_row, *s), (1, *z)) for s, z in linear_boxes(shape[1:], 0, last_col)]
    return boxes


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover (same coordinates), or None when they do not meet."""
    start = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    end = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(e <= s for s, e in zip(start, end)):
        return None
    return start, tuple(e - s for s, e in zip(start, end))


def copy_boxes(
    chunk: memoryview,
    first: int,
    piece: Box,
    target: Box,
    out: memoryview,
    itemsize: int,
) -> int:
    """Copy the part of ``target`` that one chunk holds into ``out``; returns the elements copied.

    ``chunk`` holds elements ``first ..`` of the stored piece (row-major, ``len(chunk) // itemsize`` of
    them); ``piece`` and ``target`` are boxes in the global tensor's coordinates: the stored piece, and
    the piece ``out`` holds (row-major, contiguous, ``itemsize`` bytes per element).
    """
    count = chunk.nbytes // itemsize
    if count == 0 or out.nbytes == 0:
        return 0
    word, per = _WORDS[itemsize]
    src = torch.frombuffer(chunk, dtype=word, count=count * per)
    dst = torch.frombuffer(out, dtype=word, count=out.nbytes // itemsize * per)
    piece_start, piece_shape = piece
    target_start, target_shape = target
    src_strides, dst_strides = strides(piece_shape), strides(target_shape)
    copied = 0
    for start, size in linear_boxes(piece_shape, first, first + count):
        box = intersect((tuple(s + o for s, o in zip(start, piece_start)), size), target)
        if box is None:
            continue
        at, size = box
        src_at = sum((a - o) * s for a, o, s in zip(at, piece_start, src_strides)) - first
        dst_at = sum((a - o) * s for a, o, s in zip(at, target_start, dst_strides))
        dims = (*size, per)
        dst.as_strided(dims, (*(s * per for s in dst_strides), 1), dst_at * per).copy_(
            src.as_strided(dims, (*(s * per for s in src_strides), 1), src_at * per)
        )
        copied += math.prod(size)
    return copied
