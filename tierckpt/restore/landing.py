"""Where restored bytes land: new arrays, template pieces staged until all verified, the final copy.

A restore decodes each stored value into a :class:`Target`: a new CPU tensor or array (its own
memory, so nothing else is touched), or a staging area for a template's tensor, copied in by
:func:`finish` only once every chunk of the version verified. :func:`finish` also converts dtypes,
for a restore that asked for ``cast=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tierckpt._buffers import aligned_buffer, owned_tensor, tensor_bytes
from tierckpt.format import TensorRecord
from tierckpt.state import unflatten

__all__ = ["Target", "Work", "finish", "new_array", "over", "staging_area"]

# New tensors at least this large get a page-aligned mapping of their own (glibc's malloc gives
# blocks this size one too); smaller ones come from torch.empty and are copied from scratch.
_OWN_MAPPING = 1 << 20


@dataclass
class Target:
    """Where one record's decoded bytes land, and what the rebuilt state holds for it."""

    record: TensorRecord
    value: Any  # a new tensor/array, or the template's own
    out: memoryview  # the bytes the chunks are decoded into
    fresh: bool  # ``out`` is a new anonymous mapping, faulted in ahead of the reads
    staged: Any = None  # a tensor/array over staging bytes, copied into ``value`` once all verified
    dtensor: Any = None  # the template's DTensor whose local tensor ``value`` is: what the state holds
    template: bool = False  # ``value`` is the template's own (else a new array)
    cuda_bytes: Any = None  # a CUDA template's bytes, which chunks reach through a DeviceRing (device.py)


# One chunk job of a plan: a function of the open source, and its other arguments, which begin with
# the record and the index of the chunk it reads (Plan.read_bytes counts them); it reads that stored
# chunk and lands its bytes in a target (tierckpt.restore.plan.Plan.run runs them).
Work = tuple[Callable[..., None], tuple[Any, ...]]


def new_array(kind: str, dtype: Any, shape: tuple[int, ...], nbytes: int) -> tuple[Any, memoryview, bool]:
    """A new CPU tensor/array: large ones on page-aligned memory of their own."""
    if kind == "torch":
        if nbytes >= _OWN_MAPPING:
            tensor, buf = owned_tensor(dtype, shape, nbytes)
            return tensor, memoryview(buf)[:nbytes], True
        tensor = torch.empty(shape, dtype=dtype)
        return tensor, tensor_bytes(tensor), False
    import numpy as np

    if nbytes >= _OWN_MAPPING:
        buf = aligned_buffer(nbytes)
        array = np.frombuffer(buf, dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)
        return array, memoryview(buf)[:nbytes], True
    array = np.empty(shape, dtype=dtype)
    return array, array.reshape(-1).view(np.uint8).data, False


def staging_area(lent: memoryview | None, size: int) -> tuple[memoryview, bool]:
    """Page-aligned memory for ``size`` staged bytes: ``lent`` (already faulted in) when it is large
    enough, else a fresh mapping (True: to fault in ahead of the reads), which goes when the last
    view of it does, at the end of the load."""
    if lent is not None and lent.nbytes >= size:
        return lent, False
    return memoryview(aligned_buffer(size)), True


def over(arena: memoryview, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...], kind: str) -> Any:
    """A tensor/array of ``dtype`` and ``shape`` over staging bytes (no copy)."""
    if kind == "torch":
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(arena, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
    import numpy as np

    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(arena, dtype=np.uint8, count=nbytes, offset=offset).view(dtype).reshape(shape)


def finish(source: Any, targets: list[Target]) -> Any:
    """Copy what was staged into the template, and rebuild the state (blocking; nothing can fail now).

    Copies to CUDA templates run after everything queued on their device before this call, and are
    done when it returns.

    ``source`` is what the targets were read from: anything with the version's ``skeleton``.
    """
    devices = {t.value.device for t in targets if t.staged is not None and isinstance(t.value, torch.Tensor) and t.value.is_cuda}
    for device in devices:
        # This is not the caller's thread, so not its stream: let whatever the caller queued on the
        # templates finish first (a restore is rare; a device-wide wait costs nothing then).
        torch.cuda.synchronize(device)
    for t in targets:
        if t.staged is None:
            continue
        if isinstance(t.value, torch.Tensor):
            # To a GPU from staging in the pinned pool: queued DMAs, back to back; waited for below,
            # before the staging memory goes back to the pool.
            with torch.no_grad():
                t.value.copy_(t.staged, non_blocking=t.value.is_cuda)
        else:
            t.value[...] = t.staged
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return unflatten(source.skeleton, [t.value if t.dtensor is None else t.dtensor for t in targets])
