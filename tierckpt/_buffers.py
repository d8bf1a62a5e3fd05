"""Raw memory helpers: page-aligned buffers and zero-copy byte views of tensors.

Bulk bytes move between tensors, host slots and files without passing through Python objects:
``os.preadv``/``os.pwritev`` take these views directly, and O_DIRECT needs page-aligned addresses.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

PAGE = 4096


def align_up(n: int, alignment: int = PAGE) -> int:
    return (n + alignment - 1) // alignment * alignment


def aligned_buffer(nbytes: int, *, populate: bool = False) -> mmap.mmap:
    """An anonymous, page-aligned, writable mapping of at least ``nbytes`` (and at least one page).

    ``populate`` faults every page in now: copying into touched memory runs several times faster
    than into a fresh allocation, so buffers that are reused pay that cost once, here.
    """
    size = align_up(max(nbytes, 1))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy; keep the tensor alive)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def address(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    if view.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
